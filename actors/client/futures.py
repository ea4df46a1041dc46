"""An add's future: resolves when the coordinator acknowledged (every trajectory committed on
its shard). One waiting rule (:func:`acknowledged`) for the blocking :class:`AddFuture` and the
awaitable :class:`AsyncAddFuture`; the policy of a failed attempt is
:class:`~lifemem_ray.actors.client.rules.AddRequest`'s.

When the answer is lost (an actor died), the request's ids are kept by the client as *in
doubt*: its first attempt may have committed them. A later request of the same client that
finds such an id stored with the same content reports it ``added`` (this client's own earlier
attempt stored it), not ``duplicate``.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import ray

from lifemem_ray.actors.client.calls import Blocking, Remote, Script, Sleep, adrive, drive
from lifemem_ray.actors.client.rules import AddRequest, send_again
from lifemem_ray.actors.cluster.remote_errors import raise_remote
from lifemem_ray.core.errors import DeploymentNotFoundError

__all__ = ["AddFuture", "AsyncAddFuture", "acknowledged"]


class _Attempts(Protocol):
    """What :func:`acknowledged` needs of a future: its current attempt and how to send again."""

    ref: Any
    request: AddRequest
    resend: Callable[[], Any] | None


def acknowledged(future: _Attempts, attempt_timeout_s: float | None) -> Script[Any]:
    """The caller's results of ``future``'s request: each attempt waited up to
    ``attempt_timeout_s``; a request whose coordinator died sent again (up to
    ``cluster.add_resends`` times, to the coordinator found by name again), its ids in doubt
    settled; anything else raised (the coordinator's own error unwrapped). A wait cancelled
    from outside leaves the ids in doubt too: the request may still commit."""
    while True:
        try:
            answer = yield Remote([future.ref], attempt_timeout_s, one=True)
            return future.request.answered(answer)
        except asyncio.CancelledError:
            future.request.ledger.remember(future.request.sent)
            raise
        except (ray.exceptions.RayError, TimeoutError) as exc:
            delay = future.request.failed(exc, future.resend is not None)
            if delay is None or future.resend is None:
                raise_remote(exc)  # the coordinator's own error without Ray's wrapping, or exc as it came
            yield Sleep(delay)
            future.ref = yield Blocking(functools.partial(send_again, future.resend, future.request))


@dataclass(eq=False)  # a future is itself: compared and hashed by identity
class AddFuture:
    """A blocking add's future (:meth:`result`, or :meth:`poll` without waiting).

    Picklable: a future may be handed to another process (a rollout worker hands its adds to
    the pool), which waits for it, and sends it again, in the same way; the doubts of a
    travelling future are then its own, and its client's connection stays behind."""

    ref: Any
    request: AddRequest = field(default_factory=lambda: AddRequest({}, []))
    resend: Callable[[], Any] | None = None  # sends the same request again (a new ref)
    resend_at: float | None = None  # poll(): monotonic time when a request whose coordinator died goes out again
    judge: Callable[[BaseException], None] | None = None  # told of a failure (the client's connection rule)

    @property
    def single(self) -> bool:
        """Whether it answers one result (:meth:`MemoryClient.add`) rather than a list."""
        return self.request.single

    @single.setter
    def single(self, value: bool) -> None:
        self.request.single = value

    def result(self, timeout: float | None = None) -> Any:
        """The per-trajectory results (``timeout``: per attempt; None: ``cluster.call_timeout_s``).

        Args:
            timeout: seconds each attempt may wait.

        Returns:
            One result per trajectory (one result for :meth:`MemoryClient.add`).

        Raises:
            TimeoutError: no answer in time (the ids are in doubt: the request may still commit).
            LifeMemError: the coordinator's own refusal (an id conflict...).
        """
        try:
            self._resend_due(wait=True)
        except Exception as exc:
            self._judged(exc)
            raise
        return drive(acknowledged(self, self.request.wait_s if timeout is None else timeout), self._judged)

    def poll(self) -> Any | None:
        """The results once acknowledged, else None at once (never waits): a request whose
        coordinator died is sent again when its delay has passed. Raises what
        :meth:`result` would."""
        if not self._resend_due(wait=False) or not self.done():
            return None
        try:
            out = ray.get(self.ref, timeout=0)
        except ray.exceptions.RayError as exc:
            delay = self.request.failed(exc, self.resend is not None)
            if delay is None:
                self._judged(exc)
                raise_remote(exc)
            self.resend_at = time.monotonic() + delay
            return None
        return self.request.answered(out)

    def done(self) -> bool:
        """Whether the current attempt has an answer (an acknowledgement or an error)."""
        ready, _ = ray.wait([self.ref], timeout=0)
        return bool(ready)

    def _judged(self, exc: BaseException) -> None:
        if self.judge is not None:
            self.judge(exc)

    def _resend_due(self, wait: bool) -> bool:
        """Send a request :meth:`poll` decided to send again once its time came (``wait``: now,
        after sleeping until then); False while that time has not come."""
        if self.resend_at is None or self.resend is None:
            return True
        if not wait and time.monotonic() < self.resend_at:
            return False
        time.sleep(max(0.0, self.resend_at - time.monotonic()))
        self.resend_at = None
        if wait:
            self.ref = send_again(self.resend, self.request)
            return True
        try:  # poll never waits: no coordinator found by name yet is another delay
            self.ref = self.resend()
        except DeploymentNotFoundError as exc:
            delay = self.request.failed(exc)
            if delay is None:
                raise
            self.resend_at = time.monotonic() + delay
            return False
        return True

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "judge": None}  # the client's connection stays in its process

    @staticmethod
    def ready(futures: Sequence[AddFuture], timeout: float = 0.0) -> list[AddFuture]:
        """Those of ``futures`` that may move on now (an answer came, or a resend is due), for
        :meth:`poll`; when none may, waits up to ``timeout`` seconds for one. One ``ray.wait``
        for them all."""
        now = time.monotonic()
        backing_off = [f.resend_at - now for f in futures if f.resend_at is not None]
        waiting = [f for f in futures if f.resend_at is None]
        if timeout > 0 and not any(left <= 0 for left in backing_off):
            limit = min([timeout, *backing_off])
            if waiting:
                ray.wait([f.ref for f in waiting], num_returns=1, timeout=limit)
            else:
                time.sleep(limit)
        answered: set[Any] = set()
        if waiting:
            answered = set(ray.wait([f.ref for f in waiting], num_returns=len(waiting), timeout=0)[0])
        now = time.monotonic()
        return [f for f in futures if (f.ref in answered if f.resend_at is None else f.resend_at <= now)]


class AsyncAddFuture:
    """The awaitable add's future: ``await future`` (or ``await future.result(attempt_timeout_s)``)
    gives the per-trajectory results once the coordinator acknowledged; awaiting it again gives
    the same results. The request goes out when the future is made (or, when the client was not
    connected yet, as soon as a task on the loop connected it)."""

    def __init__(
        self,
        ref: Any,
        request: AddRequest | None,
        resend: Callable[[], Any] | None = None,
        *,
        sending: asyncio.Task[tuple[Any, AddRequest, Callable[[], Any]]] | None = None,
        judge: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.ref = ref  # the current attempt's object ref (None while ``sending`` connects)
        self.request: AddRequest = request  # type: ignore[assignment]  # set by ``sending`` when None
        self.resend = resend  # sends the same request again (a new ref)
        self._sending = sending  # connects, then sends the first attempt (a client not yet connected)
        self._judge = judge  # told of a failure (the client's connection rule)
        self._results: Any = None
        self._settled = False
        self._lock = asyncio.Lock()  # one coroutine waits and resends; the others get its results

    def __await__(self) -> Generator[Any, None, Any]:
        return self.result().__await__()

    async def result(self, attempt_timeout_s: float | None = None) -> Any:
        """The per-trajectory results. ``attempt_timeout_s``: how long each attempt may wait
        (None: ``cluster.call_timeout_s``); past it, ``TimeoutError``, as
        :meth:`AddFuture.result`."""
        async with self._lock:
            if not self._settled:
                if self._sending is not None:
                    self.ref, self.request, self.resend = await self._sending
                    self._sending = None
                limit = self.request.wait_s if attempt_timeout_s is None else attempt_timeout_s
                self._results = await adrive(acknowledged(self, limit), self._judge)
                self._settled = True
        return self._results

    def done(self) -> bool:
        """Whether the current attempt has an answer (an acknowledgement or an error)."""
        if self.ref is None:
            return False
        ready, _ = ray.wait([self.ref], timeout=0)
        return bool(ready)
