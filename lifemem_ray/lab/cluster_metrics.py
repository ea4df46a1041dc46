"""How good a partition is against ground-truth labels, and the equal-k baselines it is held against.

Small functions, numpy arrays in and out (after FAISS ``contrib``): the cluster-quality
benchmark composes them; tests check them on partitions whose figures are known by hand.

* :func:`purity`: the share of items whose cluster's majority label is their own
  (LifeMem's appendix I, with labels instead of annotators);
* :func:`partition_scores`: purity, NMI and ARI (scikit-learn's implementations);
* :func:`equal_k_baseline`: spherical k-means with a given number of clusters over any
  representation, the baseline that isolates what the representation and the online
  procedure buy at the same granularity;
* :func:`bootstrap_weights` and :func:`weighted_scores`: purity and NMI under resampled
  item weights (a bootstrap over items), so a difference between two partitions of the same
  items comes with an interval;
* :func:`refine_partition`: spherical k-means iterations started from a given partition
  (what a batch consolidation of an online partition would reach);
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

from lifemem_ray.core.errors import InvalidArgumentError
from lifemem_ray.engine.clustering.policy import spherical_kmeans

__all__ = [
    "bootstrap_weights",
    "equal_k_baseline",
    "partition_scores",
    "pure_partition_nmi",
    "purity",
    "refine_partition",
    "sequence_distance",
    "weighted_scores",
]


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


def bootstrap_weights(n: int, draws: int, seed: int = 0) -> np.ndarray:
    """(draws, n) item counts of ``draws`` bootstrap resamples of n items (each row sums to n):
    resampling as weights, so every partition of the same items is scored on the same draws
    (a paired bootstrap).

    >>> w = bootstrap_weights(5, 3)
    >>> w.shape, w.sum(axis=1).tolist()
    ((3, 5), [5.0, 5.0, 5.0])
    """
    if n < 1 or draws < 1:
        raise InvalidArgumentError(f"n and draws: must be at least 1, got n={n}, draws={draws}")
    return np.random.default_rng(seed).multinomial(n, np.full(n, 1.0 / n), size=draws).astype(np.float64)


def weighted_scores(clusters: np.ndarray, labels: np.ndarray, weights: np.ndarray) -> dict[str, np.ndarray]:
    """Purity and NMI (arithmetic normalisation, as :func:`partition_scores`) of one partition
    under each row of item ``weights`` (draws, n): arrays of length draws. With all weights 1
    they equal :func:`partition_scores`.

    >>> c, y = np.array([0, 0, 1, 1]), np.array(["a", "a", "a", "b"])
    >>> s = weighted_scores(c, y, np.ones((1, 4)))
    >>> round(float(s["purity"][0]), 2), round(float(s["nmi"][0]), 4) == round(partition_scores(c, y)["nmi"], 4)
    (0.75, True)
    """
    clusters, labels = _check(clusters, labels)
    w = np.atleast_2d(np.asarray(weights, dtype=np.float64))
    if w.shape[1] != len(clusters):
        raise InvalidArgumentError(f"expected (draws, {len(clusters)}), got {w.shape}", where="weights")
    _, c = np.unique(clusters, return_inverse=True)
    _, y = np.unique(labels, return_inverse=True)
    kc, ky = int(c.max()) + 1, int(y.max()) + 1
    onehot = np.zeros((len(c), kc * ky))
    onehot[np.arange(len(c)), c * ky + y] = 1.0
    table = (w @ onehot).reshape(len(w), kc, ky)
    total = table.sum(axis=(1, 2))
    purity_ = table.max(axis=2).sum(axis=1) / total
    p = table / total[:, None, None]
    pc, py = p.sum(axis=2), p.sum(axis=1)

    def entropy(q: np.ndarray) -> np.ndarray:
        return -np.where(q > 0, q * np.log(np.where(q > 0, q, 1.0)), 0.0).sum(axis=1)

    outer = pc[:, :, None] * py[:, None, :]
    mi = np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0) / np.where(outer > 0, outer, 1.0)), 0.0).sum(axis=(1, 2))
    hc, hy = entropy(pc), entropy(py)
    mean_h = (hc + hy) / 2
    # scikit-learn's conventions: one cluster and one label agree perfectly; otherwise no
    # entropy means no information.
    nmi = np.where(
        (hc == 0) & (hy == 0), 1.0, np.where(mean_h > 0, np.maximum(mi, 0.0) / np.where(mean_h > 0, mean_h, 1.0), 0.0)
    )
    return {"purity": purity_, "nmi": np.minimum(nmi, 1.0)}


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
        raise InvalidArgumentError("empty", where="labels")
    names, codes = np.unique(truth, return_inverse=True)
    if k < len(names) or k > len(truth):
        raise InvalidArgumentError(
            f"must be within [{len(names)}, {len(truth)}] (the labels, the members), got {k}", where="k"
        )
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
        raise InvalidArgumentError(f"expected a non-empty (n, d) array, got shape {x.shape}", where="vectors")
    if k < 1:
        raise InvalidArgumentError(f"must be at least 1, got {k}", where="k")
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    x = x / np.where(norms > 0, norms, 1.0)
    if k == 1:
        return np.zeros(len(x), dtype=np.int64)
    return spherical_kmeans(x, min(k, len(x)), seed=seed, iterations=50)


def refine_partition(vectors: np.ndarray, labels: np.ndarray, iterations: int = 50) -> np.ndarray:
    """Labels (n,) after spherical k-means (Lloyd) iterations that start from the partition
    ``labels`` instead of a seeding: each item moves to the nearest centroid of the current
    parts until nothing moves. Parts that empty vanish, so there are at most as many parts.

    >>> x = np.array([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]])
    >>> refine_partition(x, np.array([0, 1, 1, 1])).tolist()
    [0, 0, 1, 1]
    """
    x = np.asarray(vectors, dtype=np.float64)
    if x.ndim != 2 or len(x) != len(labels):
        raise InvalidArgumentError(
            f"vectors and labels: expected (n, d) and (n,), got {x.shape} and {np.shape(labels)}"
        )
    x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    _, current = np.unique(np.asarray(labels), return_inverse=True)
    for _ in range(iterations):
        centres = np.zeros((int(current.max()) + 1, x.shape[1]))
        np.add.at(centres, current, x)
        centres /= np.maximum(np.linalg.norm(centres, axis=1, keepdims=True), 1e-12)
        moved = np.argmax(x @ centres.T, axis=1)
        if np.array_equal(moved, current):
            break
        _, current = np.unique(moved, return_inverse=True)
    return current


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
        raise InvalidArgumentError(
            f"clusters and labels: expected two 1-d arrays of one length, got {clusters.shape} and {labels.shape}"
        )
    return clusters, labels
