"""Errors the sharded memory reports to its clients."""

from __future__ import annotations

__all__ = ["DeploymentNotFoundError", "OverloadedError", "ShardUnavailableError"]


class OverloadedError(RuntimeError):
    """The coordinator's queue stayed full for longer than ``cluster.overload_timeout_s``."""


class ShardUnavailableError(RuntimeError):
    """A shard (or the node it is pinned to) is gone; what it acknowledged is in its store
    and in the last snapshot, and what it did not acknowledge may be retried."""


class DeploymentNotFoundError(RuntimeError):
    """No lifemem-ray deployment runs in this Ray namespace."""


def actor_failures() -> tuple[type[BaseException], ...]:
    """The Ray exceptions that mean an actor (or its node) is gone, in this Ray version."""
    import ray.exceptions as rx

    names = ("RayActorError", "ActorDiedError", "ActorUnavailableError", "ActorUnschedulableError", "NodeDiedError")
    return tuple(getattr(rx, n) for n in names if hasattr(rx, n))
