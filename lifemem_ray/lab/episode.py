"""One episode: an agent, an environment, the memory; the trajectory it leaves.

No Ray here: :mod:`lifemem_ray.actors.rollout.workers` runs this in worker actors. Environment
calls run under a per-step time limit (on a helper thread: a hung environment is
abandoned, reported as :class:`EnvHung`, and the caller replaces the environment);
the whole episode under a per-episode limit. The time spent in the agent, the
environment and the memory is recorded in the trajectory's metadata.

Two loops carry out the same episode: :func:`run_episode` (blocking) and
:func:`arun_episode` (a coroutine, so that one event loop drives many episodes at once).
The rules live once, in ``_episode_script``: a generator that says what to call next
(reset, retrieve, the agent, a step) and builds the trajectory; each loop only carries out
the calls, the blocking one directly, the async one by awaiting them. One episode has one
agent (its policy state is per episode) and one environment instance.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
import time
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass, field
from typing import Any

from lifemem_ray.core.errors import EnvHung, EpisodeTimeout, InvalidArgumentError
from lifemem_ray.core.model import Outcome, Step, Trajectory
from lifemem_ray.engine.retrieval import Retrieval
from lifemem_ray.lab.agents import Agent
from lifemem_ray.lab.envs.base import Environment, StepResult, Task

__all__ = [
    "EnvHung",
    "EnvThread",
    "EpisodeLimits",
    "EpisodeResult",
    "EpisodeTimeout",
    "arun_episode",
    "run_episode",
    "trajectory_id",
]

MAX_OBSERVATION_CHARS = 4000  # kept per step in the stored trajectory


@dataclass(frozen=True)
class EpisodeLimits:
    max_steps: int | None = None  # None: the environment's own max_steps
    step_timeout_s: float = 60.0
    episode_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.max_steps is not None and self.max_steps < 1:
            raise InvalidArgumentError(f"must be >= 1, got {self.max_steps}", where="max_steps")
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


class EnvThread:
    """Runs one environment's calls with a time limit on one reusable helper thread.

    The blocking loop waits on the call's future; the async loop awaits it, so the event
    loop goes on with other episodes meanwhile. A call that runs past its limit leaves its
    thread stuck inside the environment: the thread is abandoned (the next call starts a
    fresh one) and :class:`EnvHung` raised; the caller then abandons the environment too."""

    def __init__(self) -> None:
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def _submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lifemem-env")
        return self._pool.submit(fn, *args)

    def _hung(self, timeout: float, what: str) -> EnvHung:
        self.close()  # the thread is stuck inside the environment: abandon it (and the environment)
        return EnvHung(f"{what} did not return within {timeout:g} s")

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float, what: str) -> Any:
        """``fn(*args)`` on the helper thread, waited for at most ``timeout`` seconds."""
        future = self._submit(fn, *args)
        try:
            return future.result(timeout=timeout)
        except TimeoutError:
            if future.done() and not future.cancelled():
                raise  # the environment's own TimeoutError, not a hang
            raise self._hung(timeout, what) from None

    async def acall(self, fn: Callable[..., Any], *args: Any, limit_s: float | None, what: str) -> Any:
        """``fn(*args)`` on the helper thread, awaited for at most ``limit_s`` seconds (None:
        no limit, for a slow start such as a JVM's)."""
        future = self._submit(fn, *args)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), limit_s)
        except TimeoutError:
            if future.done() and not future.cancelled():
                raise  # the environment's own TimeoutError, not a hang
            raise self._hung(limit_s or 0.0, what) from None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


_guards = threading.local()


def _guard() -> EnvThread:
    guard = getattr(_guards, "guard", None)
    if guard is None:
        guard = _guards.guard = EnvThread()
    return guard


@dataclass(frozen=True)
class _Call:
    """One call the episode needs made: ``part`` says how (``env``: under the step limit;
    ``gold``: under the episode's limit; ``agent`` and ``memory``: timed); ``afn`` is the
    async loop's twin of ``fn`` (an agent's ``astart`` / ``aact``)."""

    part: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    what: str = ""
    afn: Callable[..., Awaitable[Any]] | None = None


def _episode_script(
    env: Environment,
    agent: Agent,
    task: Task,
    episode: _Episode,
    retrieve: Callable[[Task], Any] | None,
    trajectory_id: str,
    metadata: dict[str, Any] | None,
) -> Generator[_Call, Any, EpisodeResult]:
    """The episode's rules, once for both loops: each ``yield`` hands a loop the next call
    and receives its value; the return value is the episode's result."""
    max_steps = episode.limits.max_steps or env.max_steps
    if max_steps < 1:
        raise InvalidArgumentError(f"environment {task.env!r}: max_steps must be >= 1, got {max_steps}")
    observation, info = yield _Call("env", env.reset, (task,), "reset")
    instruction = info.get("instruction") or task.instruction
    retrieval = (yield _Call("memory", retrieve, (task,))) if retrieve is not None else None
    gold = (yield _Call("gold", env.gold_actions, (task,), "gold_actions")) if agent.uses_gold else None
    yield _Call("agent", agent.start, (task, observation, info, retrieval, gold), afn=agent.astart)
    steps: list[Step] = []
    last: StepResult | None = None
    current = observation
    reward = 0.0
    for _ in range(max_steps):
        episode.check_deadline()
        decision = yield _Call("agent", agent.act, (current, info), afn=agent.aact)
        last = yield _Call("env", env.step, (decision.action,), f"step {len(steps) + 1}")
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
    episode = _Episode(env, task, limits, _guard())
    script = _episode_script(env, agent, task, episode, retrieve, trajectory_id, metadata)
    value: Any = None
    while True:
        try:
            call = script.send(value)
        except StopIteration as done:
            return done.value
        value = episode.perform(call)


async def arun_episode(
    env: Environment,
    agent: Agent,
    task: Task,
    *,
    retrieve: Callable[[Task], Awaitable[Retrieval | None] | Retrieval | None] | None = None,
    trajectory_id: str,
    limits: EpisodeLimits = EpisodeLimits(),
    metadata: dict[str, Any] | None = None,
    env_thread: EnvThread | None = None,
) -> EpisodeResult:
    """:func:`run_episode` as a coroutine: the same rules, limits and result, while the
    event loop runs other episodes whenever this one waits.

    Environment calls (sync, often CPU-bound) always run on ``env_thread``, the
    environment's own helper thread (a fresh one for this episode when None), never inline:
    a hung environment must not freeze the event loop and every other episode on it, and
    the step limit can only fire while the loop is free. The agent's calls are awaited
    (:meth:`Agent.aact <lifemem_ray.lab.agents.Agent.aact>`: the ReAct agent's LLM call;
    the offline agents compute inline, in microseconds). ``retrieve`` may be a coroutine
    function (an :class:`~lifemem_ray.actors.client.awaiting.AsyncMemoryClient`
    retrieval) or a plain one, called inline.
    """
    own_thread = env_thread is None
    thread = EnvThread() if env_thread is None else env_thread
    episode = _Episode(env, task, limits, thread)
    script = _episode_script(env, agent, task, episode, retrieve, trajectory_id, metadata)
    value: Any = None
    try:
        while True:
            try:
                call = script.send(value)
            except StopIteration as done:
                return done.value
            value = await episode.aperform(call)
    finally:
        if own_thread:
            thread.close()


class _Episode:
    """One episode's clock: environment calls under the step and episode limits, and the
    seconds spent in the environment, the agent and the memory."""

    def __init__(self, env: Environment, task: Task, limits: EpisodeLimits, guard: EnvThread) -> None:
        self.env, self.task, self.limits = env, task, limits
        self.guard = guard
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

    # -- carrying out one call ---------------------------------------------------------
    def perform(self, call: _Call) -> Any:
        """The blocking loop: ``call`` made here, environment calls on the helper thread."""
        if call.part in ("env", "gold"):
            timeout, left = self._allowance(call)
            t0 = time.perf_counter()
            try:
                return self.guard.call(call.fn, *call.args, timeout=timeout, what=self._label(call))
            except EnvHung:
                if self._ran_out(call, left):
                    raise self._timeout(f" (in {call.what})") from None
                raise
            finally:
                self.spent["env"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        try:
            return call.fn(*call.args)
        finally:
            self.spent[call.part] += time.perf_counter() - t0

    async def aperform(self, call: _Call) -> Any:
        """The async loop: environment calls awaited on the helper thread, the agent's
        async twin awaited, a retrieval awaited when it is a coroutine."""
        if call.part in ("env", "gold"):
            timeout, left = self._allowance(call)
            t0 = time.perf_counter()
            try:
                return await self.guard.acall(call.fn, *call.args, limit_s=timeout, what=self._label(call))
            except EnvHung:
                if self._ran_out(call, left):
                    raise self._timeout(f" (in {call.what})") from None
                raise
            finally:
                self.spent["env"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        try:
            value = (call.afn or call.fn)(*call.args)
            return await value if inspect.isawaitable(value) else value
        finally:
            self.spent[call.part] += time.perf_counter() - t0

    def _allowance(self, call: _Call) -> tuple[float, float]:
        """(limit of this environment call, seconds left in the episode): a step gets the
        step limit, within the episode's; the environment's solution (a planner may take
        long, ALFWorld) gets what is left of the episode."""
        left = self.deadline - time.perf_counter()
        if call.part == "gold":
            return max(left, 0.001), left
        if left <= 0:
            raise self._timeout()
        return min(self.limits.step_timeout_s, left), left

    def _label(self, call: _Call) -> str:
        return f"{self.task.env}/{self.task.id}: {call.what}"

    def _ran_out(self, call: _Call, left: float) -> bool:
        """Whether a call past its limit means the episode's time ran out first (the
        environment is abandoned too), rather than a hung environment."""
        return call.part == "gold" or left < self.limits.step_timeout_s

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
