"""The remote calls a client operation waits for, and the two loops that carry them out.

Every client operation is written once, as a *script*: a generator that yields each call it
must wait for (:class:`Remote`, :class:`Blocking`, :class:`Sleep`, :class:`Join`) and
receives its answer, or has the call's failure raised at the ``yield``. :func:`drive` carries
a script out blocking (``ray.get``, the function itself, ``time.sleep``); :func:`adrive`
awaiting (the refs awaited, a blocking function in a thread, ``asyncio.sleep``). So
:class:`~lifemem_ray.actors.client.blocking.MemoryClient` and
:class:`~lifemem_ray.actors.client.awaiting.AsyncMemoryClient` share every rule, and differ
only in how they wait. The same pattern carries out an episode (:mod:`lifemem_ray.lab.episode`).

>>> def script():
...     answer = yield Blocking(lambda: 2 + 2)
...     return answer * 10
>>> drive(script())
40
>>> import asyncio
>>> asyncio.run(adrive(script()))
40
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from typing import Any, TypeVar

import ray

from lifemem_ray.engine.retrieval import paused_gc

__all__ = ["Blocking", "Join", "Remote", "Script", "Sleep", "adrive", "drive"]

T = TypeVar("T")


@dataclass(frozen=True)
class Remote:
    """Ray object refs answered together within ``limit_s`` seconds (None: no bound): the
    script receives their values in order (``one``: the single ref's value). No answer in time
    is a ``TimeoutError`` at the ``yield``; an actor's failure, Ray's own exception."""

    refs: list[Any]
    limit_s: float | None
    one: bool = False
    # Many small objects arrive (a retrieval's records): the blocking loop holds off the cyclic
    # collector while they are read (engine.retrieval.paused_gc), as in one process. The awaiting
    # loop does not: a pause would span other coroutines' turns.
    many_objects: bool = False


@dataclass(frozen=True)
class Blocking:
    """A call that blocks (a named actor's lookup, a connect): run as it is, or in a thread by
    :func:`adrive` (``afn``: its own awaitable form, used there instead)."""

    fn: Callable[[], Any]
    afn: Callable[[], Awaitable[Any]] | None = None


@dataclass(frozen=True)
class Sleep:
    """Wait ``seconds`` (a resend's delay)."""

    seconds: float


@dataclass(frozen=True)
class Join:
    """Wait for another caller's call in flight: ``wait()`` blocks, ``await wait_async()``
    does not; either gives that call's answer."""

    wait: Callable[[], Any]
    wait_async: Callable[[], Awaitable[Any]]


Call = Remote | Blocking | Sleep | Join
Script = Generator[Call, Any, T]


def drive(script: Script[T], on_error: Callable[[BaseException], None] | None = None) -> T:
    """Carry ``script`` out in this thread; returns what it returns.

    Args:
        script: the operation's generator.
        on_error: told of the exception the script ends with (before it is raised).

    Returns:
        The script's result.

    Raises:
        Whatever the script raises (a call's failure it does not handle among them).
    """
    answer: Any = None
    failure: BaseException | None = None
    try:
        while True:
            try:
                call = script.send(answer) if failure is None else script.throw(failure)
            except StopIteration as stop:
                return stop.value
            answer, failure = None, None
            try:
                answer = _perform(call)
            except BaseException as exc:  # noqa: BLE001 - handed to the script, which decides
                failure = exc
    except BaseException as exc:
        if on_error is not None:
            on_error(exc)
        raise


async def adrive(script: Script[T], on_error: Callable[[BaseException], None] | None = None) -> T:
    """Carry ``script`` out on the running event loop, never blocking it (as :func:`drive`;
    a cancellation is raised into the script at its ``yield``, so it cleans up)."""
    answer: Any = None
    failure: BaseException | None = None
    try:
        while True:
            try:
                call = script.send(answer) if failure is None else script.throw(failure)
            except StopIteration as stop:
                return stop.value
            answer, failure = None, None
            try:
                answer = await _aperform(call)
            except BaseException as exc:  # noqa: BLE001 - handed to the script, which decides
                failure = exc
    except BaseException as exc:
        if on_error is not None:
            on_error(exc)
        raise


def _perform(call: Call) -> Any:
    if isinstance(call, Remote):
        try:
            with paused_gc() if call.many_objects else contextlib.nullcontext():
                values = ray.get(call.refs, timeout=call.limit_s)
        except ray.exceptions.RayTaskError:
            _read_the_rest(call.refs)
            raise
        return values[0] if call.one else values
    if isinstance(call, Blocking):
        return call.fn()
    if isinstance(call, Sleep):
        time.sleep(call.seconds)
        return None
    return call.wait()


async def _aperform(call: Call) -> Any:
    if isinstance(call, Remote):
        values = await asyncio.wait_for(_gather(call.refs), call.limit_s)
        return values[0] if call.one else values
    if isinstance(call, Blocking):
        return await (call.afn() if call.afn is not None else asyncio.to_thread(call.fn))
    if isinstance(call, Sleep):
        await asyncio.sleep(call.seconds)
        return None
    return await call.wait_async()


async def _gather(refs: list[Any]) -> list[Any]:
    """Every ref's value, awaited together (the first error is raised)."""
    return list(await asyncio.gather(*refs))


def _read_the_rest(refs: list[Any], wait_s: float = 1.0) -> None:
    """Read the answers of ``refs`` that come within ``wait_s`` after one of them failed: every
    shard usually refuses the same call, and an error never read is printed by Ray, with its
    traceback, when its ref is dropped (an "Unhandled error" on the caller's stderr)."""
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s)
    for ref in ready:
        with contextlib.suppress(Exception):  # read only so that Ray does not print it; the first error is raised
            ray.get(ref, timeout=0)
