"""One episode: an agent, an environment, the memory; the trajectory it leaves.

No Ray here: :mod:`lifemem_ray.actors.rollout.workers` runs this in worker actors. Environment
calls run under a per-step time limit (on a helper thread: a hung environment is
abandoned, reported as :class:`EnvHung`, and the caller replaces the environment);
the whole episode under a per-episode limit. The time spent in the agent, the
environment and the memory is recorded in the trajectory's metadata.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lifemem_ray.core.errors import EnvHung, EpisodeTimeout, InvalidArgumentError
from lifemem_ray.core.model import Outcome, Step, Trajectory
from lifemem_ray.engine.retrieval import Retrieval
from lifemem_ray.lab.agents import Agent
from lifemem_ray.lab.envs.base import Environment, StepResult, Task

__all__ = ["EnvHung", "EpisodeLimits", "EpisodeResult", "EpisodeTimeout", "run_episode", "trajectory_id"]

MAX_OBSERVATION_CHARS = 4000  # kept per step in the stored trajectory


@dataclass(frozen=True)
class EpisodeLimits:
    max_steps: int | None = None  # None: the environment's own max_steps
    step_timeout_s: float = 60.0
    episode_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.max_steps is not None and self.max_steps < 1:
            raise InvalidArgumentError(f"max_steps: must be >= 1, got {self.max_steps}")
        if self.step_timeout_s <= 0 or self.episode_timeout_s <= 0:
            raise InvalidArgumentError("step_timeout_s and episode_timeout_s must be > 0")


@dataclass
class EpisodeResult:
    trajectory: Trajectory
    success: bool
    reward: float
    steps: int
    timings: dict[str, float] = field(default_factory=dict)  # agent_s, env_s, memory_s, total_s
    retrieved: list[str] = field(default_factory=list)  # ids of the exemplars the agent saw

    def summary(self) -> dict[str, Any]:
        return {
            "id": self.trajectory.id,
            "env": self.trajectory.env,
            "task_id": self.trajectory.metadata.get("task_id"),
            "success": self.success,
            "reward": self.reward,
            "steps": self.steps,
            **{k: round(v, 6) for k, v in self.timings.items()},
        }


def trajectory_id(run: str, phase: str, task: Task) -> str:
    """Deterministic per (run, phase, task): a retried task maps to the same id, so the
    memory stores it once."""
    return f"{run}/{phase}/{task.env}/{task.id}"


class _Guard:
    """Runs environment calls with a time limit on one reusable helper thread."""

    def __init__(self) -> None:
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float, what: str) -> Any:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lifemem-env")
        future = self._pool.submit(fn, *args)
        try:
            return future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            # The thread is stuck inside the environment: abandon it (and the environment).
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
            raise EnvHung(f"{what} did not return within {timeout:g} s") from None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


_guards = threading.local()


def _guard() -> _Guard:
    guard = getattr(_guards, "guard", None)
    if guard is None:
        guard = _guards.guard = _Guard()
    return guard


def run_episode(
    env: Environment,
    agent: Agent,
    task: Task,
    *,
    retrieve: Callable[[Task], Retrieval | None] | None = None,
    trajectory_id: str,
    limits: EpisodeLimits = EpisodeLimits(),
    metadata: dict[str, Any] | None = None,
) -> EpisodeResult:
    """Run ``task`` to the end (done, max steps) and return its trajectory.

    Raises :class:`EnvHung` when an environment call exceeds the step limit (the
    caller must replace ``env``) and :class:`EpisodeTimeout` past the episode limit.
    """
    max_steps = limits.max_steps or env.max_steps
    if max_steps < 1:
        raise InvalidArgumentError(f"environment {task.env!r}: max_steps must be >= 1, got {max_steps}")
    episode = _Episode(env, task, limits)
    observation, info = episode.env_call(env.reset, task, what="reset")
    instruction = info.get("instruction") or task.instruction
    retrieval = episode.timed("memory", retrieve, task) if retrieve is not None else None
    gold = episode.gold(agent)
    episode.timed("agent", agent.start, task, observation, info, retrieval, gold)
    steps: list[Step] = []
    last: StepResult | None = None
    current = observation
    reward = 0.0
    for _ in range(max_steps):
        episode.check_deadline()
        decision = episode.timed("agent", agent.act, current, info)
        last = episode.env_call(env.step, decision.action, what=f"step {len(steps) + 1}")
        reward += float(last.reward or 0.0)
        current, info = last.observation, last.info
        steps.append(
            Step(
                action=decision.action or "(empty)",
                thought=decision.thought,
                observation=current[:MAX_OBSERVATION_CHARS],
            )
        )
        if last.done:
            break
    success = bool(last is not None and last.info.get("success"))
    timings = episode.timings()
    trajectory = Trajectory(
        env=task.env,
        task=instruction,
        steps=tuple(steps),
        outcome=Outcome(success=success, reward=reward),
        id=trajectory_id,
        initial_observation=observation[:MAX_OBSERVATION_CHARS],
        metadata=_episode_metadata(task, agent, last, timings, metadata),
    )
    retrieved = [hit.id for hit in retrieval.trajectories] if retrieval is not None else []
    return EpisodeResult(trajectory, success, reward, len(steps), timings, retrieved)


class _Episode:
    """One episode's clock: environment calls under the step and episode limits, and the
    seconds spent in the environment, the agent and the memory."""

    def __init__(self, env: Environment, task: Task, limits: EpisodeLimits) -> None:
        self.env, self.task, self.limits = env, task, limits
        self.guard = _guard()
        self.started = time.perf_counter()
        self.deadline = self.started + limits.episode_timeout_s
        self.spent = {"agent": 0.0, "env": 0.0, "memory": 0.0}

    def _timeout(self, where: str = "") -> EpisodeTimeout:
        return EpisodeTimeout(
            f"task {self.task.env}/{self.task.id}: episode exceeded {self.limits.episode_timeout_s:g} s{where}"
        )

    def check_deadline(self) -> None:
        if time.perf_counter() > self.deadline:
            raise self._timeout()

    def timed(self, part: str, fn: Callable[..., Any], *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.spent[part] += time.perf_counter() - t0

    def env_call(self, fn: Callable[..., Any], *args: Any, what: str) -> Any:
        left = self.deadline - time.perf_counter()
        if left <= 0:
            raise self._timeout()
        t0 = time.perf_counter()
        try:
            return self.guard.call(
                fn, *args, timeout=min(self.limits.step_timeout_s, left), what=f"{self.task.env}/{self.task.id}: {what}"
            )
        except EnvHung:
            if left < self.limits.step_timeout_s:  # the episode's time ran out first (the env is abandoned too)
                raise self._timeout(f" (in {what})") from None
            raise
        finally:
            self.spent["env"] += time.perf_counter() - t0

    def gold(self, agent: Agent) -> list[str] | None:
        """The environment's solution for an agent that uses it: a planner may take long
        (ALFWorld), so it is bounded by the episode's time, not a step's."""
        if not agent.uses_gold:
            return None
        left = self.deadline - time.perf_counter()
        t0 = time.perf_counter()
        try:
            return self.guard.call(
                self.env.gold_actions,
                self.task,
                timeout=max(left, 0.001),
                what=f"{self.task.env}/{self.task.id}: gold_actions",
            )
        except EnvHung:
            raise self._timeout(" (in gold_actions)") from None
        finally:
            self.spent["env"] += time.perf_counter() - t0

    def timings(self) -> dict[str, float]:
        return {
            "agent_s": self.spent["agent"],
            "env_s": self.spent["env"],
            "memory_s": self.spent["memory"],
            "total_s": time.perf_counter() - self.started,
        }


def _episode_metadata(
    task: Task, agent: Agent, last: StepResult | None, timings: dict[str, float], extra: dict[str, Any] | None
) -> dict[str, Any]:
    meta = {
        "task_id": task.id,
        "split": task.split,
        "agent": agent.name,
        "done": bool(last is not None and last.done),
        "timings": {k: round(v, 6) for k, v in timings.items()},
        **({"task_type": task.metadata["task_type"]} if "task_type" in task.metadata else {}),
        **(extra or {}),
    }
    if last is not None and "score" in last.info and isinstance(last.info["score"], (int, float)):
        meta["score"] = float(last.info["score"])
    return meta
