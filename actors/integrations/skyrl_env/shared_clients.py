"""The memory of a SkyRL process: one client per deployment shared by every environment the
process makes, a remembered connection failure, and the episode memory each environment
gets from its ``memory`` block."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.actors.integrations.skyrl_env.config_checks import (
    CONNECTION_KEYS,
    EPISODE_KEYS,
    as_mapping,
    bounded_number,
    check_keys,
    nonempty_name,
)
from lifemem_ray.core.errors import ConfigError, DeploymentNotFoundError, InvalidArgumentError
from lifemem_ray.core.tenancy import check_tenant
from lifemem_ray.engine.versions import check_version
from lifemem_ray.lab.episode_memory import EpisodeMemory

__all__ = ["SHARED_CLIENTS", "SharedClients", "UnreachableMemory", "check_episode_options", "episode_memory_opener"]

log = logging.getLogger(__name__)


class UnreachableMemory:
    """Stands for a deployment this process could not connect to: every call fails, so each
    episode degrades to no memory and is counted (the connection is tried again later)."""

    def __init__(self, namespace: str, error: str, retry_after_s: float) -> None:
        self.message = (
            f"the memory deployment in Ray namespace {namespace!r} is unreachable from this process ({error}); "
            f"the connection is tried again {retry_after_s:g} s after the failure"
        )

    def retrieve(self, *args: Any, **kwargs: Any) -> Any:
        raise DeploymentNotFoundError(self.message)

    def add(self, *args: Any, **kwargs: Any) -> Any:
        raise DeploymentNotFoundError(self.message)


class SharedClients:
    """One ``MemoryClient`` per deployment for the whole process (SkyRL makes one environment
    per trajectory; the client's handles and vector cache are shared). A failed connection is
    remembered for ``reconnect_after_s`` (episodes meanwhile run without memory)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._clients: dict[tuple[str, str, str], Any] = {}
        self._failures: dict[tuple[str, str, str], tuple[float, str]] = {}
        self._episodes: dict[tuple[int, str], EpisodeMemory] = {}  # (client, options) -> its episode memory

    def get(self, namespace: str, address: str | None, config: DeploymentConfig, reconnect_after_s: float) -> Any:
        key = (namespace, address or "", json.dumps(config.to_dict(), sort_keys=True, default=repr))
        with self._lock:
            client = self._clients.get(key)
            if client is not None:
                return client
            failed = self._failures.get(key)
            if failed is not None and time.monotonic() - failed[0] < reconnect_after_s:
                return UnreachableMemory(namespace, failed[1], reconnect_after_s)
            from lifemem_ray.actors.cluster.client import MemoryClient

            try:
                client = MemoryClient.connect(namespace=namespace, address=address, config=config)
            except Exception as exc:  # noqa: BLE001 - an unreachable memory degrades episodes, never the rollout
                error = f"{type(exc).__name__}: {exc}"[:500]
                self._failures[key] = (time.monotonic(), error)
                log.warning("memory in namespace %r unreachable: %s (episodes run without memory)", namespace, error)
                return UnreachableMemory(namespace, error, reconnect_after_s)
            self._failures.pop(key, None)
            self._clients[key] = client
            return client

    def episodes(
        self,
        namespace: str,
        address: str | None,
        config: DeploymentConfig,
        reconnect_after_s: float,
        options: Mapping[str, Any],
    ) -> tuple[EpisodeMemory, bool]:
        """The process's :class:`EpisodeMemory` over the deployment's client with ``options``
        (one background writer and one bound on writes in flight for every environment of the
        process), and False: nobody's environment owns it. While the deployment is unreachable,
        an episode memory of the environment's own over the failing stand-in (True: it owns it)."""
        client = self.get(namespace, address, config, reconnect_after_s)
        if isinstance(client, UnreachableMemory):
            return EpisodeMemory(client, **options), True
        key = (id(client), json.dumps(dict(options), sort_keys=True, default=repr))
        with self._lock:
            episodes = self._episodes.get(key)
            if episodes is None:
                episodes = self._episodes[key] = EpisodeMemory(client, **options)
        return episodes, False


SHARED_CLIENTS = SharedClients()


def check_episode_options(options: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The :class:`EpisodeMemory` options among ``options``, checked against its bounds."""
    chosen = {key: options[key] for key in EPISODE_KEYS & set(options)}
    for key, (low, high) in EpisodeMemory.BOUNDS.items():
        if key in chosen:
            bounded_number(chosen[key], low, high, f"{where}['{key}']")
    if "tenant" in chosen:
        check_tenant(chosen["tenant"], f"{where}['tenant']")
    if "as_of" in chosen and chosen["as_of"] is not None:
        try:
            check_version(chosen["as_of"], f"{where}['as_of']")
        except InvalidArgumentError as exc:
            raise ConfigError(str(exc)) from None
    if "same_env" in chosen and not isinstance(chosen["same_env"], bool):
        raise ConfigError(f"{where}['same_env']: expected true or false, got {chosen['same_env']!r}")
    return chosen


def episode_memory_opener(spec: Any, memory: Any, where: str) -> Callable[[], tuple[EpisodeMemory, bool]]:
    """Checks ``spec`` now (nothing connects); the call it returns gives the episode memory of
    one environment and whether the environment owns it: ``memory`` as given (an
    :class:`EpisodeMemory`, shared; or a memory object, wrapped for this environment), else the
    process's shared episode memory over its client of the deployment ``spec`` names
    (``namespace``, ``address``, ``overrides``: dotted DeploymentConfig settings of the client)
    with ``spec``'s episode options."""
    options = as_mapping(spec, where)
    check_keys(options, CONNECTION_KEYS | EPISODE_KEYS, where)
    episode_options = check_episode_options(options, where)
    if isinstance(memory, EpisodeMemory):
        return lambda: (memory, False)
    if memory is not None:
        return lambda: (EpisodeMemory(memory, **episode_options), True)
    if not options:
        raise ConfigError(
            f"{where}: missing; give {{namespace: <the deployment's Ray namespace>}} "
            "(and address, overrides, k, tenant ... as needed), or pass memory= to skyrl_gym.make"
        )
    namespace = nonempty_name(options.get("namespace"), f"{where}['namespace']")
    address = options.get("address")
    if address is not None:
        address = nonempty_name(address, f"{where}['address']")
    overrides = as_mapping(options.get("overrides"), f"{where}['overrides']")
    config = DeploymentConfig().replace(overrides, source=f"{where}['overrides']")
    retry = bounded_number(options.get("reconnect_after_s", 30.0), 0.0, 86_400.0, f"{where}['reconnect_after_s']")
    return lambda: SHARED_CLIENTS.episodes(namespace, address, config, retry, episode_options)
