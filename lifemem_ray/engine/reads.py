"""Reading the memory's records: a trajectory by id, its cluster, the clusters of a tenant and
their members, the sizes. One part of the engine (see :mod:`lifemem_ray.engine.memory`), read by
the façade and the shard protocol alike."""

from __future__ import annotations

from typing import Any

from lifemem_ray.core.model import Trajectory
from lifemem_ray.core.tenancy import DEFAULT_TENANT, check_tenant, id_key, split_scope
from lifemem_ray.engine.clustering.clusters import ClusterInfo, check_listing_limit
from lifemem_ray.engine.state import EngineState

__all__ = ["Reads"]


class Reads:
    """Read-only views of one store (each in one read transaction, or under the state's lock)."""

    def __init__(self, state: EngineState) -> None:
        self.s = state

    def get(self, trajectory_id: str, tenant: str = DEFAULT_TENANT) -> Trajectory | None:
        """``tenant``'s trajectory of this id, or None (another tenant's is not seen)."""
        store = self.s.store
        with store.read() as txn:
            vid = store.lookup_id(txn, id_key(check_tenant(tenant, "tenant"), trajectory_id))
            got = None if vid is None else store.trajectory(txn, vid)
        return None if got is None else got[0]

    def cluster_of(self, trajectory_id: str, tenant: str = DEFAULT_TENANT) -> int | None:
        store = self.s.store
        with store.read() as txn:
            vid = store.lookup_id(txn, id_key(check_tenant(tenant, "tenant"), trajectory_id))
            return None if vid is None else store.cluster_of(txn, vid)

    def clusters(
        self, env: str | None = None, tenant: str | None = DEFAULT_TENANT, limit: int | None = None
    ) -> list[ClusterInfo]:
        """``tenant``'s live clusters, largest first; with ``env``, those holding trajectories of
        it (``tenant=None``: every tenant's, for administration); with ``limit``, only that many
        (the largest)."""
        check_listing_limit(limit)
        records = sorted(self._matching(env, tenant), key=lambda r: (-r.count, r.id))
        return [ClusterInfo.of(r) for r in records[:limit]]

    def cluster_count(self, env: str | None = None, tenant: str | None = DEFAULT_TENANT) -> int:
        """How many clusters :meth:`clusters` would list without a limit."""
        return len(self._matching(env, tenant))

    def _matching(self, env: str | None, tenant: str | None) -> list[Any]:
        self.s.refresh()
        with self.s.lock:
            records = list(self.s.clusters.values())
        if tenant is not None:
            check_tenant(tenant, "tenant")
            records = [r for r in records if r.tenant == tenant]
        if env is not None:
            records = [r for r in records if any(split_scope(key)[1] == env for key in r.envs)]
        return records

    def members(self, cluster_id: int, tenant: str = DEFAULT_TENANT) -> list[str]:
        """The ids of a cluster of ``tenant`` ([] for a cluster of another tenant)."""
        check_tenant(tenant, "tenant")
        store = self.s.store
        with store.read() as txn:
            record = store.get_cluster(txn, cluster_id)
            if record is None or record.tenant != tenant:
                return []
            out = []
            for vid in store.members(txn, cluster_id):
                got = store.trajectory(txn, vid)
                if got is not None:
                    out.append(got[0].id)
            return out

    def count(self) -> int:
        """Trajectories stored (every tenant's)."""
        with self.s.store.read() as txn:
            return self.s.store.count_trajectories(txn)

    def sizes(self) -> tuple[int, int]:
        """(trajectories, live clusters): two counters, cheap enough to read after every commit."""
        with self.s.lock:
            clusters = len(self.s.clusters)
        return self.count(), clusters
