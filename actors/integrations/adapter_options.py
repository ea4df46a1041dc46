"""The memory options every RL-stack adapter takes, as one checked object: where the
deployment is (``namespace``, ``address``, its settings from ``config_file`` and
``overrides``), how a failed connect is retried (``reconnect_after_s``), and the episode
options (:class:`~lifemem_ray.episodes.episode_options.EpisodeOptions`). SkyRL's ``memory``
block and verl's agent-loop YAML (whose names carry a ``memory_`` prefix: ``memory_namespace``,
``memory_address``, ``memory_config``) are both read through it; a refusal names the option
where it was given.

>>> MemoryAdapterOptions.model_validate({"memory_namespace": "rl", "k": 8}).namespace
'rl'
"""

from __future__ import annotations

from typing import Any

from pydantic import AliasChoices, Field

from lifemem_ray.actors.client.connection import RECONNECT_AFTER_S_BOUNDS
from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.episodes.episode_options import EpisodeOptions

__all__ = ["CONNECTION_OPTIONS", "EPISODE_OPTIONS", "MemoryAdapterOptions"]


class MemoryAdapterOptions(EpisodeOptions):
    """An adapter's memory options (module docstring); frozen, unknown options refused."""

    namespace: str = Field(
        "lifemem",
        min_length=1,
        validation_alias=AliasChoices("namespace", "memory_namespace"),
        description="the deployment's Ray namespace",
    )
    address: str | None = Field(
        None,
        min_length=1,
        validation_alias=AliasChoices("address", "memory_address"),
        description="the Ray cluster to join when the process has none (never a scan)",
    )
    config_file: str | None = Field(
        None,
        min_length=1,
        validation_alias=AliasChoices("config_file", "memory_config"),
        description="the deployment's TOML settings (client timeouts, features)",
    )
    overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="dotted DeploymentConfig settings over the file's (cluster.call_timeout_s ...)",
    )
    reconnect_after_s: float = Field(
        30.0,
        ge=RECONNECT_AFTER_S_BOUNDS[0],
        le=RECONNECT_AFTER_S_BOUNDS[1],
        description="seconds a failed connect is not tried again",
    )

    def deployment_config(self, where: str) -> DeploymentConfig:
        """The client's settings: the file's, then the overrides (each refused naming ``where``).

        Args:
            where: what gave the options, named in a refusal.

        Returns:
            The validated :class:`DeploymentConfig`.

        Raises:
            ConfigError: the file or an override refused.
        """
        return DeploymentConfig.load(self.config_file).replace(self.overrides, source=f"{where}.overrides")

    def episode_options(self) -> dict[str, Any]:
        """The episode options alone, as :class:`~lifemem_ray.episodes.episode_memory.EpisodeMemory` takes them."""
        return {name: getattr(self, name) for name in EPISODE_OPTIONS}


EPISODE_OPTIONS = frozenset(EpisodeOptions.model_fields)  # recall and write
CONNECTION_OPTIONS = (
    frozenset(MemoryAdapterOptions.model_fields) - EPISODE_OPTIONS
)  # where and how the memory is reached
