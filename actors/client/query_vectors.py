"""A memory client's recent query vectors, and the texts it is embedding right now.

A retrieval's text met again by the same client (each rollout of a GRPO group retrieving its
prompt through one client, a front door's frequent query) is served from the client's own cache,
without the call to an embedder actor; a text that several of the client's threads or
coroutines ask for at the same moment is sent to the embedders once and the others wait for
that call's answer. The vectors are the embedder actors' own answers (one model for the whole
deployment), so a retrieval gets the same vector either way. :class:`QueryVectors` is one body for
:class:`~lifemem_ray.actors.client.blocking.MemoryClient` (threads) and
:class:`~lifemem_ray.actors.client.awaiting.AsyncMemoryClient` (coroutines).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from lifemem_ray.actors.client.calls import Join, Script
from lifemem_ray.engine.embedding.cache import EmbeddingCache

__all__ = ["QueryVectors"]

_MODEL = "deployment"  # the cache's model key: a client talks to one deployment, which has one model


class _Flight:
    """One text being embedded by one caller; other callers wait here for its vector (None:
    that call failed, and each waiting caller tries on its own)."""

    __slots__ = ("_done", "_lock", "_wakers", "vector")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._wakers: list[Callable[[], object]] = []
        self.vector: np.ndarray | None = None

    def settle(self, vector: np.ndarray | None) -> None:
        with self._lock:
            self.vector = vector
            self._done.set()
            wakers, self._wakers = self._wakers, []
        for wake in wakers:
            wake()

    def wait(self) -> np.ndarray | None:
        self._done.wait()
        return self.vector

    async def wait_async(self) -> np.ndarray | None:
        loop = asyncio.get_running_loop()
        woken: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if self._done.is_set():
                return self.vector
            self._wakers.append(lambda: loop.call_soon_threadsafe(_resolve, woken))
        await woken
        return self.vector


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():  # its waiter may have been cancelled
        future.set_result(None)


class QueryVectors:
    """The query vectors of one client: up to ``capacity`` recent texts' vectors (least recently
    used dropped first) and the texts in flight. ``capacity`` 0 turns both off: every call goes
    to the embedders as it is. Thread-safe.

    :meth:`vectors` takes the client's own call to the embedders (a script:
    ``embed(texts) -> (len(texts), dim)``) and calls it with only the distinct texts neither
    cached nor in flight."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._cache = EmbeddingCache(capacity)
        self._lock = threading.Lock()
        self._flights: dict[str, _Flight] = {}
        self.sent = 0  # distinct texts this client sent to the embedders through here
        self.shared = 0  # texts served by another caller's call in flight

    def vectors(self, texts: Sequence[str], embed: Callable[[list[str]], Script[np.ndarray]]) -> Script[np.ndarray]:
        """The vectors of ``texts`` (a row each, in order), embedding only what must be: a
        script (:mod:`~lifemem_ray.actors.client.calls`) that waits for ``embed``'s calls and
        for other callers' calls in flight, whichever loop carries it out."""
        if self.capacity == 0:
            return np.asarray((yield from embed(list(texts))), dtype=np.float32)
        known, mine, theirs = self._claim(texts)
        if mine:
            try:
                computed = np.asarray((yield from embed(mine)), dtype=np.float32)
            except BaseException:  # cancelled too: the waiting callers try on their own
                self._land(mine, None)
                raise
            known.update(self._land(mine, computed))
        failed = []
        for text, flight in theirs.items():
            vector = yield Join(flight.wait, flight.wait_async)
            if vector is None:
                failed.append(text)
            else:
                known[text] = vector
        if failed:  # the other caller's call failed: this caller's own try, and its own error
            known.update(self._keep(failed, np.asarray((yield from embed(failed)), dtype=np.float32)))
        return self._rows(texts, known)

    def known(self, text: str) -> np.ndarray | None:
        """``text``'s cached vector, or None (nothing is embedded): what an add sends along when
        the same client retrieved for that text before (the rollout workers' add after the
        episode that retrieved for its task)."""
        if self.capacity == 0:
            return None
        with self._lock:
            return self._cache.get_many(_MODEL, [text])[0]

    def forget(self) -> None:
        """Drop every cached vector (the client connected to a deployment that may embed with
        another model); texts in flight finish as they are."""
        with self._lock:
            self._cache.clear()

    def stats(self) -> dict[str, Any]:
        """The cache's figures (entries, capacity, hits, misses, hit_rate, evictions), texts sent
        to the embedders from here, and texts served by another caller's call in flight."""
        with self._lock:
            return {**self._cache.stats(), "sent": self.sent, "shared": self.shared}

    # -- under the lock -------------------------------------------------------------------------
    def _claim(self, texts: Sequence[str]) -> tuple[dict[str, np.ndarray], list[str], dict[str, _Flight]]:
        """Per distinct text: its cached vector, or claimed by this caller (now in flight), or
        the flight of the caller that embeds it now."""
        distinct = list(dict.fromkeys(texts))
        known: dict[str, np.ndarray] = {}
        mine: list[str] = []
        theirs: dict[str, _Flight] = {}
        with self._lock:
            for text, row in zip(distinct, self._cache.get_many(_MODEL, distinct), strict=True):
                if row is not None:
                    known[text] = row
                elif text in self._flights:
                    theirs[text] = self._flights[text]
                else:
                    self._flights[text] = _Flight()
                    mine.append(text)
            self.sent += len(mine)
            self.shared += len(theirs)
        return known, mine, theirs

    def _land(self, mine: list[str], computed: np.ndarray | None) -> dict[str, np.ndarray]:
        """This caller's call answered (``computed``) or failed (None): cache its vectors, end
        its flights and hand their vectors to whoever waits (whatever happens here: nobody is
        left waiting)."""
        rows: dict[str, np.ndarray] = {}
        try:
            if computed is not None:
                rows = dict(zip(mine, computed, strict=True))
                with self._lock:
                    self._cache.put_many(_MODEL, mine, computed)
        finally:
            with self._lock:
                flights = [self._flights.pop(text) for text in mine]
            for text, flight in zip(mine, flights, strict=True):
                flight.settle(rows.get(text))
        return rows

    def _keep(self, texts: list[str], computed: np.ndarray) -> dict[str, np.ndarray]:
        """Vectors computed outside a flight (after another caller's call failed), cached too."""
        rows = dict(zip(texts, computed, strict=True))
        with self._lock:
            self._cache.put_many(_MODEL, texts, computed)
        return rows

    def _rows(self, texts: Sequence[str], known: dict[str, np.ndarray]) -> np.ndarray:
        return np.stack([known[text] for text in texts]).astype(np.float32, copy=False)
