"""A client's connection to its deployment: made at the first call, dropped when the
deployment went away, made again at the next call. One rule for every client (the blocking
and the awaitable one, and so the RL-stack adapters, the front door and the rollout workers).

A process starts before, or outlives, a memory deployment: the connection (the coordinator's
answer to ``deployment``, the embedder actors' handles) is made at the first call; a failed
connect raises and is not tried again for ``reconnect_after_s`` (calls meanwhile fail at once,
saying why). A call that finds no deployment by name, or an actor of it gone (Ray's actor
failures, past what the call itself handles), drops the connection: the deployment is gone
(dead, or stopped and served again), and the next call looks it up again. Within a connection,
the coordinator is found again by name after it died
(:class:`~lifemem_ray.actors.cluster.coordinator_ref.CoordinatorRef`), the shard handles after
a shard failed (a shard restarts under its name), and the embedders after they did not answer.

>>> connection = Connection("lifemem", None, DeploymentConfig(), reconnect_after_s=30)
>>> connection.connected
False
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from lifemem_ray.actors.client.calls import Blocking, Script
from lifemem_ray.actors.cluster import ray_address
from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.actors.cluster.coordinator_ref import CoordinatorRef
from lifemem_ray.actors.cluster.ray_shards import find_embedders_again
from lifemem_ray.actors.cluster.remote_errors import actor_failures
from lifemem_ray.core.errors import ConfigError, DeploymentNotFoundError, ShardUnavailableError

__all__ = [
    "RECONNECT_AFTER_S_BOUNDS",
    "ConnectBackoff",
    "Connection",
    "DeploymentHandles",
    "check_reconnect_after_s",
    "drops_connection",
]

RECONNECT_AFTER_S_BOUNDS = (0.0, 3_600.0)  # seconds a failed connect is not tried again: at most an hour


def check_reconnect_after_s(value: Any, where: str) -> float:
    """``reconnect_after_s`` as every client takes it (one bound, :data:`RECONNECT_AFTER_S_BOUNDS`).

    Args:
        value: the seconds asked for.
        where: what set it, named in the error.

    Returns:
        The seconds, as a float.

    Raises:
        ConfigError: not a number within the bounds, naming ``where``.
    """
    low, high = RECONNECT_AFTER_S_BOUNDS
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ConfigError(f"reconnect_after_s must be a number in {low:g}..{high:g}, got {value!r}", where=where)
    return float(value)


def drops_connection(exc: BaseException) -> bool:
    """Whether a call's failure means the connection is stale: no deployment found by name, or
    one of its actors gone for good in a way the call could not get past (Ray's actor
    failures). The memory's own answers (a shard unavailable for now, a refused trajectory), a
    timeout and a cancellation keep it."""
    return isinstance(exc, actor_failures(DeploymentNotFoundError))


class ConnectBackoff:
    """When a connect may be tried: not within ``reconnect_after_s`` of a failed one."""

    def __init__(self, namespace: str, reconnect_after_s: float) -> None:
        self.namespace, self.reconnect_after_s = namespace, reconnect_after_s
        self.connects = 0  # connections made
        self._retry_at = 0.0  # monotonic time before which no connect is tried
        self._last_error = ""  # why the last connect failed, repeated while backing off

    def check(self) -> None:
        """Raise, saying why, while the last failed connect is too recent to try again."""
        if time.monotonic() < self._retry_at:
            raise DeploymentNotFoundError(
                f"lifemem memory in Ray namespace {self.namespace!r}: the last connect failed "
                f"({self._last_error}); retrying {self.reconnect_after_s:g} s after it (reconnect_after_s)"
            )

    def failed(self, exc: BaseException) -> None:
        self._retry_at = time.monotonic() + self.reconnect_after_s
        self._last_error = f"{type(exc).__name__}: {exc}"[:300]

    def succeeded(self) -> None:
        self.connects += 1


@dataclass
class DeploymentHandles:
    """What a connection found: the deployment's vector size and its actors (handles typed
    Any: Ray types an actor's methods as Never)."""

    dim: int
    shard_names: list[str]
    embedder_names: list[str]
    embedders: list[Any]
    shards: list[Any] | None = None  # looked up on first use, and again after a shard failed


class Connection:
    """The deployment in ``namespace`` as one client reaches it (module docstring). Thread-safe."""

    def __init__(
        self,
        namespace: str,
        address: str | None,
        config: DeploymentConfig,
        reconnect_after_s: float = 0.0,
        on_connect: Callable[[], None] | None = None,
    ) -> None:
        self.namespace = namespace  # the deployment's Ray namespace
        self.address = address  # the Ray cluster to join if this process has none (never a scan)
        self.config = config
        self.backoff = ConnectBackoff(namespace, check_reconnect_after_s(reconnect_after_s, "the client"))
        # The coordinator by name, found again after it died, every call bounded (coordinator_ref's rule).
        self.coordinator = CoordinatorRef(namespace, config.cluster.call_timeout_s)
        self._handles: DeploymentHandles | None = None  # None: connect at the next call
        self._lock = threading.Lock()  # one connect at a time
        # Told of each new connection after the first (what was kept of the last deployment goes).
        self._on_connect = on_connect

    @property
    def connected(self) -> bool:
        """Whether the next call finds the deployment's handles without connecting."""
        return self._handles is not None

    def handles(self) -> Script[DeploymentHandles]:
        """The deployment's handles (connecting first when there are none)."""
        found = self._handles
        if found is None:
            found = yield Blocking(self.open)
        return found

    def shards(self) -> Script[list[Any]]:
        """The shard actors' handles (looked up on first use, and after a shard failed).

        Raises:
            ShardUnavailableError: a shard is not running now (it restarts under its name).
        """
        handles = yield from self.handles()
        found = handles.shards
        if found is None:
            found = yield Blocking(lambda: self._look_up_shards(handles))
        return found

    def open(self) -> DeploymentHandles:
        """Connect now unless connected (blocking; a thread of its own for the awaitable client).

        Raises:
            DeploymentNotFoundError: no deployment in the namespace, or the last connect failed
                within ``reconnect_after_s``.
        """
        with self._lock:
            if self._handles is None:
                self.backoff.check()
                try:
                    if not ray.is_initialized():
                        ray_address.connect(self.address, self.namespace, include_dashboard=False, log_to_driver=False)
                    info = self.coordinator.call("deployment")
                    embedders = self._named(info["embedders"])
                except Exception as exc:
                    self.backoff.failed(exc)
                    raise
                self._handles = DeploymentHandles(info["dim"], info["shards"], info["embedders"], embedders)
                if self.backoff.connects and self._on_connect is not None:
                    self._on_connect()
                self.backoff.succeeded()
            return self._handles

    def judge(self, exc: BaseException) -> None:
        """A call failed with ``exc``: drop the connection if it says the deployment went away
        (:func:`drops_connection`); the next call connects again."""
        if drops_connection(exc):
            self.drop()

    def drop(self) -> None:
        """Forget the deployment's handles: the next call connects again."""
        with self._lock:
            self._handles = None

    def forget_shards(self) -> None:
        """A shard failed: look the shard handles up again at the next call."""
        handles = self._handles
        if handles is not None:
            handles.shards = None

    def find_embedders_again(self, handles: DeploymentHandles) -> None:
        """The embedders did not answer: their handles looked up again (a node was lost)."""
        handles.embedders = find_embedders_again(handles.embedders, handles.embedder_names, self.namespace)

    def _look_up_shards(self, handles: DeploymentHandles) -> list[Any]:
        handles.shards = self._named(handles.shard_names)
        return handles.shards

    def _named(self, names: list[str]) -> list[Any]:
        """The handles of the deployment's actors of these names.

        Raises:
            ShardUnavailableError: one is not running now (it restarts under its name).
        """
        try:
            return [ray.get_actor(name, namespace=self.namespace) for name in names]
        except ValueError as exc:  # an actor is gone and not yet started again
            raise ShardUnavailableError(
                f"the deployment in namespace {self.namespace!r} misses an actor now ({exc}); retry shortly"
            ) from None
