"""Errors the sharded memory reports to its clients."""

from __future__ import annotations

from typing import NoReturn

from lifemem_ray.core.errors import DeploymentNotFoundError, LifeMemError, OverloadedError, ShardUnavailableError

__all__ = [
    "DeploymentNotFoundError",
    "OverloadedError",
    "ShardUnavailableError",
    "actor_failures",
    "raise_own",
    "raise_remote",
    "remote_cause",
]


def actor_failures(*also: type[BaseException]) -> tuple[type[BaseException], ...]:
    """The Ray exceptions that mean an actor (or its node) is gone, in this Ray version, after
    ``also`` (an ``except`` clause's other exceptions: one tuple a type checker can read)."""
    import ray.exceptions as rx

    names = ("RayActorError", "ActorDiedError", "ActorUnavailableError", "ActorUnschedulableError", "NodeDiedError")
    return (*also, *(getattr(rx, n) for n in names if hasattr(rx, n)))


def remote_cause(exc: BaseException) -> BaseException:
    """A remote task's own error without Ray's wrapping: the cause of a ``RayTaskError`` when
    it is an Exception (a ``ShardUnavailableError``, an ``IdConflictError``...), else ``exc``
    itself. The one place that knows where Ray keeps it."""
    import ray.exceptions as rx

    cause = getattr(exc, "cause", None) if isinstance(exc, rx.RayTaskError) else None
    return cause if isinstance(cause, Exception) else exc


def raise_own(exc: BaseException) -> NoReturn:
    """Raise what a caller of the memory should get for a remote call's failure ``exc``.

    The library's own error that the remote task raised (a :class:`LifeMemError`: a version a
    shard refused, a store's failure) is raised without Ray's wrapping, so the caller reads its
    message rather than a shard's traceback; any other error is raised as Ray gave it (with the
    remote traceback, which a bug report needs).

    Args:
        exc: what ``ray.get`` (or awaiting a ref) raised.

    Raises:
        LifeMemError: the remote task's own error.
        BaseException: ``exc`` itself, for any other.
    """
    cause = remote_cause(exc)
    if isinstance(cause, LifeMemError):
        raise cause from None
    raise exc


def raise_remote(exc: BaseException) -> NoReturn:
    """Raise a remote task's own error (:func:`remote_cause`) in place of Ray's wrapper; a
    wrapper without a usable cause is raised as an instance of its cause's type."""
    import ray.exceptions as rx

    cause = remote_cause(exc)
    if cause is not exc:
        raise cause from None
    if isinstance(exc, rx.RayTaskError):
        raise exc.as_instanceof_cause() from None
    raise exc
