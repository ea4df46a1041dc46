"""The Ray layer (installed as ``lifemem_ray.actors``): the sharded memory, its clients, its
front door and the rollout workers. Its public face::

    from lifemem_ray.actors import MemoryClient, AsyncMemoryClient, RetrieveOptions, DeploymentConfig, deploy, stop

Each name is imported on first use, so this package imports Ray only when one is asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lifemem_ray.actors.client.awaiting import AsyncMemoryClient
    from lifemem_ray.actors.client.blocking import MemoryClient
    from lifemem_ray.actors.client.futures import AddFuture, AsyncAddFuture
    from lifemem_ray.actors.client.retrieve_options import RetrieveOptions
    from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
    from lifemem_ray.actors.cluster.deployment import deploy, snapshot, stop
    from lifemem_ray.actors.cluster.restore import restore

__all__ = [
    "AddFuture",
    "AsyncAddFuture",
    "AsyncMemoryClient",
    "DeploymentConfig",
    "MemoryClient",
    "RetrieveOptions",
    "deploy",
    "restore",
    "snapshot",
    "stop",
]


def __getattr__(name: str) -> Any:
    """The public names, imported when first asked for (PEP 562)."""
    found: Any
    if name == "MemoryClient":
        from lifemem_ray.actors.client.blocking import MemoryClient as found
    elif name == "AsyncMemoryClient":
        from lifemem_ray.actors.client.awaiting import AsyncMemoryClient as found
    elif name in ("AddFuture", "AsyncAddFuture"):
        from lifemem_ray.actors.client import futures

        found = getattr(futures, name)
    elif name == "RetrieveOptions":
        from lifemem_ray.actors.client.retrieve_options import RetrieveOptions as found
    elif name == "DeploymentConfig":
        from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig as found
    elif name in ("deploy", "snapshot", "stop"):
        from lifemem_ray.actors.cluster import deployment

        found = getattr(deployment, name)
    elif name == "restore":
        from lifemem_ray.actors.cluster.restore import restore as found
    else:
        raise AttributeError(f"module 'lifemem_ray.actors' has no attribute {name!r}")
    globals()[name] = found
    return found
