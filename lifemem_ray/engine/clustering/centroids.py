"""Cluster centroids scored the way the offline policy scores a join.

Each live cluster is a row ``[sqrt(w) * unit(workflow sum), sqrt(1-w) * unit(goal sum)]``
and a trajectory a query ``[sqrt(w) * workflow vector, sqrt(1-w) * goal vector]``, so
their inner product is exactly the policy's score ``w * workflow cosine + (1-w) * goal
cosine``. Evolution adds the best-scoring clusters over all environments to the
candidates from the top-k neighbours: a workflow is found even when the nearest goals
sit in other clusters, and workflows can align across environments. There are far fewer
clusters than trajectories, so an exact matrix product is cheap.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

import numpy as np

from lifemem_ray.engine.clustering.clusters import ClusterRecord

__all__ = ["ClusterCentroids"]


class ClusterCentroids:
    def __init__(self, dim: int, workflow_dim: int, workflow_weight: float) -> None:
        self.dim = dim + workflow_dim
        self._wdim = workflow_dim
        self._a = float(np.sqrt(workflow_weight))
        self._b = float(np.sqrt(1.0 - workflow_weight))
        self._rows: dict[int, int] = {}
        self._ids = np.empty(0, dtype=np.int64)
        self._matrix = np.empty((0, self.dim), dtype=np.float32)
        # tenant -> small int, for masking rows by tenant (None: a live cluster without members)
        self._tenant_codes: dict[str | None, int] = {}
        self._tenants = np.empty(
            0, dtype=np.int32
        )  # per row: its cluster's tenant code (a cluster never changes tenant)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._rows)

    def update(self, records: Iterable[ClusterRecord]) -> None:
        """Insert or refresh these clusters' centroids; clusters no longer live are dropped."""
        with self._lock:
            add_ids, add_rows, add_tenants = [], [], []
            gone = []
            for record in records:
                if not record.live:
                    gone.append(record.id)
                    continue
                row = np.concatenate([self._a * _unit(record.wsum), self._b * _unit(record.tsum)]).astype(np.float32)
                at = self._rows.get(record.id)
                if at is None:
                    add_ids.append(record.id)
                    add_rows.append(row)
                    add_tenants.append(self._tenant_codes.setdefault(record.tenant, len(self._tenant_codes)))
                else:
                    self._matrix[at] = row
            if add_ids:
                start = len(self._ids)
                self._ids = np.concatenate([self._ids, np.asarray(add_ids, dtype=np.int64)])
                self._matrix = np.vstack([self._matrix, np.stack(add_rows)])
                self._tenants = np.concatenate([self._tenants, np.asarray(add_tenants, dtype=np.int32)])
                for offset, cid in enumerate(add_ids):
                    self._rows[cid] = start + offset
            if gone:
                self._drop(gone)

    def remove(self, cluster_ids: Iterable[int]) -> None:
        with self._lock:
            self._drop(list(cluster_ids))

    def _drop(self, cluster_ids: list[int]) -> None:
        rows = [self._rows.pop(c) for c in cluster_ids if c in self._rows]
        if not rows:
            return
        keep = np.ones(len(self._ids), dtype=bool)
        keep[rows] = False
        self._ids = self._ids[keep]
        self._matrix = self._matrix[keep]
        self._tenants = self._tenants[keep]
        self._rows = {int(c): i for i, c in enumerate(self._ids)}

    def query(self, vectors: np.ndarray, workflow_vectors: np.ndarray) -> np.ndarray:
        return np.hstack([self._a * workflow_vectors, self._b * vectors]).astype(np.float32)

    def search(
        self, queries: np.ndarray, m: int, tenants: Sequence[str | None] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """The ``m`` best-scoring clusters per query (see :meth:`query`), best first, as
        (ids, scores) arrays of shape (n, min(m, clusters)). With ``tenants`` (one per query;
        None: the tenant of a cluster without members) only clusters of the query's tenant compete (so another tenant's never take a place);
        where fewer exist, the rest is id -1 with score -inf."""
        with self._lock:
            n = len(self._ids)
            if n == 0 or m <= 0:
                return np.zeros((len(queries), 0), np.int64), np.zeros((len(queries), 0), np.float32)
            scores = queries @ self._matrix.T
            if tenants is not None and len(self._tenant_codes) > 1:
                wanted = np.asarray([self._tenant_codes.get(t, -1) for t in tenants], dtype=np.int32)
                scores = np.where(self._tenants[None, :] == wanted[:, None], scores, np.float32(-np.inf))
            m = min(m, n)
            top = np.argpartition(-scores, m - 1, axis=1)[:, :m]
            top_s = np.take_along_axis(scores, top, 1)
            order = np.argsort(-top_s, axis=1)
            top, top_s = np.take_along_axis(top, order, 1), np.take_along_axis(top_s, order, 1)
            ids = np.where(np.isfinite(top_s), self._ids[top], -1)
            return ids, top_s.astype(np.float32, copy=False)


def _unit(vec: np.ndarray) -> np.ndarray:
    norm = float(np.linalg.norm(vec))
    return vec / norm if norm > 0 else vec
