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
