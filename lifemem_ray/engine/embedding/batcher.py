"""Dynamic batching: texts of concurrent callers share one model call.

A model call costs much the same for one text as for dozens (on a GPU, for hundreds), so a
text waits up to ``wait_ms`` for other callers' texts and they go through the model together.
One worker thread makes every model call; each caller blocks until its own rows are back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lifemem_ray.core.errors import EmbeddingError, InvalidArgumentError

__all__ = ["DynamicBatcher"]

log = logging.getLogger(__name__)

IDLE_EXIT_S = 60.0  # the worker thread ends after this long without work (the next submit starts another)


@dataclass
class _Request:
    """Texts of one caller (at most ``batch_size``), and where their answer goes."""

    texts: list[str]
    arrived: float
    done: threading.Event = field(default_factory=threading.Event)
    vectors: np.ndarray | None = None
    error: BaseException | None = None


class DynamicBatcher:
    """Serves ``model_call(texts) -> (len(texts), dim) float32`` to concurrent callers: one call
    takes the texts that arrived within ``wait_ms`` of the oldest waiting one, up to
    ``batch_size`` (it goes at once when that many wait); a text several of them wait for is
    computed once. A caller's request of more than ``batch_size`` texts is split. An error of a model call reaches every caller of that call;
    the batcher goes on serving the next. ``observe_batch(n)`` is told each model call's size."""

    def __init__(
        self,
        model_call: Callable[[list[str]], np.ndarray],
        dim: int,
        *,
        batch_size: int = 64,
        wait_ms: float = 0.0,
        observe_batch: Callable[[int], None] | None = None,
        name: str = "lifemem-embedding-batcher",
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise InvalidArgumentError(
                f"batch_size must be an integer >= 1, got {batch_size!r}", where="DynamicBatcher"
            )
        if not wait_ms >= 0:
            raise InvalidArgumentError(f"wait_ms must be >= 0, got {wait_ms!r}", where="DynamicBatcher")
        self._model_call = model_call
        self.dim = dim
        self.batch_size = batch_size
        self.wait_s = wait_ms / 1000.0
        self._observe_batch = observe_batch
        self._name = name
        self._queue: deque[_Request] = deque()
        self._queued_texts = 0
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.batches = 0  # model calls that answered
        self.texts = 0  # distinct texts those calls embedded
        self.failed_batches = 0  # model calls that raised

    # -- the callers' side -------------------------------------------------------------------------
    def submit(self, texts: Sequence[str]) -> np.ndarray:
        """The vectors of ``texts`` (rows in their order), once the model calls that carry them answered."""
        texts = list(texts)
        if not texts:
            return np.empty((0, self.dim), dtype=np.float32)
        now = time.monotonic()
        size = self.batch_size
        requests = [_Request(texts[a : a + size], now) for a in range(0, len(texts), size)]
        with self._cond:
            if self._closed:
                raise EmbeddingError("the embedding batcher is closed; open a new embedder to embed more texts")
            self._queue.extend(requests)
            self._queued_texts += len(texts)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify_all()
        for request in requests:
            request.done.wait()
        for request in requests:
            if request.error is not None:
                raise request.error
        parts = [r.vectors for r in requests if r.vectors is not None]
        return parts[0] if len(parts) == 1 else np.vstack(parts)

    def close(self, timeout: float | None = 30.0) -> None:
        """Serve what is already queued, then end the worker thread; later submits are refused."""
        with self._cond:
            self._closed = True
            thread = self._thread
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def stats(self) -> dict[str, Any]:
        """batches (model calls that answered), texts, mean_batch_texts, failed_batches, queued."""
        with self._cond:
            return {
                "batches": self.batches,
                "texts": self.texts,
                "mean_batch_texts": self.texts / self.batches if self.batches else 0.0,
                "failed_batches": self.failed_batches,
                "queued": self._queued_texts,
            }

    # -- the worker thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            batch = self._gather()
            if batch is None:
                return
            self._serve(batch)

    def _gather(self) -> list[_Request] | None:
        """The next model call's requests: waits for a first one, then up to ``wait_s`` after its
        arrival for more (not when ``batch_size`` texts wait, nor once closed). None: the thread
        ends (closed and drained, or idle for ``IDLE_EXIT_S``)."""
        with self._cond:
            while not self._queue:
                idle = self._closed or not self._cond.wait(IDLE_EXIT_S)
                if idle and not self._queue:
                    self._thread = None
                    return None
            deadline = self._queue[0].arrived + self.wait_s
            while not self._closed and self._queued_texts < self.batch_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            taken = [self._queue.popleft()]
            total = len(taken[0].texts)
            while self._queue and total + len(self._queue[0].texts) <= self.batch_size:
                taken.append(self._queue.popleft())
                total += len(taken[-1].texts)
            self._queued_texts -= total
            return taken

    def _serve(self, batch: list[_Request]) -> None:
        """One model call for ``batch``; each request gets its rows, or the call's error."""
        texts = [t for request in batch for t in request.texts]
        # A text several callers wait for at once (a GRPO group's one prompt) is computed once.
        row_of = {text: row for row, text in enumerate(dict.fromkeys(texts))}
        distinct = list(row_of)
        try:
            computed = np.asarray(self._model_call(distinct), dtype=np.float32)
            if computed.shape != (len(distinct), self.dim):
                raise EmbeddingError(
                    f"the embedding model returned shape {tuple(computed.shape)} for {len(distinct)} texts; "
                    f"expected ({len(distinct)}, {self.dim})"
                )
            vectors = computed[[row_of[t] for t in texts]]
        except BaseException as exc:  # noqa: BLE001 - every caller of this call must get its error, and the thread go on
            with self._cond:
                self.failed_batches += 1
            for request in batch:
                request.error = exc
                request.done.set()
            return
        at = 0
        for request in batch:
            request.vectors = vectors[at : at + len(request.texts)]
            at += len(request.texts)
            request.done.set()
        with self._cond:
            self.batches += 1
            self.texts += len(distinct)
        if self._observe_batch is not None:
            try:
                self._observe_batch(len(distinct))
            except Exception:  # a metrics hook must never stop the embedding
                log.warning("the embedding batcher's observe_batch hook failed", exc_info=True)
