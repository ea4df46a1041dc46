"""Many episodes at once: the async episode loop, the ReAct agent's async LLM calls, and
rollout workers with ``episodes_per_worker`` > 1 against a real memory deployment.

The LLM is the local OpenAI-protocol stub answering after a delay; concurrency is checked
where it shows, at the stub (requests in flight at once), never by timing."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest
from support.openai_stub import OpenAIStub, Reply

from lifemem_ray.core.errors import ConfigError, EnvHung
from lifemem_ray.lab.agents import GoldAgent, ReActAgent
from lifemem_ray.lab.envs import Task, make_env
from lifemem_ray.lab.episode import EpisodeLimits, arun_episode, run_episode
from lifemem_ray.lab.experiment_config import ExperimentConfig
from lifemem_ray.llm.llm_config import LLMConfig
from lifemem_ray.llm.prompts import neutralise
from lifemem_ray.llm.transport import LLMClient

LATENCY_S = 0.4  # the stub's answer delay: long enough that concurrent episodes overlap there
_TASK = re.compile(r"<task>(.*?)</task>", re.S)


def _sql_tasks(n: int) -> list[Task]:
    env = make_env("sql")
    try:
        return env.tasks("train", limit=n)
    finally:
        env.close()


class SqlPlayer:
    """The stub's ReAct answers for sql tasks: one query, then the gold answer for the tasks
    in ``solve`` and a wrong one for the others, so the outcomes depend on the task alone."""

    def __init__(self, tasks: list[Task], solve: set[str]) -> None:
        env = make_env("sql")
        self.answers = {
            neutralise(t.instruction): env.gold_actions(t)[-1]
            if t.id in solve
            else "Action: Answer\nFinal Answer: [(-1,)]"
            for t in tasks
        }
        env.close()

    def __call__(self, request: dict[str, Any]) -> Reply | None:
        if not request["messages"][0]["content"].startswith("You are an agent"):
            return None  # not an agent's turn
        user = request["messages"][1]["content"]
        if "Your steps so far:" not in user:
            return Reply.json({"thought": "look first", "action": "Operation: SELECT 1;"})
        found = _TASK.search(user)
        return Reply.json({"thought": "answer", "action": self.answers[found.group(1) if found else ""]})


def _llm(stub: OpenAIStub, concurrency: int = 8) -> LLMConfig:
    return LLMConfig(
        backend="openai",
        base_url=stub.base_url,
        model="stub-agent",
        timeout_s=20,
        max_retries=1,
        concurrency=concurrency,
    )


# -- the async episode loop, no Ray ------------------------------------------------------------


def test_the_async_loop_gives_the_blocking_loops_episode():
    env, other = make_env("sql"), make_env("sql")
    for task in _sql_tasks(4):
        blocking = run_episode(env, GoldAgent(), task, trajectory_id="b")
        awaited = asyncio.run(arun_episode(other, GoldAgent(), task, trajectory_id="b"))
        assert awaited.trajectory.fingerprint == blocking.trajectory.fingerprint
        assert (awaited.success, awaited.steps, awaited.reward) == (blocking.success, blocking.steps, blocking.reward)
        assert set(awaited.timings) == {"agent_s", "env_s", "memory_s", "total_s"}
    env.close()
    other.close()


def test_a_hung_environment_fails_its_episode_alone(tmp_path):
    """The hung environment's call is on its own thread: the step limit fires while the
    event loop goes on with the other episode, which completes."""
    tasks = _sql_tasks(2)
    hung = make_env("faulty", inner="sql", marker_dir=str(tmp_path), hang_on=[tasks[0].id])

    async def both() -> list[Any]:
        limits = EpisodeLimits(step_timeout_s=1.0)
        return await asyncio.gather(
            arun_episode(hung, GoldAgent(), tasks[0], trajectory_id="h", limits=limits),
            arun_episode(make_env("sql"), GoldAgent(), tasks[1], trajectory_id="ok", limits=limits),
            return_exceptions=True,
        )

    failed, done = asyncio.run(both())
    hung.close()
    assert isinstance(failed, EnvHung) and "reset did not return within 1 s" in str(failed)
    assert done.success


def test_concurrent_react_episodes_have_their_calls_in_flight_together():
    """N episodes on one event loop, N ReAct agents sharing one client: N requests at the
    stub at once, and the outcomes of N episodes run one by one."""
    tasks = _sql_tasks(5)
    player = SqlPlayer(tasks, {tasks[0].id, tasks[1].id, tasks[3].id})
    with OpenAIStub(responder=player, latency_s=LATENCY_S) as stub:
        client = LLMClient(_llm(stub, concurrency=len(tasks)))
        try:

            async def all_at_once() -> list[Any]:
                return await asyncio.gather(
                    *(
                        arun_episode(make_env("sql"), ReActAgent(client.config, client=client), t, trajectory_id=t.id)
                        for t in tasks
                    )
                )

            together = asyncio.run(all_at_once())
            in_flight = stub.max_in_flight
            stub.max_in_flight = 0
            one_by_one = [
                run_episode(make_env("sql"), ReActAgent(client.config, client=client), t, trajectory_id=t.id)
                for t in tasks
            ]
        finally:
            client.close()
    assert in_flight == len(tasks) and stub.max_in_flight == 1
    assert [r.success for r in together] == [r.success for r in one_by_one] == [True, True, False, True, False]
    assert [r.trajectory.fingerprint for r in together] == [r.trajectory.fingerprint for r in one_by_one]


def test_llm_concurrency_bounds_the_calls_in_flight():
    tasks = _sql_tasks(4)
    with OpenAIStub(responder=SqlPlayer(tasks, set()), latency_s=0.2) as stub:
        client = LLMClient(_llm(stub, concurrency=2))
        try:

            async def all_at_once() -> list[Any]:
                return await asyncio.gather(
                    *(
                        arun_episode(make_env("sql"), ReActAgent(client.config, client=client), t, trajectory_id=t.id)
                        for t in tasks
                    )
                )

            results = asyncio.run(all_at_once())
        finally:
            client.close()
    assert stub.max_in_flight == 2 and all(r.steps == 2 for r in results)


def test_episodes_per_worker_is_a_bounded_setting():
    assert ExperimentConfig().episodes_per_worker == 1
    assert ExperimentConfig(episodes_per_worker=64).checked().episodes_per_worker == 64
    with pytest.raises(ConfigError, match="episodes_per_worker"):
        ExperimentConfig(episodes_per_worker=0).checked()
    with pytest.raises(ConfigError, match="episodes_per_worker"):
        ExperimentConfig.load(overrides={"episodes_per_worker": 5000})


# -- rollout workers on Ray, against a real deployment ----------------------------------------


def _pool_config(memory: Any, stub: OpenAIStub | None, concurrency: int = 8) -> Any:
    settings: dict[str, Any] = {}
    if stub is not None:
        settings = {
            "llm.backend": "openai",
            "llm.base_url": stub.base_url,
            "llm.model": "stub-agent",
            "llm.timeout_s": 20,
            "llm.concurrency": concurrency,
        }
    return memory.config.replace(settings)
