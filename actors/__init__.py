"""The Ray layer (installed as ``lifemem_ray.actors``): the sharded memory, its clients, its
front door and the rollout workers. Its public face::

    from lifemem_ray.actors import MemoryClient, AsyncMemoryClient, DeploymentConfig, deploy, stop

Each name is imported on first use, so this package imports Ray only when one is asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lifemem_ray.actors.cluster.async_client import AsyncMemoryClient
    from lifemem_ray.actors.cluster.client import MemoryClient
    from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
    from lifemem_ray.actors.cluster.deployment import deploy, snapshot, stop
    from lifemem_ray.actors.cluster.restore import restore

__all__ = ["AsyncMemoryClient", "DeploymentConfig", "MemoryClient", "deploy", "restore", "snapshot", "stop"]


def __getattr__(name: str) -> Any:
    """The public names, imported when first asked for (PEP 562)."""
    found: Any
    if name == "MemoryClient":
        from lifemem_ray.actors.cluster.client import MemoryClient as found
    elif name == "AsyncMemoryClient":
        from lifemem_ray.actors.cluster.async_client import AsyncMemoryClient as found
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
