"""One episode: an agent, an environment, the memory; the trajectory it leaves.

No Ray here: :mod:`lifemem_ray.actors.rollout` runs this in worker actors. Environment
calls run under a per-step time limit (on a helper thread: a hung environment is
abandoned, reported as :class:`EnvHung`, and the caller replaces the environment);
the whole episode under a per-episode limit. The time spent in the agent, the
environment and the memory is recorded in the trajectory's metadata.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .agents import Agent
from .envs.base import Environment, StepResult, Task
from .model import Outcome, Step, Trajectory
from .retrieval import Retrieval
from .errors import EnvHung, EpisodeTimeout

__all__ = ["EnvHung", "EpisodeLimits", "EpisodeResult", "EpisodeTimeout", "run_episode", "trajectory_id"]

MAX_OBSERVATION_CHARS = 4000  # kept per step in the stored trajectory


@dataclass(frozen=True)
class EpisodeLimits:
    max_steps: int | None = None  # None: the environment's own max_steps
    step_timeout_s: float = 60.0
    episode_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps: must be >= 1, got {self.max_steps}")
        if self.step_timeout_s <= 0 or self.episode_timeout_s <= 0:
            raise ValueError("step_timeout_s and episode_timeout_s must be > 0")


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
    guard = _guard()
    started = time.perf_counter()
    deadline = started + limits.episode_timeout_s
    t_env = t_agent = t_memory = 0.0

    def env_call(fn: Callable[..., Any], *args: Any, what: str) -> Any:
        nonlocal t_env
        left = deadline - time.perf_counter()
        if left <= 0:
            raise EpisodeTimeout(f"task {task.env}/{task.id}: episode exceeded {limits.episode_timeout_s:g} s")
        t0 = time.perf_counter()
        try:
            return guard.call(fn, *args, timeout=min(limits.step_timeout_s, left), what=f"{task.env}/{task.id}: {what}")
        except EnvHung:
            if left < limits.step_timeout_s:  # the episode's time ran out first (the env is abandoned too)
                raise EpisodeTimeout(f"task {task.env}/{task.id}: episode exceeded {limits.episode_timeout_s:g} s (in {what})") from None
            raise
        finally:
            t_env += time.perf_counter() - t0

    max_steps = limits.max_steps or env.max_steps
    if max_steps < 1:
        raise ValueError(f"environment {task.env!r}: max_steps must be >= 1, got {max_steps}")
    observation, info = env_call(env.reset, task, what="reset")
    instruction = info.get("instruction") or task.instruction
    retrieval: Retrieval | None = None
    if retrieve is not None:
        t0 = time.perf_counter()
        retrieval = retrieve(task)
        t_memory += time.perf_counter() - t0
    gold = None
    if agent.uses_gold:  # a planner may take long (ALFWorld): bounded by the episode's time, not a step's
        left = deadline - time.perf_counter()
        t0 = time.perf_counter()
        try:
            gold = guard.call(env.gold_actions, task, timeout=max(left, 0.001), what=f"{task.env}/{task.id}: gold_actions")
        except EnvHung:
            raise EpisodeTimeout(f"task {task.env}/{task.id}: episode exceeded {limits.episode_timeout_s:g} s (in gold_actions)") from None
        finally:
            t_env += time.perf_counter() - t0
    t0 = time.perf_counter()
    agent.start(task, observation, info, retrieval, gold)
    t_agent += time.perf_counter() - t0

    steps: list[Step] = []
    last: StepResult | None = None
    current = observation
    reward = 0.0
    for _ in range(max_steps):
        if time.perf_counter() > deadline:
            raise EpisodeTimeout(f"task {task.env}/{task.id}: episode exceeded {limits.episode_timeout_s:g} s")
        t0 = time.perf_counter()
        decision = agent.act(current, info)
        t_agent += time.perf_counter() - t0
        last = env_call(env.step, decision.action, what=f"step {len(steps) + 1}")
        reward += float(last.reward or 0.0)
        current, info = last.observation, last.info
        steps.append(Step(action=decision.action or "(empty)", thought=decision.thought, observation=current[:MAX_OBSERVATION_CHARS]))
        if last.done:
            break
    success = bool(last is not None and last.info.get("success"))
    total = time.perf_counter() - started
    timings = {"agent_s": t_agent, "env_s": t_env, "memory_s": t_memory, "total_s": total}
    meta = {
        "task_id": task.id,
        "split": task.split,
        "agent": agent.name,
        "done": bool(last is not None and last.done),
        "timings": {k: round(v, 6) for k, v in timings.items()},
        **({"task_type": task.metadata["task_type"]} if "task_type" in task.metadata else {}),
        **(metadata or {}),
    }
    if last is not None and "score" in last.info and isinstance(last.info["score"], (int, float)):
        meta["score"] = float(last.info["score"])
    trajectory = Trajectory(
        env=task.env,
        task=instruction,
        steps=tuple(steps),
        outcome=Outcome(success=success, reward=reward),
        id=trajectory_id,
        initial_observation=observation[:MAX_OBSERVATION_CHARS],
        metadata=meta,
    )
    retrieved = [hit.id for hit in retrieval.trajectories] if retrieval is not None else []
    return EpisodeResult(trajectory, success, reward, len(steps), timings, retrieved)
