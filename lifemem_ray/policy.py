"""The offline policy: LifeMem's decisions without a language model.

* join or new: a candidate cluster's score mixes the structural similarity of
  action workflows (cosine of workflow vectors, see :mod:`lifemem_ray.workflow`)
  with the text similarity of goals; the best candidate is joined when its score
  reaches ``policy.join_threshold``, else a new cluster opens.
* split: spherical k-means over the members' workflow vectors, choosing the
  smallest number of parts whose children are homogeneous (R >= tau) or small.
* descriptions and skills: read off the members, i.e. the recurring action
  pattern in its usual order, what successful runs end with, what failed runs
  do more often. Skills use the environment-invariant canonical action
  categories, never environment-specific names.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .config import PolicyConfig
from .workflow import canonical_token, workflow_summary

__all__ = ["MemberInfo", "OfflinePolicy", "spherical_kmeans"]

# What each canonical action category asks of an agent, phrased without any
# environment's vocabulary, so a skill transfers across environments.
_CATEGORY_ADVICE: dict[str, str] = {
    "SEARCH": "search for candidates using the goal's key terms and constraints",
    "INSPECT": "inspect the most promising candidate in detail before relying on it",
    "NAVIGATE": "move to the place or page where the needed object or information is",
    "INPUT": "enter the required values exactly as the goal states them",
    "SELECT": "choose the option or element that satisfies the constraints",
    "QUERY": "query the data source for exactly the fields the goal asks for",
    "MODIFY": "make the requested change only after confirming the target and its current state",
    "COMPUTE": "compute derived values explicitly rather than estimating them",
    "ANSWER": "give the final answer in the required format once the evidence supports it",
    "COMMIT": "commit the final action only after every constraint has been checked",
    "THINK": "reason about what is still missing before acting",
    "MANIPULATE": "pick up, place or use objects in the order the goal implies",
    "OTHER": "take the environment-specific step the workflow requires",
}


def _unit(vec: np.ndarray) -> np.ndarray:
    norm = float(np.linalg.norm(vec))
    return vec / norm if norm > 0 else vec


@dataclass(frozen=True, slots=True)
class MemberInfo:
    """What distillation needs of one member: its abstract actions and outcome."""

    tokens: tuple[str, ...]
    success: bool | None
    env: str
    task: str


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


class OfflinePolicy:
    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config or PolicyConfig()

    # -- join or new -----------------------------------------------------------------------
    def score(self, text_similarity: float, workflow_similarity: float) -> float:
        w = self.config.workflow_weight
        return min(1.0, max(0.0, w * workflow_similarity + (1.0 - w) * text_similarity))

    def decide(self, scores: Sequence[float]) -> tuple[int | None, float]:
        """Index of the candidate to join (or None for new) and the decision's margin.

        The margin is the distance of the best score from the threshold: small
        margins are the ambiguous cases worth an LLM call.
        """
        if not scores:
            return None, 1.0
        best = max(range(len(scores)), key=scores.__getitem__)  # the first of equal scores, like argmax
        margin = abs(scores[best] - self.config.join_threshold)
        return (best if scores[best] >= self.config.join_threshold else None), margin

    # -- split -----------------------------------------------------------------------------
    def split(self, workflow_vectors: np.ndarray, *, tau: float, min_size: int, max_parts: int, seed: int) -> np.ndarray | None:
        """Labels for a finer partition, or None when the members show no structure to split on."""
        n = workflow_vectors.shape[0]
        if n < 2:
            return None
        best: tuple[float, np.ndarray] | None = None
        for k in range(2, min(max_parts, n) + 1):
            labels = spherical_kmeans(workflow_vectors, k, seed=seed)
            parts = [workflow_vectors[labels == j] for j in np.unique(labels)]
            if len(parts) < 2:
                continue
            mrls = [float(np.linalg.norm(p.mean(axis=0))) for p in parts]
            if all(r >= tau or len(p) <= min_size for r, p in zip(mrls, parts)):
                return _relabel(labels)
            weighted = sum(r * len(p) for r, p in zip(mrls, parts)) / n
            if best is None or weighted > best[0] + 1e-9:
                best = (weighted, labels)
        if best is None:
            return None
        # Only split when it makes the parts clearly more homogeneous than the whole.
        whole = float(np.linalg.norm(workflow_vectors.mean(axis=0)))
        if best[0] - whole < 0.02:
            return None
        return _relabel(best[1])

    # -- descriptions and skills -----------------------------------------------------------
    def describe(self, count: int, envs: dict[str, int], flows: dict[str, int], example_task: str) -> str:
        """One line: the dominant workflow, where it occurs, and an example goal."""
        flow = max(flows.items(), key=lambda kv: kv[1])[0] if flows else "unknown steps"
        share = (flows.get(flow, 0) / count) if count else 0.0
        env_text = ", ".join(f"{e} ({n})" for e, n in sorted(envs.items(), key=lambda kv: -kv[1])[:3])
        example = " ".join(example_task.split())[:120]
        lead = "Workflow" if share >= 0.5 else "Mostly"
        return f"{lead}: {flow} [{count} trajectories; {env_text}]. Example goal: {example}"

    def distil(self, members: Sequence[MemberInfo]) -> str:
        """An environment-invariant skill: the usual order of action categories, and what
        distinguishes runs that succeeded from runs that failed."""
        if not members:
            return ""
        seqs = [_collapse([canonical_token(t) for t in m.tokens]) for m in members]
        successes = [s for s, m in zip(seqs, members) if m.success is True]
        failures = [s for s, m in zip(seqs, members) if m.success is False]
        basis = successes or seqs
        order = _usual_order(basis)
        lengths = sorted(len(m.tokens) for m in members)
        lines = []
        for i, category in enumerate(order, 1):
            lines.append(f"{i}. {_CATEGORY_ADVICE.get(category, _CATEGORY_ADVICE['OTHER']).capitalize()}.")
        if not lines:
            lines.append("1. " + _CATEGORY_ADVICE["OTHER"].capitalize() + ".")
        notes = []
        median = lengths[len(lengths) // 2]
        notes.append(f"Runs of this workflow usually take about {median} actions ({lengths[0]}-{lengths[-1]}).")
        if successes:
            endings = Counter(s[-1] for s in successes if s)
            if endings:
                ending, n = endings.most_common(1)[0]
                if n / len(successes) >= 0.5:
                    notes.append(f"Successful runs end by a {ending.lower()} step: " + _CATEGORY_ADVICE.get(ending, _CATEGORY_ADVICE["OTHER"]) + ".")
        if successes and failures:
            ok = _category_rates(successes)
            ko = _category_rates(failures)
            worse = sorted(((ko[c] - ok.get(c, 0.0), c) for c in ko), reverse=True)
            if worse and worse[0][0] > 0.2:
                notes.append(f"Failed runs repeat {worse[0][1].lower()} steps more often: change approach instead of repeating.")
            loops = sum(_has_loop(s) for s in failures) / len(failures)
            if loops > 0.3:
                notes.append("Avoid repeating the same action when it produced no progress.")
        return "\n".join(lines + notes)

    @staticmethod
    def flow_key(tokens: Sequence[str]) -> str:
        return workflow_summary(list(tokens))[:200]


def _relabel(labels: np.ndarray) -> np.ndarray:
    _, dense = np.unique(labels, return_inverse=True)
    return dense


def _collapse(seq: list[str]) -> list[str]:
    out: list[str] = []
    for token in seq:
        if not out or out[-1] != token:
            out.append(token)
    return out


def _usual_order(seqs: list[list[str]], min_share: float = 0.5, max_len: int = 8) -> list[str]:
    """Categories present in at least half the runs, ordered by where they first appear."""
    if not seqs:
        return []
    first_pos: dict[str, list[float]] = {}
    for seq in seqs:
        seen: set[str] = set()
        for i, token in enumerate(seq):
            if token not in seen:
                seen.add(token)
                first_pos.setdefault(token, []).append(i / max(len(seq) - 1, 1))
    common = [(np.mean(p), c) for c, p in first_pos.items() if len(p) / len(seqs) >= min_share]
    if not common:
        common = [(np.mean(p), c) for c, p in sorted(first_pos.items(), key=lambda kv: -len(kv[1]))[:3]]
    return [c for _, c in sorted(common)][:max_len]


def _category_rates(seqs: list[list[str]]) -> dict[str, float]:
    counts: Counter[str] = Counter()
    total = 0
    for seq in seqs:
        counts.update(seq)
        total += len(seq)
    return {c: n / total for c, n in counts.items()} if total else {}


def _has_loop(seq: list[str]) -> bool:
    pairs = list(zip(seq, seq[1:]))
    return len(pairs) >= 4 and Counter(pairs).most_common(1)[0][1] >= 3
