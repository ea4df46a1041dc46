"""The memory side of an episode run by someone else's loop: recall at the start, record the
steps, submit the finished trajectory off the critical path.

Rollout stacks (verl, SkyRL, gymnasium loops) own the episode loop; what they need from a
memory is three calls: the context for a new task, the trajectory written when the episode
ends, and, before the process lets go of the environment, the writes acknowledged.
:class:`EpisodeMemory` gives those over any memory (:class:`~lifemem_ray.engine.memory.Memory`
in process, or a deployment's ``MemoryClient``), with one failure rule for every adapter: a
memory that fails degrades that episode to "no memory", is counted, and never raises into the
rollout. The context is the ReAct prompt's memory sections (:func:`memory_context`): skills
and exemplars fenced as data, never as instructions. What an episode hands over is made valid
by one rule (:mod:`lifemem_ray.episodes.episode_data`): a NaN reward, a NUL byte, a lone surrogate or
a 50 MB action is mended and counted (``MemoryCounts.made_valid``), and an episode that cannot
be stored is counted with its reason (``MemoryCounts.not_stored``); neither raises.

Example::

    from lifemem_ray.engine.memory import Memory
    from lifemem_ray.episodes.episode_memory import EpisodeMemory, EpisodeRecord

    with Memory.open("/tmp/mem") as memory:
        episodes = EpisodeMemory(memory, k=4)
        context = episodes.recall("put a clean mug on the desk", "alfworld")
        record = EpisodeRecord("alfworld", "put a clean mug on the desk", "You are in a room.")
        record.step("go to desk 1", "You arrive at desk 1.", reward=1.0)
        result = episodes.storable(record, success=True)  # made valid and counted, or why not
        if result.trajectory is not None:
            episodes.submit(result.trajectory)
        episodes.settle()
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from lifemem_ray.core.errors import IdConflictError, InvalidArgumentError
from lifemem_ray.core.model import Trajectory
from lifemem_ray.core.tenancy import DEFAULT_TENANT
from lifemem_ray.core.validation import validated
from lifemem_ray.engine.retrieval import Retrieval
from lifemem_ray.engine.versions import check_version
from lifemem_ray.episodes.episode_data import (
    MADE_VALID_KINDS,
    NOT_STORED_REASONS,
    EpisodeRecord,
    StorableEpisode,
    storable_text,
)
from lifemem_ray.episodes.episode_options import EpisodeOptions
from lifemem_ray.lab.agent_prompts import DEFAULT_MEMORY_TOKENS, memory_context

__all__ = ["AsyncEpisodeMemory", "EpisodeMemory", "EpisodeRecord", "MemoryCounts", "StorableEpisode"]

log = logging.getLogger(__name__)


@dataclass
class MemoryCounts:
    """What the memory did for the episodes of one :class:`EpisodeMemory`, failures included."""

    recalls: int = 0  # contexts asked for
    recall_failures: int = 0  # of those, the memory failed: the episode ran without memory
    submitted: int = 0  # trajectories handed to the memory
    acknowledged: int = 0  # of those, the memory acknowledged (stored)
    submit_failures: int = 0  # of those, the memory failed or did not answer in ack_timeout_s
    pending: int = 0  # of those, not settled when settle() last returned
    recall_s: float = 0.0  # seconds the episodes spent in recall (on their critical path)
    submit_s: float = 0.0  # seconds the episodes spent handing trajectories over (the writes run apart)
    last_error: str = ""  # the latest failure, "Type: message"
    # Trajectories submitted after the episode data rule changed something, by kind of change
    # (episode_data.MADE_VALID_KINDS: not_text, nul, surrogate, truncated, reward, success, steps).
    made_valid: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MADE_VALID_KINDS, 0))
    # Episodes never submitted, by reason (episode_data.NOT_STORED_REASONS: env_name, no_task,
    # refused, unreadable); the latest one's message is last_error.
    not_stored: dict[str, int] = field(default_factory=lambda: dict.fromkeys(NOT_STORED_REASONS, 0))

    def as_dict(self) -> dict[str, Any]:
        """The counts as plain values (the two tallies copied)."""
        return {key: dict(value) if isinstance(value, dict) else value for key, value in self.__dict__.items()}


class _EpisodeMemoryRules:
    """What the thread and the coroutine versions share: bounds, counts, the context's form,
    the failure rule (count, log, degrade) and what counts as stored."""

    def __init__(
        self,
        memory: Any,
        *,
        k: int = 4,
        token_budget: int = DEFAULT_MEMORY_TOKENS,
        tenant: str = DEFAULT_TENANT,
        ack_timeout_s: float = 120.0,
        max_pending: int = 256,
        same_env: bool = True,
        as_of: str | None = None,
    ) -> None:
        options = validated(
            EpisodeOptions,
            {
                "k": k,
                "token_budget": token_budget,
                "tenant": tenant,
                "ack_timeout_s": ack_timeout_s,
                "max_pending": max_pending,
                "same_env": same_env,
                "as_of": as_of,
            },
            where=type(self).__name__,
            error=InvalidArgumentError,
        )
        if not callable(getattr(memory, "retrieve", None)) or not callable(getattr(memory, "add", None)):
            raise InvalidArgumentError(
                f"{type(self).__name__}: {type(memory).__name__} has no retrieve() and add(); "
                "give a Memory, a MemoryClient or an AsyncMemoryClient"
            )
        self.memory = memory
        self.options = options  # what this episode memory was asked, checked (EpisodeOptions)
        self.k, self.token_budget, self.tenant = options.k, options.token_budget, options.tenant
        self.ack_timeout_s, self.max_pending, self.same_env = (
            options.ack_timeout_s,
            options.max_pending,
            options.same_env,
        )
        self.counts = MemoryCounts()
        self._lock = threading.Lock()  # guards counts (and the thread version's pending queue)
        self.as_of = options.as_of  # recalls pinned to this version (None: the latest)

    def pin(self, version: str | None) -> None:
        """Pin later recalls to ``version`` (a token from the memory's ``version()``; None: read
        the latest). A training step pins its rollouts to the memory it started from; each
        trajectory then records the version its episode read (:meth:`episode_metadata`)."""
        self.as_of = None if version is None else check_version(version, "pin")

    @staticmethod
    def episode_metadata(read_as_of: str | None, found: Retrieval | None) -> dict[str, Any]:
        """What a submitted trajectory records about the memory its episode read: the version
        its recall was pinned to (``as_of`` taken when the recall started, since ``pin`` may
        move before the episode ends), when that recall answered."""
        return {} if read_as_of is None or found is None else {"memory_version": read_as_of}

    def storable(
        self, record: EpisodeRecord, success: Any, reward: Any = None, *, metadata: dict[str, Any] | None = None
    ) -> StorableEpisode:
        """``record`` as a trajectory of this memory's tenant, made valid
        (:meth:`EpisodeRecord.storable`), and counted: each kind of change in
        ``counts.made_valid``, or the reason it is not stored in ``counts.not_stored`` (its
        message in ``last_error``). Never raises. Submit ``result.trajectory`` when it is not None.

        Args:
            record: the finished episode.
            success: whether it succeeded (None: unknown).
            reward: the outcome's reward (default: the record's summed step rewards).
            metadata: stored with the trajectory.

        Returns:
            The :class:`~lifemem_ray.episodes.episode_data.StorableEpisode`.
        """
        result = record.storable(success, reward, tenant=self.tenant, metadata=metadata)
        if result.trajectory is None:
            self.count_not_stored(result.not_stored, result.problem)
            return result
        with self._lock:
            for kind in result.made_valid:
                self.counts.made_valid[kind] = self.counts.made_valid.get(kind, 0) + 1
        return result

    def count_not_stored(self, reason: str, problem: str) -> None:
        """Count an episode that is not submitted, with its ``reason`` (one of
        ``episode_data.NOT_STORED_REASONS``) and ``problem`` (the latest, in ``last_error``)."""
        with self._lock:
            self.counts.not_stored[reason] = self.counts.not_stored.get(reason, 0) + 1
            self.counts.last_error = f"not stored ({reason}): {problem}"[:500]
        log.warning("memory: an episode was not stored (%s): %s (the episode goes on)", reason, problem[:200])

    @staticmethod
    def _query(task: Any) -> str:
        """The text a recall asks with: ``task`` made valid by the episode data rule (the
        change is counted when the episode's trajectory is)."""
        return storable_text(task)[0]

    def _read_options(self) -> dict[str, Any]:
        return {"tenant": self.tenant} if self.as_of is None else {"tenant": self.tenant, "as_of": self.as_of}

    def context_of(self, found: Retrieval) -> str:
        """``found`` rendered as the fenced memory context (the ReAct prompt's sections)."""
        exemplars = [hit.trajectory for hit in found.trajectories if hit.trajectory is not None]
        return memory_context([s.text for s in found.skills], exemplars, self.token_budget)

    def _scope(self, env: str | None) -> str | None:
        return env if self.same_env else None

    def _count(self, counter: str, by: float = 1) -> None:
        with self._lock:
            setattr(self.counts, counter, getattr(self.counts, counter) + by)

    @staticmethod
    def _check_stored(answer: Any, trajectory: Trajectory) -> None:
        if getattr(answer, "status", "added") == "conflict":  # another trajectory under this id: never stored
            raise IdConflictError(f"trajectory {trajectory.id}: another trajectory is stored under this id")

    def _failed(self, counter: str, exc: BaseException) -> None:
        with self._lock:
            setattr(self.counts, counter, getattr(self.counts, counter) + 1)
            self.counts.last_error = f"{type(exc).__name__}: {exc}"[:500]
        log.warning("memory %s: %s: %s (the episode goes on without it)", counter, type(exc).__name__, exc)


class EpisodeMemory(_EpisodeMemoryRules):
    """Recall and submit for episodes a foreign loop runs, over ``memory`` (anything with the
    memory's ``retrieve(task, env, k, ...)`` and ``add(trajectory)``: a store, whose add
    answers when stored, or a deployment's client, whose add answers a future).

    ``submit`` never blocks the episode: the add and the wait for its acknowledgement run on
    a background thread; at most ``max_pending`` submissions wait at once (one more waits for
    the oldest: backpressure, never a dropped write). ``settle`` waits for them all; a submit
    the memory refused or did not acknowledge within ``ack_timeout_s`` is counted and logged,
    not retried (its id is new each time: ``submit_failures`` says how many are in doubt).

    Args:
        memory: a :class:`~lifemem_ray.engine.memory.Memory` or a deployment's ``MemoryClient``.
        **options: the episode options (:class:`~lifemem_ray.episodes.episode_options.EpisodeOptions`:
            ``k``, ``token_budget``, ``tenant``, ``ack_timeout_s``, ``max_pending``, ``same_env``, ``as_of``).

    Raises:
        InvalidArgumentError: an option refused (``where`` names it), or ``memory`` has no
            ``retrieve`` and ``add``.
    """

    def __init__(self, memory: Any, **options: Any) -> None:
        super().__init__(memory, **options)
        self._pending: deque[Future[bool]] = deque()  # submissions not yet acknowledged or failed
        self._writer = ThreadPoolExecutor(max_workers=2, thread_name_prefix="lifemem-episode-writes")

    def recall(self, task: str, env: str | None) -> tuple[str, Retrieval | None]:
        """The memory context for ``task`` and the retrieval it came from. The task is asked as
        the episode data rule makes it valid (a NUL, a lone surrogate, a 50 MB text). Never
        raises: a failing memory is counted (``recall_failures``) and the episode goes on without.

        Args:
            task: the episode's task text.
            env: its environment (with ``same_env``, the only one searched).

        Returns:
            ``(context, retrieval)``: the fenced skills and exemplars ("" when the memory has
            nothing or failed) and the retrieval (None on failure).
        """
        self._count("recalls")
        started = time.perf_counter()
        try:
            found = self.memory.retrieve(self._query(task), self._scope(env), self.k, **self._read_options())
            return self.context_of(found), found
        except Exception as exc:  # noqa: BLE001 - any failure of the memory degrades this episode to no memory
            self._failed("recall_failures", exc)
            return "", None
        finally:
            self._count("recall_s", time.perf_counter() - started)

    def submit(self, trajectory: Trajectory) -> Future[bool]:
        """Hand ``trajectory`` to the memory in the background; returns at once (or, with
        ``max_pending`` submissions in flight, once the oldest of them settled: bounded
        backpressure). Never raises: a failed write is counted.

        Args:
            trajectory: the finished episode (see :meth:`storable` for raw episode data).

        Returns:
            The write's future: True once acknowledged, False when it failed (a writer already
            closed is such a failure).
        """
        self._count("submitted")
        started = time.perf_counter()
        with self._lock:
            oldest = self._pending[0] if len(self._pending) >= self.max_pending else None
        if oldest is not None:
            self._wait(oldest, self.ack_timeout_s + 5.0)  # the write bounds itself by ack_timeout_s
        try:
            future = self._writer.submit(self._write, trajectory)
        except RuntimeError as exc:  # closed: the write fails, counted; the episode goes on
            self._failed("submit_failures", exc)
            future = Future()
            future.set_result(False)
            return future
        with self._lock:
            self._pending.append(future)
        future.add_done_callback(self._forget)
        self._count("submit_s", time.perf_counter() - started)
        return future

    def settle(self, timeout_s: float | None = None) -> MemoryCounts:
        """Wait until every submission is acknowledged or failed.

        Args:
            timeout_s: the longest wait in all (None: ``ack_timeout_s`` plus a margin).

        Returns:
            The counts (``pending``: submissions still unsettled).
        """
        deadline = time.monotonic() + (self.ack_timeout_s + 5.0 if timeout_s is None else timeout_s)
        while True:
            with self._lock:
                pending = list(self._pending)
            left = deadline - time.monotonic()
            if not pending or left <= 0:
                break
            self._wait(pending[0], left)
        with self._lock:
            self.counts.pending = len(self._pending)
        return self.counts

    def close(self, timeout_s: float | None = None) -> MemoryCounts:
        """:meth:`settle`, then stop the background writer; safe to call twice.

        Args:
            timeout_s: as :meth:`settle`'s.

        Returns:
            The counts.
        """
        counts = self.settle(timeout_s)
        self._writer.shutdown(wait=False, cancel_futures=False)
        return counts

    def _write(self, trajectory: Trajectory) -> bool:
        try:
            answer = self.memory.add(trajectory)
            result: Callable[..., Any] | None = getattr(answer, "result", None)
            if callable(result):  # a deployment's AddFuture: wait for the acknowledgement here
                answer = result(timeout=self.ack_timeout_s)
            self._check_stored(answer, trajectory)
        except Exception as exc:  # noqa: BLE001 - any failure of a write is counted; the rollout goes on
            self._failed("submit_failures", exc)
            return False
        self._count("acknowledged")
        return True

    def _forget(self, future: Future[bool]) -> None:
        with self._lock:
            if future in self._pending:
                self._pending.remove(future)

    @staticmethod
    def _wait(future: Future[bool], timeout_s: float) -> None:
        try:
            future.result(timeout=timeout_s)
        except FutureTimeout:
            pass  # still in flight: the caller's deadline decides


class AsyncEpisodeMemory(_EpisodeMemoryRules):
    """:class:`EpisodeMemory` for coroutines, over a memory whose ``retrieve`` is awaitable and
    whose ``add`` answers an awaitable (``AsyncMemoryClient``): one episode's memory calls
    never block the event loop the other episodes run on. ``submit`` starts a task that awaits
    the acknowledgement; ``settle`` awaits them all. Use it from one event loop.

    Example::

        episodes = AsyncEpisodeMemory(await AsyncMemoryClient.connect("lifemem"))
        context, _ = await episodes.recall(task, "alfworld")
        ...
        await episodes.submit(record.trajectory(success=True))
        await episodes.settle()
    """

    def __init__(self, memory: Any, **options: Any) -> None:
        super().__init__(memory, **options)
        self._tasks: set[asyncio.Task[None]] = set()  # submissions not yet acknowledged or failed

    async def recall(self, task: str, env: str | None) -> tuple[str, Retrieval | None]:
        """As :meth:`EpisodeMemory.recall`, awaited; bounded by ``ack_timeout_s``.

        Args:
            task: the episode's task text.
            env: its environment.

        Returns:
            ``(context, retrieval)`` (``""`` and None when the memory failed: counted, never raised).
        """
        self._count("recalls")
        started = time.perf_counter()
        try:
            found = await asyncio.wait_for(
                self.memory.retrieve(self._query(task), self._scope(env), self.k, **self._read_options()),
                self.ack_timeout_s,
            )
            return self.context_of(found), found
        except Exception as exc:  # noqa: BLE001 - any failure of the memory degrades this episode to no memory
            self._failed("recall_failures", exc)
            return "", None
        finally:
            self._count("recall_s", time.perf_counter() - started)

    async def submit(self, trajectory: Trajectory) -> None:
        """Send ``trajectory`` and await its acknowledgement in a background task; returns at
        once (with ``max_pending`` in flight, once the oldest settled). Never raises.

        Args:
            trajectory: the finished episode.
        """
        self._count("submitted")
        started = time.perf_counter()
        while len(self._tasks) >= self.max_pending:
            await asyncio.wait(set(self._tasks), return_when=asyncio.FIRST_COMPLETED)
        task = asyncio.get_running_loop().create_task(self._write(trajectory))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self._count("submit_s", time.perf_counter() - started)

    async def settle(self, timeout_s: float | None = None) -> MemoryCounts:
        """Await every submission.

        Args:
            timeout_s: the longest wait in all (None: ``ack_timeout_s`` plus a margin).

        Returns:
            The counts (``pending``: still unsettled).
        """
        if self._tasks:
            limit = self.ack_timeout_s + 5.0 if timeout_s is None else timeout_s
            await asyncio.wait(set(self._tasks), timeout=limit)
        with self._lock:
            self.counts.pending = len(self._tasks)
        return self.counts

    async def _write(self, trajectory: Trajectory) -> None:
        try:
            answer = await asyncio.wait_for(self._acknowledged(trajectory), self.ack_timeout_s)
            self._check_stored(answer, trajectory)
        except Exception as exc:  # noqa: BLE001 - any failure of a write is counted; the rollout goes on
            self._failed("submit_failures", exc)
            return
        self._count("acknowledged")

    async def _acknowledged(self, trajectory: Trajectory) -> Any:
        answer = self.memory.add(trajectory)
        return await answer if inspect.isawaitable(answer) else answer
