"""How good a partition is against ground-truth labels, and the equal-k baselines it is held against.

Small functions, numpy arrays in and out (after FAISS ``contrib``): the cluster-quality
benchmark composes them; tests check them on partitions whose figures are known by hand.

* :func:`purity`: the share of items whose cluster's majority label is their own
  (LifeMem's appendix I, with labels instead of annotators);
* :func:`partition_scores`: purity, NMI and ARI (scikit-learn's implementations);
* :func:`equal_k_baseline`: spherical k-means with a given number of clusters over any
  representation, the baseline that isolates what the representation and the online
  procedure buy at the same granularity;
* :func:`sequence_distance`: normalised edit distance between two sequences, used to ask how
  well a skill's ordered steps predict a trajectory's action categories.

Example:

>>> import numpy as np
>>> round(purity(np.array([0, 0, 1, 1]), np.array(["a", "a", "a", "b"])), 2)
0.75
>>> sequence_distance(["SEARCH", "SELECT", "COMMIT"], ["SEARCH", "COMMIT"])
0.3333333333333333
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from .policy import spherical_kmeans

__all__ = ["equal_k_baseline", "partition_scores", "pure_partition_nmi", "purity", "sequence_distance"]


def purity(clusters: np.ndarray, labels: np.ndarray) -> float:
    """Share of items whose label is the most common label of their cluster (1.0: every cluster pure)."""
    clusters, labels = _check(clusters, labels)
    if len(clusters) == 0:
        return float("nan")
    _, c = np.unique(clusters, return_inverse=True)
    _, y = np.unique(labels, return_inverse=True)
    table = np.zeros((c.max() + 1, y.max() + 1), dtype=np.int64)
    np.add.at(table, (c, y), 1)
    return float(table.max(axis=1).sum() / len(clusters))


def partition_scores(clusters: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """Purity, NMI (arithmetic normalisation) and ARI of a partition against labels."""
    from sklearn.metrics import adjusted_rand_score, normalized_mutual_info_score

    clusters, labels = _check(clusters, labels)
    if len(clusters) == 0:
        return {"purity": float("nan"), "nmi": float("nan"), "ari": float("nan")}
    return {
        "purity": purity(clusters, labels),
        "nmi": float(normalized_mutual_info_score(labels, clusters)),
        "ari": float(adjusted_rand_score(labels, clusters)),
    }


def pure_partition_nmi(labels: Sequence[Hashable], k: int) -> dict[str, float]:
    """NMI of two partitions that are perfectly pure and have ``k`` parts (k >= the number of
    labels): the labels with the largest part halved again and again (``even``), and the
    labels with single members split off the largest part (``splinters``). With purity 1 the
    NMI depends only on how the parts' sizes spread (the more uneven, the higher), so these
    are two reference points of what "pure at this k" scores: a difference in NMI between
    them says how a partition cut, not whether it mixed labels.

    >>> r = pure_partition_nmi(["a"] * 8 + ["b"] * 8, 3)
    >>> r["even"] < r["splinters"] < 1.0
    True
    """
    from sklearn.metrics import normalized_mutual_info_score

    truth = np.asarray([str(x) for x in labels])
    if len(truth) == 0:
        raise ValueError("labels: empty")
    names, codes = np.unique(truth, return_inverse=True)
    if k < len(names) or k > len(truth):
        raise ValueError(f"k: must be within [{len(names)}, {len(truth)}] (the labels, the members), got {k}")
    out = {}
    for how in ("even", "splinters"):
        parts = [list(np.flatnonzero(codes == c)) for c in range(len(names))]
        while len(parts) < k:
            parts.sort(key=len)
            largest = parts.pop()
            cut = len(largest) // 2 if how == "even" else len(largest) - 1
            parts += [largest[:cut], largest[cut:]]
        assigned = np.empty(len(truth), dtype=np.int64)
        for j, members in enumerate(parts):
            assigned[members] = j
        out[how] = float(normalized_mutual_info_score(truth, assigned))
    return out


def equal_k_baseline(vectors: np.ndarray, k: int, seed: int = 0) -> np.ndarray:
    """Spherical k-means labels (n,) with exactly ``min(k, n)`` clusters asked for (rows are
    normalised first; k-means++ seeding, so ``seed`` gives the spread over restarts)."""
    x = np.asarray(vectors, dtype=np.float64)
    if x.ndim != 2 or len(x) == 0:
        raise ValueError(f"vectors: expected a non-empty (n, d) array, got shape {x.shape}")
    if k < 1:
        raise ValueError(f"k: must be at least 1, got {k}")
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    x = x / np.where(norms > 0, norms, 1.0)
    if k == 1:
        return np.zeros(len(x), dtype=np.int64)
    return spherical_kmeans(x, min(k, len(x)), seed=seed, iterations=50)


def sequence_distance(a: Sequence[Hashable], b: Sequence[Hashable]) -> float:
    """Levenshtein distance of two sequences over the longer one's length, in [0, 1]
    (0: equal; both empty: 0)."""
    n, m = len(a), len(b)
    if max(n, m) == 0:
        return 0.0
    previous = list(range(m + 1))
    for i in range(1, n + 1):
        current = [i] + [0] * m
        for j in range(1, m + 1):
            current[j] = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (a[i - 1] != b[j - 1]))
        previous = current
    return previous[m] / max(n, m)


def _check(clusters: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    clusters, labels = np.asarray(clusters), np.asarray(labels)
    if clusters.shape != labels.shape or clusters.ndim != 1:
        raise ValueError(f"clusters and labels: expected two 1-d arrays of one length, got {clusters.shape} and {labels.shape}")
    return clusters, labels
