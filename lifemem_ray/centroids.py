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
from typing import Iterable

import numpy as np

from .clusters import ClusterRecord

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
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._rows)

    def update(self, records: Iterable[ClusterRecord]) -> None:
        """Insert or refresh these clusters' centroids; clusters no longer live are dropped."""
        with self._lock:
            add_ids, add_rows = [], []
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
                else:
                    self._matrix[at] = row
            if add_ids:
                start = len(self._ids)
                self._ids = np.concatenate([self._ids, np.asarray(add_ids, dtype=np.int64)])
                self._matrix = np.vstack([self._matrix, np.stack(add_rows)])
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
        self._rows = {int(c): i for i, c in enumerate(self._ids)}

    def query(self, vectors: np.ndarray, workflow_vectors: np.ndarray) -> np.ndarray:
        return np.hstack([self._a * workflow_vectors, self._b * vectors]).astype(np.float32)

    def search(self, queries: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``m`` best-scoring clusters per query (see :meth:`query`), best first, as
        (ids, scores) arrays of shape (n, min(m, clusters))."""
        with self._lock:
            n = len(self._ids)
            if n == 0 or m <= 0:
                return np.zeros((len(queries), 0), np.int64), np.zeros((len(queries), 0), np.float32)
            scores = queries @ self._matrix.T
            m = min(m, n)
            top = np.argpartition(-scores, m - 1, axis=1)[:, :m]
            top_s = np.take_along_axis(scores, top, 1)
            order = np.argsort(-top_s, axis=1)
            top, top_s = np.take_along_axis(top, order, 1), np.take_along_axis(top_s, order, 1)
            return self._ids[top], top_s.astype(np.float32, copy=False)


def _unit(vec: np.ndarray) -> np.ndarray:
    norm = float(np.linalg.norm(vec))
    return vec / norm if norm > 0 else vec
