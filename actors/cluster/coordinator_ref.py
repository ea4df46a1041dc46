"""The deployment's coordinator as every client reaches it: by its name, found again after it
died, every wait bounded. One rule for :class:`~lifemem_ray.actors.client.blocking.MemoryClient`,
:class:`~lifemem_ray.actors.client.awaiting.AsyncMemoryClient` (and so for the RL-stack
adapters, the rollout workers and the front door, which reach the deployment through them).

A coordinator handle outlives its actor: one that died for good (its node was lost, and
``serve`` started a new one under the same name) answers every call with ``ActorDiedError``
forever, and one whose node is gone may not answer at all. So a call that finds the actor gone
drops the handle and looks the name up once more before it gives up, and no call waits longer
than its bound (``cluster.call_timeout_s``): past it, :class:`CoordinatorUnavailableError`.
The coordinator's own refusals come back as themselves, not in Ray's wrapper.

>>> ref = CoordinatorRef("lifemem", timeout_s=30.0)
>>> ref.timeout_s
30.0
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import ray

from lifemem_ray.actors.cluster.deployment import find_coordinator
from lifemem_ray.actors.cluster.ray_internals import forget_dead_actor
from lifemem_ray.actors.cluster.remote_errors import actor_failures, raise_remote
from lifemem_ray.core.errors import CoordinatorUnavailableError, DeploymentNotFoundError

__all__ = ["CoordinatorRef"]


class CoordinatorRef:
    """The coordinator of the deployment in ``namespace``, looked up by name when first needed
    and again after it was found gone. Picklable (a request carrying it can be sent again from
    another process)."""

    def __init__(self, namespace: str, timeout_s: float, handle: Any = None) -> None:
        self.namespace = namespace  # the deployment's Ray namespace
        self.timeout_s = timeout_s  # the longest any call waits for its answer
        self._handle = handle  # the actor handle in use (None: look it up at the next call)

    @property
    def handle(self) -> Any:
        """The handle in use, looked up by name if there is none.

        Raises:
            DeploymentNotFoundError: no coordinator of that name runs.
        """
        if self._handle is None:
            self._handle = find_coordinator(self.namespace)
        return self._handle

    def forget(self) -> None:
        """The handle is gone (its actor died): the next call looks the name up again. A dead
        actor is forgotten by this process's Ray too, else a process connected before a GCS
        restart keeps finding it under the name (:func:`~.ray_internals.forget_dead_actor`)."""
        handle, self._handle = self._handle, None
        if handle is not None:
            with contextlib.suppress(Exception):  # the GCS unreachable now: the next lookup tries again
                forget_dead_actor(handle)

    def refreshed(self) -> Any:
        """A handle looked up by name now (what a request sent again uses)."""
        if self._handle is None:
            with contextlib.suppress(ValueError, DeploymentNotFoundError):
                self._handle = find_coordinator(self.namespace)
        self.forget()
        return self.handle

    def call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        """``method(*args)`` on the coordinator, its answer within ``timeout_s`` (default: the
        ref's bound). A coordinator found gone is looked up again and asked once more: use for
        calls that are safe to repeat (reads, and removals, which are idempotent).

        Raises:
            CoordinatorUnavailableError: no answer in time, or gone again after the new lookup.
            DeploymentNotFoundError: no coordinator of that name runs any more.
        """
        limit = self.timeout_s if timeout_s is None else timeout_s
        gone: list[BaseException] = []
        for _ in range(2):
            with self._answering(method, limit, gone):
                return ray.get(getattr(self.handle, method).remote(*args), timeout=limit)
            self.forget()
        raise self._gone(method, gone[-1])

    async def acall(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        """:meth:`call` for an event loop (the lookup and the forgetting run off the loop)."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        gone: list[BaseException] = []
        for _ in range(2):
            handle = self._handle if self._handle is not None else await asyncio.to_thread(lambda: self.handle)
            with self._answering(method, limit, gone):
                future = asyncio.wrap_future(getattr(handle, method).remote(*args).future())
                return await asyncio.wait_for(future, limit)
            await asyncio.to_thread(self.forget)
        raise self._gone(method, gone[-1])

    @contextlib.contextmanager
    def _answering(self, method: str, limit: float, gone: list[BaseException]) -> Iterator[None]:
        """What :meth:`call` and :meth:`acall` make of a failed call: no answer in time is
        :class:`CoordinatorUnavailableError`, the coordinator's own error is raised as itself, and
        an actor found gone is appended to ``gone`` and swallowed (the caller forgets the handle
        and asks once more)."""
        try:
            yield
        except TimeoutError:  # Ray's GetTimeoutError is one too
            raise self._late(method, limit) from None
        except ray.exceptions.RayTaskError as exc:
            raise_remote(exc)
        except actor_failures() as exc:
            gone.append(exc)

    def _late(self, method: str, limit: float) -> CoordinatorUnavailableError:
        return CoordinatorUnavailableError(
            f"the coordinator of deployment {self.namespace!r} did not answer {method} within {limit:g} s "
            "(cluster.call_timeout_s): its node may be restarting; what it acknowledged is stored, retry later"
        )

    def _gone(self, method: str, exc: BaseException) -> CoordinatorUnavailableError:
        return CoordinatorUnavailableError(
            f"the coordinator of deployment {self.namespace!r} is gone ({type(exc).__name__}) and its replacement "
            f"did not answer {method}; `lifemem-ray status --namespace {self.namespace}` says what runs"
        )
