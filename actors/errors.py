"""Errors the sharded memory reports to its clients."""

from __future__ import annotations
from lifemem_ray.errors import DeploymentNotFoundError, OverloadedError, ShardUnavailableError

__all__ = ["DeploymentNotFoundError", "OverloadedError", "ShardUnavailableError"]


def actor_failures() -> tuple[type[BaseException], ...]:
    """The Ray exceptions that mean an actor (or its node) is gone, in this Ray version."""
    import ray.exceptions as rx

    names = ("RayActorError", "ActorDiedError", "ActorUnavailableError", "ActorUnschedulableError", "NodeDiedError")
    return tuple(getattr(rx, n) for n in names if hasattr(rx, n))
