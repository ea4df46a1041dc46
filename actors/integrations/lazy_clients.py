"""A deployment's client for the RL-stack adapters, connected on first use and found again
after the deployment went away: one rule for verl's async loop and SkyRL's threads.

An adapter's process starts before, or outlives, a memory deployment: the connection is made
at the first call; a failed connect raises (the episode memory counts it as that episode's
failure) and is not tried again for ``reconnect_after_s`` (episodes meanwhile fail at once,
saying why); a call that fails otherwise than with one of the memory's own answers (a
:class:`LifeMemError`: a shard unavailable for now, a refused trajectory) drops the connection:
the deployment's actors are gone (dead, or of a deployment stopped and served again), and the
next call looks the deployment up again.

Example::

    client = LazyMemoryClient("lifemem", None, DeploymentConfig(), reconnect_after_s=30)
    found = client.retrieve("buy a lamp", "webshop", 4, tenant="default")  # connects now
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from lifemem_ray.actors.cluster.async_client import AsyncMemoryClient
from lifemem_ray.actors.cluster.client import MemoryClient
from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.core.errors import ConfigError, DeploymentNotFoundError, LifeMemError
from lifemem_ray.engine.retrieval import Retrieval

__all__ = ["AsyncLazyMemoryClient", "ConnectBackoff", "LazyMemoryClient"]


def drops_connection(exc: BaseException) -> bool:
    """Whether a call's failure means the connection is stale: anything but the memory's own answers."""
    return not isinstance(exc, LifeMemError)


class _WatchedAdd:
    """A sync add's future whose failure, seen when its acknowledgement is awaited, is judged
    as the call's own (:func:`drops_connection`)."""

    def __init__(self, future: Any, on_failure: Any) -> None:
        self.future, self.on_failure = future, on_failure

    def result(self, timeout: float | None = None) -> Any:
        try:
            return self.future.result(timeout=timeout)
        except Exception as exc:
            self.on_failure(exc)
            raise


RECONNECT_AFTER_S_BOUNDS = (0.0, 3_600.0)  # seconds a failed connect is not tried again: at most an hour


def check_reconnect_after_s(value: Any, where: str) -> float:
    """``reconnect_after_s`` as every adapter takes it (one bound, :data:`RECONNECT_AFTER_S_BOUNDS`).

    Raises:
        ConfigError: not a number within the bounds, naming ``where``.
    """
    low, high = RECONNECT_AFTER_S_BOUNDS
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ConfigError(f"{where}: reconnect_after_s must be a number in {low:g}..{high:g}, got {value!r}")
    return float(value)


class ConnectBackoff:
    """When a connect may be tried: not within ``reconnect_after_s`` of a failed one."""

    def __init__(self, namespace: str, reconnect_after_s: float) -> None:
        self.namespace, self.reconnect_after_s = namespace, reconnect_after_s
        self.connects = 0  # connections made
        self._retry_at = 0.0
        self._last_error = ""

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


class LazyMemoryClient:
    """:class:`MemoryClient` of the deployment in ``namespace``, for threads (module docstring)."""

    def __init__(self, namespace: str, address: str | None, config: DeploymentConfig, reconnect_after_s: float) -> None:
        self.namespace, self.address, self.config = namespace, address, config
        self.backoff = ConnectBackoff(namespace, reconnect_after_s)
        self._client: MemoryClient | None = None
        self._lock = threading.Lock()

    def client(self) -> MemoryClient:
        """The connected client (connecting now if needed)."""
        with self._lock:
            if self._client is None:
                self.backoff.check()
                try:
                    self._client = MemoryClient.connect(
                        namespace=self.namespace, address=self.address, config=self.config
                    )
                except Exception as exc:
                    self.backoff.failed(exc)
                    raise
                self.backoff.succeeded()
            return self._client

    def retrieve(self, task: str, env: str | None, k: int, **options: Any) -> Retrieval:
        """The client's retrieve (``options``: ``tenant``, ``as_of`` ...)."""
        client = self.client()
        try:
            return client.retrieve(task, env, k, **options)
        except Exception as exc:
            self._judge(client, exc)
            raise

    def add(self, trajectory: Any) -> Any:
        """The client's add: its future, whose failure is judged when its acknowledgement is awaited."""
        client = self.client()
        try:
            future = client.add(trajectory)
        except Exception as exc:
            self._judge(client, exc)
            raise
        return _WatchedAdd(future, lambda exc: self._judge(client, exc))

    def _judge(self, client: MemoryClient, exc: BaseException) -> None:
        if drops_connection(exc):
            with self._lock:
                if self._client is client:
                    self._client = None  # look the deployment up again next time


class AsyncLazyMemoryClient:
    """:class:`AsyncMemoryClient` of the deployment in ``namespace``, for one event loop."""

    def __init__(self, namespace: str, address: str | None, config: DeploymentConfig, reconnect_after_s: float) -> None:
        self.namespace, self.address, self.config = namespace, address, config
        self.backoff = ConnectBackoff(namespace, reconnect_after_s)
        self._client: AsyncMemoryClient | None = None
        self._lock = asyncio.Lock()

    async def client(self) -> AsyncMemoryClient:
        """The connected client (connecting now if needed)."""
        if self._client is not None:
            return self._client
        async with self._lock:
            if self._client is None:
                self.backoff.check()
                try:
                    self._client = await AsyncMemoryClient.connect(self.namespace, self.address, self.config)
                except Exception as exc:
                    self.backoff.failed(exc)
                    raise
                self.backoff.succeeded()
        return self._client

    async def retrieve(self, task: str, env: str | None, k: int, **options: Any) -> Retrieval:
        """The client's retrieve (``options``: ``tenant``, ``as_of`` ...)."""
        client = await self.client()
        try:
            return await client.retrieve(task, env, k, **options)
        except Exception as exc:
            self._judge(client, exc)
            raise

    async def add(self, trajectory: Any) -> Any:
        """The client's add, acknowledged (or failed)."""
        client = await self.client()
        try:
            return await client.add(trajectory)
        except Exception as exc:
            self._judge(client, exc)
            raise

    def _judge(self, client: AsyncMemoryClient, exc: BaseException) -> None:
        if drops_connection(exc) and self._client is client:
            self._client = None  # look the deployment up again next time
