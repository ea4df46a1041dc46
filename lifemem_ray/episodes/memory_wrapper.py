"""A memory around any environment with ``reset`` / ``step``: the project's own environments and
gymnasium-style ones with text observations.

At ``reset`` the wrapper recalls the memory for the episode's task and puts the fenced context
into the first observation (before it) or into the info dict (``info["memory"]``), as
``context_in`` says; it records every step; when the episode ends it submits the trajectory
with its outcome in the background (the episode never waits on the write), and ``close``
awaits the acknowledgements before it closes the environment. A failure of the memory makes
that episode run without memory and is counted (``wrapper.counts``); it never raises into the
rollout. Nor does what the environment hands over: a NaN or non-numeric reward, a NUL byte or
a lone surrogate, a non-text observation, a 50 MB action is made valid by the episode data rule
(:mod:`lifemem_ray.episodes.episode_data`) and counted in ``counts.made_valid``; an episode that still
cannot be stored, or a step answer the wrapper cannot read, is counted in ``counts.not_stored``
and the episode goes on. What the environment itself raises is its own: it propagates unchanged
(the steps recorded so far are submitted at the next ``reset`` or ``close``, outcome unknown).
The rules are :mod:`lifemem_ray.episodes.episode_memory`'s, shared with the RL-stack adapters.

Example (one of the project's environments, a store in a folder)::

    from lifemem_ray.engine.memory import Memory
    from lifemem_ray.lab.envs import make_env
    from lifemem_ray.episodes.memory_wrapper import MemoryWrapper

    with Memory.open("/tmp/mem") as memory:
        env = MemoryWrapper(make_env("sql"), memory)
        task = env.tasks("train", limit=1)[0]
        observation, info = env.reset(task)  # the memory's context, then the first observation
        result = env.step("SELECT 1")
        env.close()  # the trajectory acknowledged, then the environment closed
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from lifemem_ray.core.errors import InvalidArgumentError
from lifemem_ray.episodes.episode_data import UNREADABLE
from lifemem_ray.episodes.episode_memory import EpisodeMemory, EpisodeRecord, MemoryCounts
from lifemem_ray.lab.envs.base import Environment, Task

__all__ = ["CONTEXT_PLACES", "MemoryWrapper"]

CONTEXT_PLACES = ("observation", "info")

log = logging.getLogger(__name__)


def _task_from_info(observation: Any, info: dict[str, Any]) -> Any:
    """A gymnasium-style environment's task: ``info["task"]`` (or ``instruction`` / ``goal``),
    else the first observation (stored as its text)."""
    for key in ("task", "instruction", "goal"):
        if isinstance(info.get(key), str) and info[key].strip():
            return str(info[key])
    return observation


def _lab_success(info: dict[str, Any]) -> Any:
    """The project's environments say ``success`` in the last step's info (absent: not solved)."""
    return info.get("success", False)


def _reported_success(info: dict[str, Any]) -> Any:
    """A gymnasium-style environment's success where its info says it, else unknown (None)."""
    return info.get("success", info.get("is_success"))


class MemoryWrapper:
    """``env`` with a memory. ``env`` is one of the project's environments (``reset(task)``,
    ``step(action) -> StepResult``) or a gymnasium-style one (``reset(seed=, options=)``,
    ``step(action) -> (observation, reward, terminated, truncated, info)``; its observations
    text). ``memory`` is a store, a deployment's client, or an :class:`EpisodeMemory` (shared
    by several wrappers: one background writer, one set of counts). ``env_name`` names the
    environment in the memory (default: ``env.name``, else the class name); ``task_of``
    gives a gymnasium-style episode's task from its first (observation, info);
    ``success_of`` its success from the last info (default ``info["success"]``, else unknown;
    a value that is not true/false, or a ``success_of`` that raises, makes it unknown, counted
    in ``counts.made_valid["success"]``)."""

    def __init__(
        self,
        env: Any,
        memory: Any,
        *,
        env_name: str | None = None,
        context_in: str = "observation",
        task_of: Callable[[Any, dict[str, Any]], Any] = _task_from_info,
        success_of: Callable[[dict[str, Any]], bool | None] | None = None,
        close_timeout_s: float | None = None,
        **memory_options: Any,
    ) -> None:
        if context_in not in CONTEXT_PLACES:
            raise InvalidArgumentError(
                f"context_in must be one of {CONTEXT_PLACES}, got {context_in!r}", where="MemoryWrapper"
            )
        if not callable(getattr(env, "reset", None)) or not callable(getattr(env, "step", None)):
            raise InvalidArgumentError(f"{type(env).__name__} has no reset() and step()", where="MemoryWrapper")
        self.env = env
        self.lab = isinstance(env, Environment)  # the project's own protocol, else gymnasium's
        self.episodes = memory if isinstance(memory, EpisodeMemory) else EpisodeMemory(memory, **memory_options)
        self._owns_episodes = not isinstance(memory, EpisodeMemory)
        self.env_name = env_name or str(getattr(env, "name", "") or type(env).__name__)
        self.context_in, self.task_of, self.close_timeout_s = context_in, task_of, close_timeout_s
        self.success_of = success_of or (_lab_success if self.lab else _reported_success)
        self._record: EpisodeRecord | None = None  # the episode running now, until it ends
        self._read: dict[str, Any] = {}  # what the running episode's recall read (its pinned version)
        self._closed = False

    @property
    def counts(self) -> MemoryCounts:
        """What the memory did for this wrapper's episodes (failures included)."""
        return self.episodes.counts

    def __getattr__(self, name: str) -> Any:  # tasks(), gold_actions(), action_space ... of the inner env
        return getattr(self.env, name)

    # -- the episode -------------------------------------------------------------------------------
    def reset(self, *args: Any, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        """The inner ``reset``, with the memory's context in the observation or the info. An
        episode left unfinished is submitted first, its outcome unknown."""
        self._finish(success=None)
        observation, info = self.env.reset(*args, **kwargs)
        info = dict(info or {})
        self._record = EpisodeRecord(self.env_name, self._task(args, kwargs, observation, info), observation)
        pinned = self.episodes.as_of  # the version this recall reads (pin may move before the end)
        context, found = self.episodes.recall(self._record.task, self.env_name)  # the task made valid
        self._read = self.episodes.episode_metadata(pinned, found)
        info["memory_hits"] = [hit.id for hit in found.trajectories] if found is not None else []
        if context and self.context_in == "info":
            info["memory"] = context
        elif context:
            if not isinstance(observation, str):
                raise InvalidArgumentError(
                    f"MemoryWrapper({self.env_name}): context_in='observation' needs text observations, "
                    f"got {type(observation).__name__}; use context_in='info'"
                )
            observation = f"{context}\n\nCurrent observation:\n{observation}"
        return observation, info

    def step(self, action: Any, thought: str = "") -> Any:
        """The inner ``step``; the step recorded, and the trajectory submitted when it ends.

        Args:
            action: passed to the inner environment as it is; recorded as text.
            thought: the agent's reasoning before the action, recorded with it.

        Returns:
            The inner environment's answer, unchanged.

        Raises:
            Whatever the inner ``step`` raises (the environment's own error); recording the
            step never raises: its data is made valid and counted, and an answer the wrapper
            cannot read drops the episode's record (``counts.not_stored["unreadable"]``).
        """
        answer = self.env.step(action)  # the environment's own errors are its caller's
        if self._record is not None:
            try:
                self._record_step(self._record, answer, action, thought)
            except Exception as exc:  # noqa: BLE001 - recording never fails the rollout: the record is dropped
                self._record = None
                self.episodes.count_not_stored("unreadable", f"{type(exc).__name__}: {exc}")
        return answer

    def close(self) -> MemoryCounts:
        """Submit an unfinished episode, await the acknowledgements (bounded), close the
        inner environment; the counts. Safe to call twice."""
        if self._closed:
            return self.counts
        self._closed = True
        self._finish(success=None)
        counts = self.episodes.close(self.close_timeout_s) if self._owns_episodes else self.counts
        self.env.close()
        return counts

    def __enter__(self) -> MemoryWrapper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers -----------------------------------------------------------------------------------
    def _task(self, args: tuple[Any, ...], kwargs: dict[str, Any], observation: Any, info: dict[str, Any]) -> Any:
        """The episode's task (any value: the record keeps it as text); "" when ``task_of``
        raises (the first observation then stands in for it)."""
        try:
            if self.lab:
                task = args[0] if args else kwargs.get("task")
                if isinstance(task, Task):
                    return info.get("instruction") or task.instruction
            return self.task_of(observation, info)
        except Exception as exc:  # noqa: BLE001 - reading the task never fails the rollout
            log.warning("MemoryWrapper(%s): the task could not be read: %s: %s", self.env_name, type(exc).__name__, exc)
            return ""

    def _record_step(self, record: EpisodeRecord, answer: Any, action: Any, thought: Any) -> None:
        """Record the inner environment's ``answer`` to ``action`` in ``record``; submit when
        the episode ends."""
        if self.lab:
            observation, reward, done, info = answer.observation, answer.reward, answer.done, answer.info
        else:
            observation, reward, terminated, truncated, info = answer
            done = bool(terminated or truncated)
        record.step(action, observation, reward, thought)
        if done:
            self._finish(self._success(info))

    def _success(self, info: Any) -> Any:
        """``success_of`` of the last info (:data:`UNREADABLE` when it raises)."""
        try:
            return self.success_of(dict(info) if isinstance(info, Mapping) else {})
        except Exception as exc:  # noqa: BLE001 - an outcome that cannot be read is unknown, counted
            log.warning("MemoryWrapper(%s): success_of raised %s: %s", self.env_name, type(exc).__name__, exc)
            return UNREADABLE

    def _finish(self, success: Any) -> None:
        record, self._record = self._record, None
        if record is not None and record.steps:
            metadata = {"wrapped": type(self.env).__name__, **self._read}
            trajectory = self.episodes.storable(record, success, metadata=metadata).trajectory
            if trajectory is not None:
                self.episodes.submit(trajectory)
