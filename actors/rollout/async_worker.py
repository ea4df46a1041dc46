"""AsyncRolloutWorker: one worker process that runs many episodes at once with asyncio.

A :class:`~lifemem_ray.actors.rollout.workers.RolloutWorker` runs one episode at a time, so
with an LLM agent it spends nearly all of its time waiting for the model. This worker is a
Ray async actor: :meth:`AsyncRolloutWorker.run` is one task, and up to ``episodes`` of them
run at once on the actor's event loop (:class:`~lifemem_ray.actors.rollout.workers.RolloutPool`
keeps that many in flight with ``episodes_per_worker``). What is true of each task:

* **One episode, one agent, one environment.** Agents and environments keep per-episode
  state, so the worker keeps idle ones per name and hands each running episode its own
  (at most ``episodes`` of each per name); a ReAct agent's LLM calls are awaited
  (:meth:`ReActAgent.aact <lifemem_ray.lab.agents.ReActAgent.aact>`), and every ReAct agent
  of the worker shares one :class:`~lifemem_ray.llm.transport.LLMClient`, whose
  ``llm.concurrency`` bounds the worker's LLM calls in flight (set it to at least
  ``episodes``).
* **Environments run in a thread, never inline.** Their calls are sync and often CPU-bound:
  each environment instance has its own helper thread
  (:class:`~lifemem_ray.lab.episode.EnvThread`: created on it, stepped on it, under the
  step limit), so a slow or hung environment never blocks the event loop and the other
  episodes; the GIL still serialises their Python code.
* **Waiting tasks get ready.** The pool hands a worker up to twice ``episodes`` tasks; those
  waiting for an episode slot have their task's embedding computed meanwhile (the costly
  part of a retrieval on a CPU), so a slot that frees starts its next episode at once.
* **The memory through the async client.** Retrieval awaits
  :class:`~lifemem_ray.actors.client.awaiting.AsyncMemoryClient` (in the slot, so the
  episode sees the memory as it is when it starts); the trajectory is
  submitted with its async add when the episode ends (the episode never waits on the
  write), and the worker awaits the acknowledgement before it answers for the task, outside
  the episode slot. The answer says ``stored`` (the add's status, or ``conflict-existing``)
  or ``not_stored`` (why): the pool then retries the task with the same trajectory id, as
  it retries any failed attempt, so a trajectory is stored at most once.
* **A failing episode fails alone.** An environment that hangs or raises is abandoned and
  the task retried on a fresh one (``env_retries``); a task that still fails goes back to
  the pool as that task's error. Only the process dying (a crash inside an environment)
  takes the worker's other episodes with it; the pool retries each of them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lifemem_ray.actors.cluster import ray_metrics
from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.actors.rollout.worker_base import (
    MAX_EPISODES_PER_WORKER,
    EpisodeSpec,
    RolloutWorkerBase,
    add_failure,
    best_env,
    global_profile,
    shaped,
)
from lifemem_ray.core.errors import InvalidArgumentError
from lifemem_ray.engine.retrieval import Retrieval
from lifemem_ray.lab.agents import Agent
from lifemem_ray.lab.envs import Environment, Task
from lifemem_ray.lab.episode import EnvThread, EpisodeLimits, EpisodeResult, arun_episode, trajectory_id
from lifemem_ray.lab.experiment_config import RETRIEVING_MODES

__all__ = ["AsyncRolloutWorker"]

log = logging.getLogger(__name__)


@dataclass
class _EnvSlot:
    """One environment instance and the helper thread all of its calls run on."""

    env: Environment
    thread: EnvThread


class AsyncRolloutWorker(RolloutWorkerBase):
    """A worker actor that runs up to ``episodes`` tasks at once (module docstring)."""

    def __init__(
        self,
        worker_id: int,
        env_options: dict[str, dict[str, Any]] | None = None,
        config: DeploymentConfig | None = None,
        limits: EpisodeLimits = EpisodeLimits(),
        seed: int = 0,
        env_retries: int = 2,
        *,
        episodes: int = 8,
    ) -> None:
        super().__init__(worker_id, env_options, config, limits, seed, env_retries)
        if not 1 <= episodes <= MAX_EPISODES_PER_WORKER:
            raise InvalidArgumentError(
                f"episodes must be within [1, {MAX_EPISODES_PER_WORKER}], got {episodes}",
                where="AsyncRolloutWorker",
            )
        self.episodes = episodes
        self._slots = asyncio.Semaphore(episodes)  # episodes running at once, whatever the pool sends
        self._idle_envs: dict[str, list[_EnvSlot]] = {}
        self._idle_agents: dict[tuple[str, int], list[Agent]] = {}
        self._agents: list[Agent] = []
        self._llm: Any = None  # the LLMClient every ReAct agent of this worker shares
        self._clients: dict[str, Any] = {}  # namespace -> AsyncMemoryClient

    async def ping(self) -> int:
        return self.worker_id

    # -- resources ---------------------------------------------------------------------
    async def _env(self, name: str) -> _EnvSlot:
        """An idle environment of this name, or a new one, made on its own thread."""
        idle = self._idle_envs.setdefault(name, [])
        if idle:
            return idle.pop()
        thread = EnvThread()
        env = await thread.acall(self._new_env, name, limit_s=None, what=f"starting {name}")
        return _EnvSlot(env, thread)

    def _release_env(self, name: str, slot: _EnvSlot, healthy: bool) -> None:
        """Back to the idle ones, or abandoned (closed in the background) when it failed."""
        if healthy:
            self._idle_envs.setdefault(name, []).append(slot)
            return
        slot.thread.close()
        self._abandon_env(slot.env)

    def _agent(self, name: str, seed: int) -> Agent:
        idle = self._idle_agents.setdefault((name, seed), [])
        if idle:
            return idle.pop()
        agent = self._new_agent(name, seed, client=self._llm_client() if name == "react" else None)
        self._agents.append(agent)
        return agent

    def _llm_client(self) -> Any:
        if self._llm is None:
            from lifemem_ray.llm.transport import LLMClient

            llm = self.config.llm
            if llm.concurrency < self.episodes:
                log.warning(
                    "worker %d: llm.concurrency = %d caps the LLM calls in flight below its %d episodes; raise it to %d",
                    self.worker_id,
                    llm.concurrency,
                    self.episodes,
                    self.episodes,
                )
            self._llm = LLMClient(llm, metrics=ray_metrics.SINK)
        return self._llm

    def _client(self, namespace: str) -> Any:
        """This worker's client of the deployment in ``namespace`` (it connects at its first
        call, and again after the deployment went away: the client's own rule)."""
        client = self._clients.get(namespace)
        if client is None:
            from lifemem_ray.actors.client.awaiting import AsyncMemoryClient

            client = self._clients[namespace] = AsyncMemoryClient(namespace, self.config)
        return client

    # -- one task ----------------------------------------------------------------------
    async def _retriever(self, spec: EpisodeSpec) -> Callable[[Task], Any] | None:
        """What each mode shows the agent, as the blocking worker's retriever, awaited."""
        if spec.mode == "none":
            return None
        budget = self.config.retrieval.token_budget
        if spec.mode == "global-skills":
            return global_profile(spec, budget)  # no memory call: inline
        client = self._client(spec.namespace)  # type: ignore[arg-type]
        routes = dict(spec.routes)

        async def retrieve(task: Task) -> Retrieval:  # the task's vector: from the client's cache after the first call
            if spec.mode == "trajectory":
                return await client.retrieve(task.instruction, None, spec.k, skills=False)
            env: str | None = routes.get(task.env, task.env)
            if not env:
                env = best_env(await client.retrieve(task.instruction, None, spec.k, skills=False))
            if env is None:  # an empty memory
                return Retrieval(task.instruction, task.env, [], [], "", 0, budget)
            skills = spec.mode != "lifemem-no-skills"
            return shaped(spec, await client.retrieve(task.instruction, env, spec.k, skills=skills), env, budget)

        return retrieve

    async def _episode(self, task: Task, spec: EpisodeSpec, retrieve: Callable[[Task], Any] | None) -> EpisodeResult:
        """The episode, on a fresh environment after each environment fault (``env_retries``)."""
        seed = self.seed if spec.seed is None else spec.seed
        agent = self._agent(spec.agent, seed)
        last_error: BaseException | None = None
        try:
            for attempt in range(self.env_retries + 1):
                slot = await self._env(task.env)
                healthy = False
                try:
                    result = await arun_episode(
                        slot.env,
                        agent,
                        task,
                        retrieve=retrieve,
                        trajectory_id=trajectory_id(spec.run, spec.phase, task),
                        limits=self.limits,
                        metadata=self._metadata(spec),
                        env_thread=slot.thread,
                    )
                    healthy = True
                    return result
                except Exception as exc:  # sorted by _env_fault: the environment's faults are retried
                    healthy = not self._env_fault(exc, task, attempt)
                    if healthy:
                        raise
                    last_error = exc
                finally:
                    self._release_env(task.env, slot, healthy)
            raise self._gave_up(task, last_error)
        finally:
            self._idle_agents[(spec.agent, seed)].append(agent)

    async def run(self, task: Task, spec: EpisodeSpec, return_trajectory: bool = False) -> dict[str, Any]:
        """Run ``task`` (one of up to ``episodes`` at once) and, with ``spec.write``, submit its
        trajectory and await the acknowledgement: the answer carries ``stored`` or ``not_stored``."""
        add = None
        submit_s = 0.0
        retrieve = await self._retriever(spec)
        if spec.namespace is not None and (spec.write or spec.mode in RETRIEVING_MODES):
            await self._client(spec.namespace).vectors([task.instruction])  # embedded while waiting for a slot
        async with self._slots:
            result = await self._episode(task, spec, retrieve)
            if spec.write:
                t0 = time.perf_counter()
                client = self._client(spec.namespace)  # type: ignore[arg-type]
                add = client.add(result.trajectory)  # with the task's vector when the client holds it
                submit_s = time.perf_counter() - t0
        reply = self._reply(result, submit_s, return_trajectory)
        if add is not None:  # outside the slot: the next episode need not wait for the memory
            started = time.monotonic()
            try:
                reply["stored"] = (await add).status
            except Exception as exc:  # noqa: BLE001 - sorted by add_failure: a conflict, a lost answer, a refusal
                reply["stored"], why = add_failure(exc)
                if why is not None:
                    reply["not_stored"] = why
            reply["summary"]["ack_s"] = round(time.monotonic() - started, 6)
        return reply

    async def close(self) -> None:
        for slots in self._idle_envs.values():
            for slot in slots:
                slot.thread.close()
                self._close_env(slot.env)
        self._idle_envs.clear()
        for agent in self._agents:
            agent.close()
        self._agents.clear()
        self._idle_agents.clear()
        if self._llm is not None:
            self._llm.close()
            self._llm = None
        for client in self._clients.values():
            client.close()
        self._clients.clear()
