"""The memory of a SkyRL process: one client per deployment and one episode memory per
deployment and options, shared by every environment the process makes, and the checks of
each environment's ``memory`` block."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from typing import Any

from lifemem_ray.actors.client.blocking import MemoryClient
from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.actors.integrations.adapter_options import MemoryAdapterOptions
from lifemem_ray.actors.integrations.skyrl_env.config_checks import (
    as_mapping,
)
from lifemem_ray.core.errors import ConfigError
from lifemem_ray.core.validation import validated
from lifemem_ray.episodes.episode_memory import EpisodeMemory

__all__ = ["SHARED_CLIENTS", "SharedClients", "episode_memory_opener"]


class SharedClients:
    """One client per deployment for the whole process, and one :class:`EpisodeMemory`
    per deployment and episode options (SkyRL makes an environment per trajectory; they share
    the client's handles and vector cache, one background writer and one bound on writes in
    flight). The client connects on first use, remembers a failed connect for
    ``reconnect_after_s`` and finds a deployment served again
    (:class:`~lifemem_ray.actors.client.connection.Connection`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._clients: dict[tuple[str, str, str], MemoryClient] = {}
        self._episodes: dict[tuple[int, str], EpisodeMemory] = {}  # (client, options) -> its episode memory

    def get(
        self, namespace: str, address: str | None, config: DeploymentConfig, reconnect_after_s: float
    ) -> MemoryClient:
        key = (namespace, address or "", json.dumps(config.to_dict(), sort_keys=True, default=repr))
        with self._lock:
            if key not in self._clients:
                self._clients[key] = MemoryClient(
                    namespace, config, address=address, reconnect_after_s=reconnect_after_s
                )
            return self._clients[key]

    def episodes(
        self,
        namespace: str,
        address: str | None,
        config: DeploymentConfig,
        reconnect_after_s: float,
        options: Mapping[str, Any],
    ) -> EpisodeMemory:
        """The process's :class:`EpisodeMemory` over the deployment's client with ``options``."""
        client = self.get(namespace, address, config, reconnect_after_s)
        key = (id(client), json.dumps(dict(options), sort_keys=True, default=repr))
        with self._lock:
            if key not in self._episodes:
                self._episodes[key] = EpisodeMemory(client, **options)
            return self._episodes[key]


SHARED_CLIENTS = SharedClients()


def episode_memory_opener(spec: Any, memory: Any, where: str) -> Callable[[], tuple[EpisodeMemory, bool]]:
    """Checks ``spec`` now (nothing connects); the call it returns gives the episode memory of
    one environment and whether the environment owns it: ``memory`` as given (an
    :class:`EpisodeMemory`, shared; or a memory object, wrapped for this environment), else the
    process's shared episode memory over its client of the deployment ``spec`` names
    (``namespace``, ``address``, ``overrides``: dotted DeploymentConfig settings of the client)
    with ``spec``'s episode options."""
    block = as_mapping(spec, where)
    checked = validated(MemoryAdapterOptions, block, where=where)  # every option, named where it was given
    episode_options = checked.episode_options()
    if isinstance(memory, EpisodeMemory):
        return lambda: (memory, False)
    if memory is not None:
        return lambda: (EpisodeMemory(memory, **episode_options), True)
    if not block:
        raise ConfigError(
            "missing; give {namespace: <the deployment's Ray namespace>} "
            "(and address, overrides, k, tenant ... as needed), or pass memory= to skyrl_gym.make",
            where=where,
        )
    if "namespace" not in block:
        raise ConfigError("the deployment's Ray namespace is missing", where=f"{where}.namespace")
    namespace, address, retry = checked.namespace, checked.address, checked.reconnect_after_s
    config = checked.deployment_config(where)
    return lambda: (SHARED_CLIENTS.episodes(namespace, address, config, retry, episode_options), False)
