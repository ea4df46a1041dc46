"""The offline policy: LifeMem's decisions without a language model.

* join or new: a candidate cluster's score mixes the structural similarity of
  action workflows (cosine of workflow vectors, see :mod:`lifemem_ray.engine.clustering.workflow` and
  :mod:`lifemem_ray.engine.clustering.steps`) with the text similarity of goals; the best candidate is
  joined when its score reaches ``policy.join_threshold``, else a new cluster opens.
* split (the paper's rule decides *whether*: n > L and R < tau; this decides *how*):
  spherical k-means over the members' workflow vectors into the number of parts (2 to
  ``evolution.split_max_parts``) with the best mean silhouette; when even that is below
  ``evolution.split_min_silhouette`` the members show no substantial structure and the
  split is refused (the caller counts it). ``evolution.split_cut = "size"`` instead takes
  the smallest number of parts whose children are homogeneous (R >= tau) or no larger
  than L, else the most homogeneous; only members that are all one vector refuse it.
* skills: the ordered procedure the successful members follow (:mod:`lifemem_ray.engine.clustering.skills`);
  descriptions: that procedure's first steps, where the cluster occurs, an example goal.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from lifemem_ray.core.model import Trajectory
from lifemem_ray.engine.clustering.skills import distil_procedure
from lifemem_ray.engine.memory_config import PolicyConfig

if TYPE_CHECKING:
    from lifemem_ray.engine.clustering.clusters import ClusterRecord

__all__ = ["OfflinePolicy", "mean_silhouette", "skill_step_texts", "spherical_kmeans"]

MAX_DESCRIBED_STEPS = 5


def _unit(vec: np.ndarray) -> np.ndarray:
    norm = float(np.linalg.norm(vec))
    return vec / norm if norm > 0 else vec


def spherical_kmeans(x: np.ndarray, k: int, *, seed: int = 0, iterations: int = 30) -> np.ndarray:
    """Labels (n,) of k-means on the unit sphere (cosine), k-means++ seeded, deterministic."""
    n = x.shape[0]
    if k >= n:
        return np.arange(n)
    rng = np.random.default_rng(seed)
    x = x.astype(np.float64)
    centres = np.empty((k, x.shape[1]))
    centres[0] = x[rng.integers(n)]
    closest = 1.0 - x @ centres[0]
    for j in range(1, k):
        weights = np.clip(closest, 0, None) ** 2
        total = weights.sum()
        pick = rng.choice(n, p=weights / total) if total > 0 else rng.integers(n)
        centres[j] = x[pick]
        closest = np.minimum(closest, 1.0 - x @ centres[j])
    labels = np.full(n, -1)
    for _ in range(iterations):
        new = np.argmax(x @ centres.T, axis=1)
        if np.array_equal(new, labels):
            break
        labels = new
        for j in range(k):
            mask = labels == j
            if mask.any():
                centres[j] = _unit(x[mask].sum(axis=0))
    return labels


SILHOUETTE_SAMPLE = 1000  # members a split's silhouette is measured on (O(m^2) work)


def mean_silhouette(x: np.ndarray, labels: np.ndarray, *, sample: int = SILHOUETTE_SAMPLE, seed: int = 0) -> float:
    """Mean silhouette (Rousseeuw 1987) of a partition of unit rows under cosine distance,
    over at most ``sample`` rows (drawn at random, the same rows for every partition of
    one ``seed``); a member alone in its part scores 0.

    >>> x = np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    >>> round(mean_silhouette(x, np.array([0, 0, 1, 1])), 3)
    1.0
    """
    n = x.shape[0]
    rows = np.arange(n) if n <= sample else np.sort(np.random.default_rng(seed).choice(n, sample, replace=False))
    xs = x[rows].astype(np.float64)
    _, lab = np.unique(labels[rows], return_inverse=True)
    k = int(lab.max()) + 1 if len(lab) else 0
    if k < 2:
        return 0.0
    dist = np.clip(1.0 - xs @ xs.T, 0.0, 2.0)
    onehot = np.zeros((len(rows), k))
    onehot[np.arange(len(rows)), lab] = 1.0
    sums = dist @ onehot  # (m, k): summed distance of each row to each part
    sizes = onehot.sum(axis=0)
    own_size = sizes[lab]
    a = np.where(own_size > 1, sums[np.arange(len(rows)), lab] / np.maximum(own_size - 1, 1), 0.0)
    means = sums / sizes
    means[np.arange(len(rows)), lab] = np.inf
    b = means.min(axis=1)
    denom = np.maximum(np.maximum(a, b), 1e-12)
    s = np.where(own_size > 1, (b - a) / denom, 0.0)
    return float(s.mean())


class OfflinePolicy:
    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config or PolicyConfig()

    # -- join or new -----------------------------------------------------------------------
    def score(self, text_similarity: float, workflow_similarity: float) -> float:
        w = self.config.workflow_weight
        return min(1.0, max(0.0, w * workflow_similarity + (1.0 - w) * text_similarity))

    def threshold(
        self, count: int, text_norm: float, workflow_norm: float, env: tuple[int, float, float] | None = None
    ) -> float:
        """The score a trajectory needs to join a cluster of ``count`` members whose running sums
        have these norms. ``policy.density_ratio`` = 0: ``policy.join_threshold`` for every
        cluster. Else the threshold adapts to the cluster's density: ``density_ratio`` times its
        mean resultant length R over the combined vectors (the mean cosine of its members to
        its centroid), never below ``join_threshold``; a tight cluster asks for a close match,
        a diffuse one accepts what resembles its members as much as they resemble each other.
        A single member says nothing of density: a singleton asks for ``join_threshold``.

        ``env`` (count, text sum norm, workflow sum norm of the cluster's environment):
        with ``policy.env_contrast`` = c > 0, the trajectory must also resemble the
        cluster's members more than the environment's trajectories resemble each other: its
        score times the cluster's R over the combined vectors (its mean cosine to the
        members when the two views' sums are equally concentrated, an estimate otherwise)
        must reach rho_env + c (1 - rho_env), rho_env the environment's mean pairwise cosine
        over the combined vectors. A cluster
        that has grown as diffuse as its whole environment (every ALFWorld task goes to,
        takes and puts) then stops taking everything that arrives."""
        base = self.config.join_threshold
        w = self.config.workflow_weight
        r = _mean_resultant(count, text_norm, workflow_norm, w) if count >= 1 else 1.0
        contrast = self.config.env_contrast
        if contrast > 0 and env is not None and env[0] >= 2:
            rho_env = max(0.0, _pairwise_from_norms(env[0], env[1], env[2], w))
            base = max(base, min(1.0, (rho_env + contrast * (1.0 - rho_env)) / max(r, 1e-6)))
        ratio = self.config.density_ratio
        if ratio <= 0 or count < 2:  # one member says nothing of a cluster's density
            return base
        return max(base, ratio * r)

    def decide(self, scores: Sequence[float], thresholds: Sequence[float] | None = None) -> tuple[int | None, float]:
        """Index of the candidate to join (or None for new) and the decision's margin.

        ``scores`` are best first; the best candidate whose score reaches its threshold
        (``thresholds[i]``, else ``policy.join_threshold``) is joined. The margin is the
        distance of the best score from its threshold: small margins are the ambiguous cases
        worth an LLM call.
        """
        if not scores:
            return None, 1.0
        limits = thresholds if thresholds is not None else [self.config.join_threshold] * len(scores)
        margin = abs(scores[0] - limits[0])
        for j, (score, limit) in enumerate(zip(scores, limits, strict=True)):
            if score >= limit:
                return j, margin
        return None, margin

    # -- merge -----------------------------------------------------------------------------
    def should_merge(self, a: ClusterRecord, b: ClusterRecord, *, ratio: float, tau: float, max_size: int) -> bool:
        """Whether two clusters have converged on one workflow: their members resemble each
        other across the two (mean cross cosine over the combined vectors) at least ``ratio``
        times as much as within the tighter one, and the merged cluster would not meet the split
        rule (n > L with R < tau) at once."""
        if ratio <= 0 or a.count <= 0 or b.count <= 0:
            return False
        w = self.config.workflow_weight
        n = a.count + b.count
        if n > max_size and float(np.linalg.norm(a.wsum + b.wsum)) / n < tau:
            return False
        cross = (w * float(a.wsum @ b.wsum) + (1.0 - w) * float(a.tsum @ b.tsum)) / (a.count * b.count)
        within = [_mean_pairwise(r, w) for r in (a, b) if r.count >= 2]
        reference = min(within) if within else self.threshold(1, 1.0, 1.0)
        return cross >= ratio * reference

    # -- split -----------------------------------------------------------------------------
    def split(
        self,
        vectors: np.ndarray,
        *,
        tau: float,
        min_size: int,
        max_parts: int,
        seed: int,
        cut: str = "silhouette",
        min_silhouette: float = 0.25,
    ) -> np.ndarray | None:
        """Labels 0..p-1 of a finer partition of the members' vectors, or None when they are
        all one vector, or (``cut = "silhouette"``) when no number of parts reaches a mean
        silhouette of ``min_silhouette``: nothing to split on."""
        n = vectors.shape[0]
        if n < 2 or not (vectors != vectors[0]).any():
            return None
        if cut == "silhouette":
            return self._split_by_silhouette(vectors, max_parts=max_parts, seed=seed, min_silhouette=min_silhouette)
        best: tuple[float, np.ndarray] | None = None
        for k in range(2, min(max_parts, n) + 1):
            labels = spherical_kmeans(vectors, k, seed=seed)
            parts = [vectors[labels == j] for j in np.unique(labels)]
            if len(parts) < 2:
                continue
            mrls = [float(np.linalg.norm(p.mean(axis=0))) for p in parts]
            if all(r >= tau or len(p) <= min_size for r, p in zip(mrls, parts, strict=True)):
                return _relabel(labels)
            weighted = sum(r * len(p) for r, p in zip(mrls, parts, strict=True)) / n
            if best is None or weighted > best[0] + 1e-9:
                best = (weighted, labels)
        return None if best is None else _relabel(best[1])

    @staticmethod
    def _split_by_silhouette(
        vectors: np.ndarray, *, max_parts: int, seed: int, min_silhouette: float
    ) -> np.ndarray | None:
        """The k-means partition (2..max_parts parts) with the best mean silhouette, if it
        reaches ``min_silhouette``."""
        x = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        best: tuple[float, np.ndarray] | None = None
        for k in range(2, min(max_parts, x.shape[0]) + 1):
            labels = spherical_kmeans(x, k, seed=seed)
            if len(np.unique(labels)) < 2:
                continue
            score = mean_silhouette(x, labels, seed=seed)
            if best is None or score > best[0] + 1e-9:
                best = (score, labels)
        if best is None or best[0] < min_silhouette:
            return None
        return _relabel(best[1])

    # -- descriptions and skills -----------------------------------------------------------
    def describe(
        self, count: int, envs: dict[str, int], flows: dict[str, int], example_task: str, skill: str = ""
    ) -> str:
        """One line: the cluster's procedure (the first steps of its offline skill, else its most
        common action sequence), where it occurs, and an example goal."""
        steps = skill_step_texts(skill)
        if steps:
            flow = " -> ".join(steps[:MAX_DESCRIBED_STEPS]) + (" -> ..." if len(steps) > MAX_DESCRIBED_STEPS else "")
            lead = "Workflow"
        else:
            known = {f: n for f, n in flows.items() if f != "(other)"}
            flow = max(known.items(), key=lambda kv: kv[1])[0] if known else "varied steps"
            lead = "Workflow" if count and known.get(flow, 0) / count >= 0.5 else "Mostly"
        env_text = ", ".join(f"{e} ({n})" for e, n in sorted(envs.items(), key=lambda kv: -kv[1])[:3])
        example = " ".join(example_task.split())[:120]
        return f"{lead}: {flow} [{count} trajectories; {env_text}]. Example goal: {example}"

    def distil(self, members: Sequence[Trajectory]) -> str:
        """The skill of a cluster from a sample of its members: its ordered procedure with the
        usual length, the steps successful runs end with and the usual failure."""
        return distil_procedure(members)


def skill_step_texts(skill: str) -> list[str]:
    """The numbered step lines of a skill (``1. pick up thermometer`` -> ``pick up thermometer``)."""
    out = []
    for line in skill.splitlines():
        head, dot, rest = line.strip().partition(". ")
        if dot and head.isdigit() and rest.strip():
            out.append(rest.strip())
    return out


def _mean_resultant(count: int, text_norm: float, workflow_norm: float, w: float) -> float:
    """R over the combined vectors of ``count`` members from their sums' norms (at most 1)."""
    return min(1.0, math.sqrt(w * workflow_norm * workflow_norm + (1.0 - w) * text_norm * text_norm) / count)


def _mean_pairwise(record: ClusterRecord, w: float) -> float:
    """Mean cosine between two distinct members, over the combined vectors, from the sums alone."""
    return _pairwise_from_norms(
        record.count, math.sqrt(float(record.tsum @ record.tsum)), math.sqrt(float(record.wsum @ record.wsum)), w
    )


def _pairwise_from_norms(count: int, text_norm: float, workflow_norm: float, w: float) -> float:
    """Mean cosine between two distinct of ``count`` (>= 2) members, over the combined vectors
    (each of norm 1), from their sums' norms: (|sum|^2 - n) / (n (n - 1))."""
    squared = w * workflow_norm * workflow_norm + (1.0 - w) * text_norm * text_norm
    return (squared - count) / (count * (count - 1))


def _relabel(labels: np.ndarray) -> np.ndarray:
    _, dense = np.unique(labels, return_inverse=True)
    return dense
