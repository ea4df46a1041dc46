"""What both client faces hold and show alike: the operations' core and what its connection
found. :class:`~lifemem_ray.actors.client.blocking.MemoryClient` and
:class:`~lifemem_ray.actors.client.awaiting.AsyncMemoryClient` differ only in how they carry the
core's scripts out."""

from __future__ import annotations

from typing import Any

from lifemem_ray.actors.client.core import ClientCore
from lifemem_ray.actors.client.query_vectors import QueryVectors
from lifemem_ray.actors.client.rules import InDoubtLedger
from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig

__all__ = ["ClientFace"]


class ClientFace:
    """A client of the deployment in ``namespace``; it connects at its first call.

    Args:
        namespace: the deployment's Ray namespace.
        config: the deployment's configuration (its ``cluster`` bounds every call).
        address: the Ray cluster to join when this process has none (never a scan).
        reconnect_after_s: seconds a failed connect is not tried again (0..3600).
    """

    def __init__(
        self,
        namespace: str = "lifemem",
        config: DeploymentConfig | None = None,
        *,
        address: str | None = None,
        reconnect_after_s: float = 0.0,
    ) -> None:
        self.namespace = namespace
        self.config = config or DeploymentConfig()
        self.core = ClientCore(namespace, self.config, address, reconnect_after_s)  # every operation, once

    @property
    def coordinator(self) -> Any:
        """The coordinator's actor handle in use (looked up by name again after it died)."""
        return self.core.connection.coordinator.handle

    @property
    def in_doubt(self) -> InDoubtLedger:
        """Ids of adds whose answer was lost."""
        return self.core.in_doubt

    @property
    def query_vectors(self) -> QueryVectors:
        """Recent retrieval texts' vectors (``cluster.client_vector_cache``)."""
        return self.core.query_vectors

    def close(self) -> None:
        """Drop the handles (the next call connects again); the deployment keeps running (see
        ``lifemem-ray stop``)."""
        self.core.connection.drop()
