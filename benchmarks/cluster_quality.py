"""Workflow clusters and skills on labelled trajectories from real environments, beside equal-k baselines.

Data (``lifemem_ray.lab.datasets``): the installed environments played by their gold agents
(noisy: ``--noise`` of the steps are a random valid action, which gives failures), each
trajectory labelled from its environment's own task metadata. Two folds, generated from
disjoint parts of every environment:

* ``tune``: train folds (ScienceWorld train variations, TextWorldExpress train seeds, ALFWorld
  valid_train + valid_seen, SQL train instances, the train halves of BFCL and tau2). Every
  default and threshold of the offline clustering was chosen looking at this fold only.
* ``report``: test folds (ScienceWorld test variations, TextWorldExpress test seeds, ALFWorld
  valid_unseen, SQL test instances, the other halves of BFCL and tau2). Never tuned on.

Each fold is ingested at two scales (``small``: a stratified sample of about 500; ``full``:
all of it, about 3,000) in two orders (``similarity``: one environment after another, each
in its generator's order, grouped by task kind as the paper's similarity stream;
``random``: shuffled, three seeds), through ``Memory.add_many`` with the offline policy.
Per environment and overall, at every label level: clusters, purity, NMI, ARI; clusters
that mix environments; splits done and refused. Beside them, spherical k-means with the
memory's **own number of clusters per environment** (five seeds) over goal embeddings,
over action-text embeddings, over the workflow vectors, and over the clusterer's own
combined representation (what batch clustering of the same features reaches).

Per environment the verdict says whether LifeMem (the similarity order, and the mean of
the random orders) is above the best of the three named baselines on purity and on NMI;
``mean_gap_to_best`` averages LifeMem's worse order minus that baseline over environments
and both metrics (what variants were compared by on the tune fold). Each environment's gap
comes with a 95% interval from a paired bootstrap over its trajectories, and a verdict:
above, within noise, or below (:func:`gap_intervals`). Four diagnostics stand beside
it: whether batch k-means over a fixed combination of the views (workflow+action,
goal+action, all three, LifeMem's own) beats the best single view at the same k at all;
the NMI two perfectly pure partitions score at LifeMem's k (at equal k NMI rewards uneven
parts); whether the view whose k-means partition has the best silhouette is the view the
labels say is best (whether the representation could be chosen per environment without
labels); and LifeMem's own partitions refined by k-means in that view (what a batch
consolidation step, which the engine does not have, would buy).

Skill quality (report fold): every 10th trajectory per environment is held out (not
ingested); its retrieval's first exemplar names a cluster, whose skill's ordered steps are
compared with the held-out trajectory's action categories (normalised edit distance),
beside the skill of a random other cluster of the same environment.

Ablation (``--ablation``): the same on the report fold with each change of the offline
clustering switched off in turn (config overrides; see ``ABLATION``).

Weight sweep (``--weight-sweep``): every fold and scale again at each workflow weight of
``WEIGHT_GRID`` (the mix of workflow and goal similarity in the join score), and per
environment the weight the labels say is best (the largest mean of its two gaps). Whether
*any* per-environment mix of LifeMem's two views would reach the bar: an optimistic bound,
since the weight is picked with the labels of the fold it is scored on.

Prints JSON on stdout (also written to ``--out``) and a table on stderr. Asserts nothing.

Usage: python benchmarks/cluster_quality.py [--data DIR] [--generate] [--workers 2] [--noise 0.05]
       [--scales small,full] [--ablation] [--weight-sweep] [--set section.key=value ...]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lifemem_ray.core.model import Trajectory
from lifemem_ray.engine.clustering.policy import mean_silhouette, skill_step_texts
from lifemem_ray.engine.clustering.steps import featurize
from lifemem_ray.engine.clustering.workflow import action_tokens, canonical_token, step_tokens
from lifemem_ray.engine.embedding import MiniLMEmbedder
from lifemem_ray.engine.memory import Memory
from lifemem_ray.engine.memory_config import MemoryConfig
from lifemem_ray.lab.cluster_metrics import (
    bootstrap_weights,
    equal_k_baseline,
    partition_scores,
    pure_partition_nmi,
    refine_partition,
    sequence_distance,
    weighted_scores,
)
from lifemem_ray.lab.datasets import LABEL_LEVELS, default_sources, generate, label_of, load_set, save_set

ROOT = Path(__file__).resolve().parents[1]
SMALL_SIZE = 500
SMALL_FLOOR = 30  # every environment keeps at least this many in the small sample (when it has them)
BASELINE_SEEDS = (0, 1, 2, 3, 4)
RANDOM_ORDER_SEEDS = (0, 1, 2)
HOLDOUT_EVERY = 10
BOOTSTRAP_DRAWS = 1000  # resamples behind each gap's 95% interval
# Each entry changes one thing of the default offline clustering (config overrides), so the
# table shows what that piece buys: a feature switched off, a setting as it was before, or
# an option the default leaves off.
CEILING = 0.9995  # a best-baseline score this high is 1.000 as printed: it can be tied, never beaten
WEIGHT_GRID = (0.2, 0.4, 0.6, 0.8, 0.95)  # policy.workflow_weight values of --weight-sweep
ABLATION: dict[str, dict[str, Any]] = {
    "tokens only (no argument roles)": {"evolution.workflow_features": "tokens"},
    "fixed join threshold (no density)": {"policy.density_ratio": 0.0},
    "old threshold (0.55, no density)": {"policy.join_threshold": 0.55, "policy.density_ratio": 0.0},
    "no splits (L = 1,000,000)": {"evolution.split_min_size": 1_000_000},
    "merges on (ratio 0.9)": {"evolution.merge_ratio": 0.9},
    "goal text only (workflow weight 0)": {"policy.workflow_weight": 0.0},
    "workflow only (workflow weight 1)": {"policy.workflow_weight": 1.0},
    "environment contrast on (0.2)": {"policy.env_contrast": 0.2},
    "splits cut by size (children <= L)": {"evolution.split_cut": "size"},
}


# --------------------------------------------------------------------------- data


def load_or_generate(data: Path, fold: str, args: argparse.Namespace) -> list[Trajectory]:
    path = data / f"{fold}.jsonl.gz"
    wanted = {"fold": fold, "agent": "noisy-gold", "noise": args.noise, "scale": args.data_scale}
    if path.exists() and not args.generate:
        trajs, meta = load_set(path)
        if all(meta.get(k) == v for k, v in wanted.items()):
            return trajs
        print(
            f"{path}: generated with { ({k: meta.get(k) for k in wanted}) }, not {wanted}: generating again",
            file=sys.stderr,
        )
    print(f"generating the {fold} fold (workers={args.workers}) ...", file=sys.stderr)
    result = generate(
        default_sources(args.data_scale), fold, workers=args.workers, noise=args.noise, progress=_ticker(fold)
    )
    print(json.dumps(result.summary()), file=sys.stderr)
    save_set(path, result.trajectories, {**wanted, "generation": result.summary()})
    return result.trajectories


def _ticker(what: str):
    seen = [0]

    def tick(n: int) -> None:
        seen[0] += n
        if seen[0] % 250 == 0:
            print(f"  {what}: {seen[0]} episodes", file=sys.stderr, flush=True)

    return tick


def cached_vectors(embedder: MiniLMEmbedder, texts: list[str], cache: Path) -> np.ndarray:
    key = hashlib.sha256("\x00".join(texts).encode()).hexdigest()[:16]
    path = cache / f"vectors-{key}.npy"
    if path.exists():
        return np.load(path)
    vecs = embedder.embed(texts)
    np.save(path, vecs)
    return vecs


def action_text(traj: Trajectory) -> str:
    return " ; ".join(s.action for s in traj.steps)


def positions_by_env(trajs: Sequence[Trajectory]) -> dict[str, list[int]]:
    """Each environment's positions in ``trajs``, in order."""
    by_env: dict[str, list[int]] = defaultdict(list)
    for i, t in enumerate(trajs):
        by_env[t.env].append(i)
    return by_env


def worse_order(similarity: Any, random_orders: Sequence[Any]) -> Any:
    """The verdict's LifeMem figure: the worse of the similarity order's and the random orders'
    mean (scalars, or arrays element-wise); the similarity order alone when there are no others."""
    return np.minimum(similarity, np.mean(random_orders, axis=0)) if len(random_orders) else similarity


def stratified_sample(trajs: list[Trajectory], size: int, seed: int = 0) -> list[int]:
    """Positions of about ``size`` trajectories, each environment in proportion (floor SMALL_FLOOR),
    keeping the set's order."""
    by_env = positions_by_env(trajs)
    rng = random.Random(seed)
    keep: list[int] = []
    for idx in by_env.values():
        want = min(len(idx), max(SMALL_FLOOR, round(size * len(idx) / len(trajs))))
        keep.extend(rng.sample(idx, want))
    return sorted(keep)


def orders(trajs: list[Trajectory]) -> dict[str, list[int]]:
    """similarity: environment after environment (LABEL_LEVELS order), each in generation order;
    random-<seed>: shuffled."""
    rank = {env: i for i, env in enumerate(LABEL_LEVELS)}
    sim = sorted(range(len(trajs)), key=lambda i: (rank.get(trajs[i].env, len(rank)), i))
    out = {"similarity": sim}
    for seed in RANDOM_ORDER_SEEDS:
        shuffled = list(range(len(trajs)))
        random.Random(seed).shuffle(shuffled)
        out[f"random-{seed}"] = shuffled
    return out


# --------------------------------------------------------------------------- one ingest


def ingest(
    trajs: list[Trajectory],
    vecs: np.ndarray,
    order: list[int],
    config: MemoryConfig,
    tmp: Path,
    held: list[Trajectory] | None = None,
    held_vecs: np.ndarray | None = None,
) -> dict[str, Any]:
    """Store the trajectories in ``order``; the partition (trajectory id -> cluster id), counters,
    and for held-out trajectories the clusters their retrievals name."""
    path = tmp / f"m-{time.monotonic_ns()}"
    t0 = time.perf_counter()
    with Memory.open(path, config) as memory:
        memory.add_many([trajs[i] for i in order], vecs[order])
        seconds = time.perf_counter() - t0
        clusters = memory.clusters()
        cluster_of = {tid: c.id for c in clusters for tid in memory.members(c.id)}
        skills = {c.id: c.skill for c in clusters}
        stats = memory.stats()
        retrieved: list[int | None] = []
        if held:
            hits = memory.retrieve_many([t.query_text for t in held], [t.env for t in held], 1, vectors=held_vecs)
            retrieved = [h.trajectories[0].cluster_id if h.trajectories else None for h in hits]
    return {
        "cluster_of": cluster_of,
        "skills": skills,
        "stats": stats,
        "seconds": seconds,
        "retrieved": retrieved,
        "envs_of_cluster": {c.id: dict(c.envs) for c in clusters},
    }


# --------------------------------------------------------------------------- scoring


def score_partition(trajs: list[Trajectory], assigned: Sequence[Any]) -> dict[str, Any]:
    """Per environment and level: purity / NMI / ARI, and k (clusters holding the env)."""
    per_env: dict[str, Any] = {}
    by_env: dict[str, list[int]] = defaultdict(list)
    envs_of: dict[str, set[str]] = defaultdict(set)
    for i, t in enumerate(trajs):
        by_env[t.env].append(i)
        envs_of[str(assigned[i])].add(t.env)
    for env, idx in sorted(by_env.items()):
        pred = np.array([str(assigned[i]) for i in idx])
        entry: dict[str, Any] = {
            "n": len(idx),
            "k": len(set(pred)),
            "mixed_clusters": sum(len(envs_of[c]) > 1 for c in set(pred)),
        }
        for level in LABEL_LEVELS.get(env, ()):
            truth = np.array([label_of(trajs[i], level) or "?" for i in idx])
            entry[level] = {**_rounded(partition_scores(pred, truth)), "labels": len(set(truth))}
        per_env[env] = entry
    topic = np.array([f"{t.env}:{label_of(t, LABEL_LEVELS[t.env][-1])}" for t in trajs])
    overall = _rounded(partition_scores(np.array([str(a) for a in assigned]), topic))
    return {"per_env": per_env, "overall_topic": overall}


def _rounded(scores: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 4) for k, v in scores.items()}


def baselines(
    trajs: list[Trajectory], reps: dict[str, np.ndarray], k_of_env: dict[str, int]
) -> tuple[dict[str, Any], dict[str, list[list[str]]]]:
    """Spherical k-means per environment with the memory's k, for each representation and seed:
    the scores (mean, min, max over seeds) and the partitions themselves (per seed)."""
    by_env = positions_by_env(trajs)
    out: dict[str, Any] = {}
    partitions: dict[str, list[list[str]]] = {}
    for name, vectors in reps.items():
        runs, partitions[name] = [], []
        for seed in BASELINE_SEEDS:
            assigned: list[str] = [""] * len(trajs)
            for env, idx in by_env.items():
                labels = equal_k_baseline(vectors[idx], k_of_env[env], seed=seed)
                for i, lab in zip(idx, labels, strict=True):
                    assigned[i] = f"{env}/{lab}"
            runs.append(score_partition(trajs, assigned))
            partitions[name].append(assigned)
        out[name] = summarise_runs(runs)
    return out, partitions


def gap_intervals(
    trajs: list[Trajectory],
    lifemem: list[list[Any]],
    named: dict[str, list[list[str]]],
    draws: int = BOOTSTRAP_DRAWS,
    seed: int = 0,
) -> dict[str, dict[str, Any]]:
    """Per environment at its topic level: the verdict's gap (LifeMem's worse order, the
    similarity order or the mean of the random ones, minus the best named baseline's mean over
    seeds) on purity and NMI, with a 95% interval from a paired bootstrap over the
    environment's trajectories (every partition scored on the same resamples, the best
    baseline picked again on each). ``above``: both intervals above 0; ``below``: either
    interval under 0; else ``within noise``. It shows how far the gap could move with other
    trajectories of the same tasks; not the spread over data generations or configurations."""
    out: dict[str, dict[str, Any]] = {}
    by_env = positions_by_env(trajs)
    for env, idx in sorted(by_env.items()):
        truth = np.array([label_of(trajs[i], LABEL_LEVELS[env][-1]) or "?" for i in idx])
        weights = np.vstack([np.ones(len(idx)), bootstrap_weights(len(idx), draws, seed)])  # row 0: the data as is
        ours_runs = [_env_scores(part, idx, truth, weights) for part in lifemem]
        base_runs = {name: [_env_scores(part, idx, truth, weights) for part in parts] for name, parts in named.items()}
        entry: dict[str, Any] = {}
        for m in ("purity", "nmi"):
            ours = worse_order(ours_runs[0][m], [r[m] for r in ours_runs[1:]])
            best = np.max([np.mean([r[m] for r in runs], axis=0) for runs in base_runs.values()], axis=0)
            gap = ours - best
            low, high = np.percentile(gap[1:], [2.5, 97.5])
            entry[m] = {"gap": round(float(gap[0]), 4), "low": round(float(low), 4), "high": round(float(high), 4)}
        lows, highs = [entry[m]["low"] for m in ("purity", "nmi")], [entry[m]["high"] for m in ("purity", "nmi")]
        entry["verdict"] = "above" if min(lows) > 0 else "below" if min(highs) < 0 else "within noise"
        out[env] = entry
    return out


def _env_scores(part: list[Any], idx: list[int], truth: np.ndarray, weights: np.ndarray) -> dict[str, np.ndarray]:
    """One partition's weighted scores over one environment's positions ``idx``."""
    return weighted_scores(np.array([str(part[i]) for i in idx]), truth, weights)


def summarise_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean, min and max over runs of every figure (per env and level, and overall)."""
    first = runs[0]
    per_env: dict[str, Any] = {}
    for env, entry in first["per_env"].items():
        e: dict[str, Any] = {
            "n": entry["n"],
            "k": _spread([r["per_env"][env]["k"] for r in runs]),
            "mixed_clusters": _spread([r["per_env"][env]["mixed_clusters"] for r in runs]),
        }
        for level in LABEL_LEVELS.get(env, ()):
            e[level] = {m: _spread([r["per_env"][env][level][m] for r in runs]) for m in ("purity", "nmi", "ari")}
            e[level]["labels"] = entry[level]["labels"]
        per_env[env] = e
    overall = {m: _spread([r["overall_topic"][m] for r in runs]) for m in ("purity", "nmi", "ari")}
    return {"per_env": per_env, "overall_topic": overall, "runs": len(runs)}


def _spread(values: list[float]) -> dict[str, float]:
    a = np.asarray(values, dtype=np.float64)
    return {"mean": round(float(a.mean()), 4), "min": round(float(a.min()), 4), "max": round(float(a.max()), 4)}


def skill_steps(skill: str) -> list[str]:
    """The action categories of a skill's numbered steps, read with the trajectories' own tokenizer."""
    return [canonical_token(step_tokens(text)[0]) for text in skill_step_texts(skill)]


def trajectory_categories(traj: Trajectory) -> list[str]:
    cats = [canonical_token(t) for t in action_tokens(traj)]
    return [c for i, c in enumerate(cats) if i == 0 or cats[i - 1] != c]


def skill_quality(held: list[Trajectory], run: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """Edit distance of the retrieved cluster's skill steps to each held-out trajectory, beside a
    random other cluster of the same environment."""
    rng = random.Random(seed)
    clusters_of_env: dict[str, list[int]] = defaultdict(list)
    for cid, envs in run["envs_of_cluster"].items():
        for env in envs:
            clusters_of_env[env].append(cid)
    own: dict[str, list[float]] = defaultdict(list)
    other: dict[str, list[float]] = defaultdict(list)
    for traj, cid in zip(held, run["retrieved"], strict=True):
        if cid is None:
            continue
        truth = trajectory_categories(traj)
        own[traj.env].append(sequence_distance(skill_steps(run["skills"].get(cid, "")), truth))
        rivals = [c for c in clusters_of_env[traj.env] if c != cid]
        if rivals:
            other[traj.env].append(sequence_distance(skill_steps(run["skills"].get(rng.choice(rivals), "")), truth))
    per_env = {
        env: {
            "n": len(own[env]),
            "own_cluster": round(float(np.mean(own[env])), 4),
            "random_other_cluster": round(float(np.mean(other[env])), 4) if other[env] else None,
        }
        for env in sorted(own)
    }
    flat_own = [d for v in own.values() for d in v]
    flat_other = [d for v in other.values() for d in v]
    return {
        "per_env": per_env,
        "overall": {
            "n": len(flat_own),
            "own_cluster": round(float(np.mean(flat_own)), 4) if flat_own else None,
            "random_other_cluster": round(float(np.mean(flat_other)), 4) if flat_other else None,
        },
    }


# --------------------------------------------------------------------------- one fold


def evaluate_fold(
    trajs: list[Trajectory], vecs: np.ndarray, act_vecs: np.ndarray, config: MemoryConfig, tmp: Path, with_skills: bool
) -> dict[str, Any]:
    held_idx = _holdout(trajs) if with_skills else []
    held_set = set(held_idx)
    keep = [i for i in range(len(trajs)) if i not in held_set]
    train, tvecs, avecs = [trajs[i] for i in keep], vecs[keep], act_vecs[keep]
    held, hvecs = [trajs[i] for i in held_idx], vecs[held_idx] if held_idx else None
    wvecs = np.stack([featurize(t, config.evolution.workflow_features)[1] for t in train])
    w = config.policy.workflow_weight
    combined = np.hstack([np.sqrt(w) * wvecs, np.sqrt(1 - w) * tvecs])
    reps = {
        "goal_embedding": tvecs,
        "action_text_embedding": avecs,
        "workflow_vector": wvecs,
        "own_features_batch": combined,
        **view_combinations(tvecs, avecs, wvecs),
    }
    results: dict[str, Any] = {"n": len(train), "held_out": len(held)}
    lifemem_runs, lifemem_parts, skill_runs, counts = [], [], [], []
    for name, order in orders(train).items():
        run = ingest(train, tvecs, order, config, tmp, held, hvecs)
        lifemem_parts.append([run["cluster_of"].get(t.id) for t in train])
        scored = score_partition(train, lifemem_parts[-1])
        lifemem_runs.append(scored)
        counts.append(
            {
                "order": name,
                "clusters": run["stats"]["clusters"],
                "splits": run["stats"]["splits"],
                "splits_refused": run["stats"].get("splits_refused", 0),
                "merges": run["stats"].get("merges", 0),
                "mixed_env_clusters": run["stats"]["mixed_env_clusters"],
                "seconds": round(run["seconds"], 2),
            }
        )
        if held:
            skill_runs.append(skill_quality(held, run))
        if name == "similarity":
            results["similarity"] = scored
    results["random"] = summarise_runs(lifemem_runs[1:])
    results["runs"] = counts
    k_of_env = {env: e["k"] for env, e in lifemem_runs[0]["per_env"].items()}  # similarity order's k
    results["baselines_at_similarity_k"], partitions = baselines(train, reps, k_of_env)
    results["gap_intervals"] = gap_intervals(train, lifemem_parts, {name: partitions[name] for name in NAMED_BASELINES})
    results["view_by_silhouette"] = view_by_silhouette(train, reps, partitions)
    results["refined_in_picked_view"] = refined_in_picked_view(
        train, reps, lifemem_parts, results["view_by_silhouette"]
    )
    results["pure_nmi_at_k"] = pure_nmi_references(train, k_of_env)
    results["distinct_workflows"] = distinct_workflows(train, wvecs, k_of_env)
    if skill_runs:
        results["skills"] = skill_runs
    results["verdicts"] = verdicts(results)
    results["mean_gap_to_best"] = mean_gap(results["verdicts"])
    return results


def weight_sweep(
    trajs: list[Trajectory],
    vecs: np.ndarray,
    act_vecs: np.ndarray,
    config: MemoryConfig,
    tmp: Path,
    with_skills: bool,
    evaluated: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The fold evaluated again at each workflow weight of WEIGHT_GRID: per weight and
    environment, k, the gaps to the best named baseline at that k and whether it is beaten;
    and per environment the weight with the largest mean gap (:func:`label_chosen_weights`).
    ``evaluated``: the fold's evaluation at ``config``'s own weight, used instead of a rerun."""
    per_weight: dict[str, dict[str, Any]] = {}
    for weight in WEIGHT_GRID:
        if evaluated is not None and weight == config.policy.workflow_weight:
            res = evaluated
        else:
            res = evaluate_fold(
                trajs, vecs, act_vecs, config.replace({"policy.workflow_weight": weight}), tmp, with_skills
            )
        per_weight[str(weight)] = {
            env: {
                "k": res["similarity"]["per_env"][env]["k"],
                "beats": v["beats"],
                "bootstrap": v["bootstrap"],
                "gap": {m: round(v["lifemem_worse_order"][m] - v["best_baseline"][m], 4) for m in ("purity", "nmi")},
            }
            for env, v in res["verdicts"].items()
        }
    return {"per_weight": per_weight, "label_chosen": label_chosen_weights(per_weight)}


def label_chosen_weights(per_weight: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per environment, the weight whose mean of the purity and NMI gaps is largest (picked
    with the labels: an optimistic bound for any per-environment choice), and its entry.

    >>> label_chosen_weights({"0.2": {"e": {"gap": {"purity": -0.1, "nmi": 0.0}}},
    ...                       "0.8": {"e": {"gap": {"purity": 0.02, "nmi": 0.01}}}})["e"]["weight"]
    0.8
    """
    envs = sorted({env for entries in per_weight.values() for env in entries})
    out: dict[str, dict[str, Any]] = {}
    for env in envs:
        weight = max(
            (w for w in per_weight if env in per_weight[w]),
            key=lambda w: float(np.mean(list(per_weight[w][env]["gap"].values()))),
        )
        out[env] = {"weight": float(weight), **per_weight[weight][env]}
    return out


def view_by_silhouette(
    trajs: list[Trajectory], reps: dict[str, np.ndarray], partitions: dict[str, list[list[str]]]
) -> dict[str, dict[str, float]]:
    """Per environment, each named view's mean silhouette (cosine, in that view) of its own
    equal-k k-means partitions, over the seeds: the view an unsupervised criterion would pick
    for the environment, set beside the view the labels say is best (whether a per-environment
    choice of representation could be made without labels)."""
    by_env = positions_by_env(trajs)
    out: dict[str, dict[str, float]] = {}
    for env, idx in sorted(by_env.items()):
        out[env] = {}
        for name in NAMED_BASELINES:
            x = reps[name][idx].astype(np.float64)
            x /= np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
            out[env][name] = round(
                float(np.mean([mean_silhouette(x, np.array([part[i] for i in idx])) for part in partitions[name]])), 4
            )
    return out


def refined_in_picked_view(
    trajs: list[Trajectory],
    reps: dict[str, np.ndarray],
    lifemem: list[list[Any]],
    silhouettes: dict[str, dict[str, float]],
) -> dict[str, dict[str, Any]]:
    """Per environment at its topic level: LifeMem's partitions (every order) refined by
    spherical k-means started from them (:func:`lifemem_ray.lab.cluster_metrics.refine_partition`)
    in the view with the best silhouette there, scored by the verdict's rule (the worse of the
    similarity order and the random orders' mean). What a batch consolidation step would buy;
    the engine has none."""
    by_env = positions_by_env(trajs)
    out: dict[str, dict[str, Any]] = {}
    for env, idx in sorted(by_env.items()):
        view = max(silhouettes[env].items(), key=lambda kv: kv[1])[0]
        truth = np.array([label_of(trajs[i], LABEL_LEVELS[env][-1]) or "?" for i in idx])
        refined = [refine_partition(reps[view][idx], np.array([str(part[i]) for i in idx])) for part in lifemem]
        scored = [partition_scores(labels, truth) for labels in refined]
        worse = {m: float(worse_order(scored[0][m], [r[m] for r in scored[1:]])) for m in ("purity", "nmi")}
        out[env] = {
            "view": view,
            **_rounded(worse),
            "k_similarity": int(refined[0].max()) + 1,
        }  # parts can empty: k may fall
    return out


def distinct_workflows(
    trajs: list[Trajectory], wvecs: np.ndarray, k_of_env: dict[str, int]
) -> dict[str, dict[str, Any]]:
    """Per environment: how many distinct workflow vectors its trajectories have, beside
    LifeMem's k, and the cosines between distinct ones (min / mean / max over pairs). Where
    the count is near k, k-means over the workflow vectors is close to one part per distinct
    workflow; where the distinct ones are about equally far apart, which of them any
    clusterer puts together is not told by the workflow view at all."""
    out: dict[str, dict[str, Any]] = {}
    for env, idx in sorted(positions_by_env(trajs).items()):
        unique = np.unique(wvecs[idx].astype(np.float64), axis=0)
        unique /= np.maximum(np.linalg.norm(unique, axis=1, keepdims=True), 1e-12)
        entry: dict[str, Any] = {"distinct": len(unique), "k": k_of_env[env]}
        if 2 <= len(unique) <= 2000:  # the pairs of at most 2,000 rows (4 million cosines)
            cos = (unique @ unique.T)[np.triu_indices(len(unique), 1)]
            entry["cosine_between"] = {
                "min": round(float(cos.min()), 3),
                "mean": round(float(cos.mean()), 3),
                "max": round(float(cos.max()), 3),
            }
        out[env] = entry
    return out


def pure_nmi_references(trajs: list[Trajectory], k_of_env: dict[str, int]) -> dict[str, dict[str, float]]:
    """Per environment, at its topic level: the NMI of two perfectly pure partitions with the
    memory's k (:func:`lifemem_ray.lab.cluster_metrics.pure_partition_nmi`), where k reaches the
    number of labels."""
    out = {}
    for env, k in k_of_env.items():
        truth = [label_of(t, LABEL_LEVELS[env][-1]) or "?" for t in trajs if t.env == env]
        if len(set(truth)) <= k <= len(truth):
            out[env] = _rounded(pure_partition_nmi(truth, k))
    return out


def view_combinations(goal: np.ndarray, action: np.ndarray, workflow: np.ndarray) -> dict[str, np.ndarray]:
    """Batch representations beyond LifeMem's own: whether *any* fixed combination of the three
    views lets k-means beat the best single view at the same k (equal weight per view, each
    unit-normalised)."""

    def joined(*views: np.ndarray) -> np.ndarray:
        x = np.hstack([v / np.linalg.norm(v, axis=1, keepdims=True) for v in views])
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    return {
        "workflow+action": joined(workflow, action),
        "goal+action": joined(goal, action),
        "all_three_views": joined(workflow, goal, action),
    }


def _holdout(trajs: list[Trajectory]) -> list[int]:
    seen: Counter = Counter()
    out = []
    for i, t in enumerate(trajs):
        seen[t.env] += 1
        if seen[t.env] % HOLDOUT_EVERY == 0:
            out.append(i)
    return out


# --------------------------------------------------------------------------- report


BASELINES = ("goal_embedding", "action_text_embedding", "workflow_vector", "own_features_batch")
NAMED_BASELINES = BASELINES[:3]  # the three the issue holds LifeMem against; the fourth is reported beside them
VIEW_COMBINATIONS = (
    "own_features_batch",
    "workflow+action",
    "goal+action",
    "all_three_views",
)  # batch k-means, not LifeMem


def verdicts(res: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per environment at its topic level: whether LifeMem (similarity order, and the mean of the
    random orders) is above the best of the named baselines' means, on purity and on NMI, and
    what the bootstrap says of that gap (:func:`gap_intervals`)."""
    out = {}
    sim, rnd, base = res["similarity"]["per_env"], res["random"]["per_env"], res["baselines_at_similarity_k"]
    for env, e in sim.items():
        level = LABEL_LEVELS[env][-1]
        best = {m: max(base[b]["per_env"][env][level][m]["mean"] for b in NAMED_BASELINES) for m in ("purity", "nmi")}
        ours = {m: float(worse_order(e[level][m], [rnd[env][level][m]["mean"]])) for m in ("purity", "nmi")}
        tie = all(abs(ours[m] - best[m]) < 5e-4 for m in best)
        ceiling = [m for m in best if best[m] >= CEILING]  # no partition scores above 1: at best a tie there
        # Whether batch k-means over some fixed combination of the views gets there at all.
        combos = [
            b
            for b in VIEW_COMBINATIONS
            if b in base and all(base[b]["per_env"][env][level][m]["mean"] > best[m] for m in best)
        ]
        out[env] = {
            "workflows": e[level]["labels"],
            "best_baseline": best,
            "lifemem_worse_order": ours,
            "beats": all(ours[m] > best[m] for m in best),
            "ties": tie,
            "batch_combinations_beating": combos,
            "baseline_at_ceiling": ceiling,
            "beats_or_ties_at_ceiling": all(ours[m] > best[m] or (m in ceiling and ours[m] >= CEILING) for m in best),
            "pure_nmi_at_k": res.get("pure_nmi_at_k", {}).get(env),
            "bootstrap": res.get("gap_intervals", {}).get(env, {}).get("verdict"),
            "refined_beats": all(res["refined_in_picked_view"][env][m] > best[m] for m in best)
            if env in res.get("refined_in_picked_view", {})
            else None,
            "best_view_by_labels": max(NAMED_BASELINES, key=lambda b: base[b]["per_env"][env][level]["nmi"]["mean"]),
            "view_by_silhouette": max(res["view_by_silhouette"][env].items(), key=lambda kv: kv[1])[0]
            if env in res.get("view_by_silhouette", {})
            else None,
        }
    return out


def mean_gap(verdicts_of: dict[str, dict[str, Any]]) -> float:
    """One number to compare variants by: the mean over environments and the two metrics of
    LifeMem's worse order minus the best named baseline (negative: below it)."""
    gaps = [
        v["lifemem_worse_order"][m] - v["best_baseline"][m] for v in verdicts_of.values() for m in ("purity", "nmi")
    ]
    return round(float(np.mean(gaps)), 4) if gaps else float("nan")


def table(report: dict[str, Any]) -> str:
    lines = []
    for fold, scales in report["folds"].items():
        for scale, res in scales.items():
            lines.append(
                f"\n{fold} fold, {scale} ({res['n']} stored): topic-level purity / NMI at the memory's k "
                "(k-means: mean of 5 seeds; LifeMem random: mean of 3 orders)"
            )
            lines.append(
                f"{'env':<14}{'k':>5} {'LifeMem sim':>12} {'LifeMem rand':>13} {'goal km':>11} {'action km':>11} "
                f"{'workflow km':>12} {'own-feat km':>12}  beats best named; gap purity / NMI [95% bootstrap]"
            )
            sim, rnd, base = res["similarity"]["per_env"], res["random"]["per_env"], res["baselines_at_similarity_k"]
            for env, e in sim.items():
                level = LABEL_LEVELS[env][-1]
                cells = [
                    f"{e[level]['purity']:.2f}/{e[level]['nmi']:.2f}",
                    f"{rnd[env][level]['purity']['mean']:.2f}/{rnd[env][level]['nmi']['mean']:.2f}",
                ]
                for rep in BASELINES:
                    b = base[rep]["per_env"][env][level]
                    cells.append(f"{b['purity']['mean']:.2f}/{b['nmi']['mean']:.2f}")
                widths = (12, 13, 11, 11, 12, 12)
                gap = res.get("gap_intervals", {}).get(env)
                lines.append(
                    f"{env:<14}{e['k']:>5} "
                    + " ".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=False))
                    + (
                        "  yes"
                        if res["verdicts"][env]["beats"]
                        else "  tie"
                        if res["verdicts"][env]["ties"]
                        else "  no "
                    )
                    + (_gap_cell(gap) if gap else "")
                )
            pure = {env: v["pure_nmi_at_k"] for env, v in res["verdicts"].items() if v.get("pure_nmi_at_k")}
            lines.append(
                "  NMI of a perfectly pure partition at the memory's k, largest labels halved / single members split off: "
                + "; ".join(f"{env} {p['even']:.2f}/{p['splinters']:.2f}" for env, p in pure.items())
            )
            capped = {
                env: v["baseline_at_ceiling"] for env, v in res["verdicts"].items() if v.get("baseline_at_ceiling")
            }
            if capped:
                lines.append(
                    "  the best named baseline is at 1.000 (can be tied, not beaten): "
                    + "; ".join(
                        f"{env} {'/'.join(ms)}{' (LifeMem ties it there)' if res['verdicts'][env]['beats_or_ties_at_ceiling'] else ''}"
                        for env, ms in capped.items()
                    )
                )
            flows = res.get("distinct_workflows", {})
            if flows:
                lines.append(
                    "  distinct workflow vectors (LifeMem's k; cosine between distinct ones min/mean/max): "
                    + "; ".join(
                        f"{env} {d['distinct']} (k {d['k']}"
                        + (
                            f"; {d['cosine_between']['min']:.2f}/{d['cosine_between']['mean']:.2f}/{d['cosine_between']['max']:.2f})"
                            if "cosine_between" in d
                            else ")"
                        )
                        for env, d in flows.items()
                    )
                )
            lines.append(
                f"  beats the best named baseline in {sum(v['beats'] for v in res['verdicts'].values())} of "
                f"{len(res['verdicts'])} environments; mean gap to it (worse order, purity and NMI): {res['mean_gap_to_best']:+.4f}"
            )
            said = Counter(v["bootstrap"] for v in res["verdicts"].values() if v.get("bootstrap"))
            if said:
                lines.append(
                    "  bootstrap over trajectories (95%, both metrics): "
                    + ", ".join(f"{said[w]} {w}" for w in ("above", "within noise", "below"))
                )
            picks = {
                env: (v["view_by_silhouette"], v["best_view_by_labels"])
                for env, v in res["verdicts"].items()
                if v.get("view_by_silhouette")
            }
            if picks:
                lines.append(
                    f"  the view with the best silhouette is the best by labels (NMI) in {sum(a == b for a, b in picks.values())} of {len(picks)}: "
                    + "; ".join(
                        f"{env} {a.split('_')[0]}{'' if a == b else ' (labels: ' + b.split('_')[0] + ')'}"
                        for env, (a, b) in picks.items()
                    )
                )
            refined = res.get("refined_in_picked_view", {})
            if refined:
                lines.append(
                    f"  LifeMem's partition refined by k-means in that view (a batch consolidation; the engine has none) beats the best named "
                    f"baseline in {sum(bool(v.get('refined_beats')) for v in res['verdicts'].values())} of {len(refined)}: "
                    + "; ".join(
                        f"{env} {r['purity']:.3f}/{r['nmi']:.3f} (k {r['k_similarity']})" for env, r in refined.items()
                    )
                )
            combos = {env: v["batch_combinations_beating"] for env, v in res["verdicts"].items()}
            lines.append(
                "  batch k-means over a combination of views (not LifeMem) beating the best named view: "
                + "; ".join(f"{env} {', '.join(c) if c else 'none'}" for env, c in combos.items())
            )
            for run in res["runs"][:2]:
                lines.append(
                    f"  {run['order']}: {run['clusters']} clusters, {run['splits']} splits, {run['splits_refused']} refused, "
                    f"{run['merges']} merges, {run['mixed_env_clusters']} mixing environments, {run['seconds']} s"
                )
            if "skills" in res:
                own = [r["overall"]["own_cluster"] for r in res["skills"]]
                other = [r["overall"]["random_other_cluster"] for r in res["skills"]]
                lines.append(
                    f"  skills: step-category edit distance to {res['skills'][0]['overall']['n']} held-out trajectories: "
                    f"{min(own):.3f}-{max(own):.3f} their retrieved cluster's skill vs {min(other):.3f}-{max(other):.3f} a random other cluster's (4 orders)"
                )
    for fold, scales in report.get("weight_sweep", {}).items():
        for scale, sweep in scales.items():
            chosen = sweep["label_chosen"]
            lines.append(
                f"\n{fold} fold, {scale}: workflow weight picked per environment with the labels (grid "
                f"{', '.join(str(w) for w in WEIGHT_GRID)}; optimistic) beats the best named baseline in "
                f"{sum(c['beats'] for c in chosen.values())} of {len(chosen)}: "
                + "; ".join(
                    f"{env} {c['weight']} (k {c['k']}, gap {c['gap']['purity']:+.3f}/{c['gap']['nmi']:+.3f})"
                    for env, c in chosen.items()
                )
            )
    if "ablation" in report:
        lines.append(ablation_table(report))
    return "\n".join(lines)


def _gap_cell(gap: dict[str, Any]) -> str:
    return (
        f"; {gap['purity']['gap']:+.3f} [{gap['purity']['low']:+.3f},{gap['purity']['high']:+.3f}] / "
        f"{gap['nmi']['gap']:+.3f} [{gap['nmi']['low']:+.3f},{gap['nmi']['high']:+.3f}] {gap['verdict']}"
    )


def ablation_table(report: dict[str, Any]) -> str:
    rows = {"default": report["folds"].get("report", {}).get("full"), **report["ablation"]}
    envs = list(next(r for r in rows.values() if r)["similarity"]["per_env"])
    lines = [
        "\nablation, report fold, full: topic-level purity / NMI, similarity order (clusters; skill distance own vs other; "
        "mean gap to the best equal-k baseline at the variant's own k; environments beaten, and above / within noise / below by the bootstrap)"
    ]
    lines.append(
        f"{'variant':<37}"
        + "".join(f"{e[:12]:>13}" for e in envs)
        + f"{'overall':>13}{'clusters':>9}{'skills':>13}{'gap':>9}{'beats':>7}{'a/n/b':>8}"
    )
    for name, res in rows.items():
        if not res:
            continue
        per = res["similarity"]["per_env"]
        cells = [f"{per[e][LABEL_LEVELS[e][-1]]['purity']:.2f}/{per[e][LABEL_LEVELS[e][-1]]['nmi']:.2f}" for e in envs]
        o = res["similarity"]["overall_topic"]
        sk = (
            res["skills"][0]["overall"]
            if res.get("skills")
            else {"own_cluster": float("nan"), "random_other_cluster": float("nan")}
        )
        said = Counter(v.get("bootstrap") for v in res["verdicts"].values())
        lines.append(
            f"{name:<37}"
            + "".join(f"{c:>13}" for c in cells)
            + f"{o['purity']:.2f}/{o['nmi']:.2f}".rjust(13)
            + f"{res['runs'][0]['clusters']:>9}"
            + f"{sk['own_cluster']:.2f}/{sk['random_other_cluster']:.2f}".rjust(13)
            + f"{res['mean_gap_to_best']:>+9.3f}"
            + f"{sum(v['beats'] for v in res['verdicts'].values()):>7}"
            + f"{said['above']}/{said['within noise']}/{said['below']}".rjust(8)
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=ROOT / "runs" / "cluster_quality" / "data")
    parser.add_argument("--generate", action="store_true", help="generate the folds again even when cached")
    parser.add_argument("--data-scale", type=float, default=1.0, help="multiplies every environment's task count")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--noise", type=float, default=0.05)
    parser.add_argument("--folds", default="tune,report")
    parser.add_argument("--scales", default="small,full")
    parser.add_argument("--ablation", action="store_true")
    parser.add_argument(
        "--weight-sweep", action="store_true", help="every fold and scale again at each workflow weight of WEIGHT_GRID"
    )
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "cluster_quality" / "report.json")
    args = parser.parse_args()
    config = MemoryConfig.load(overrides=dict(item.split("=", 1) for item in args.set))
    embedder = MiniLMEmbedder(config.embedding)
    report: dict[str, Any] = {"config_overrides": args.set, "noise": args.noise, "folds": {}}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for fold in args.folds.split(","):
            trajs = load_or_generate(args.data, fold, args)
            vecs = cached_vectors(embedder, [t.query_text for t in trajs], args.data)
            act_vecs = cached_vectors(embedder, [action_text(t) for t in trajs], args.data)
            report["folds"][fold] = {}
            for scale in args.scales.split(","):
                pick = stratified_sample(trajs, SMALL_SIZE) if scale == "small" else list(range(len(trajs)))
                sub = [trajs[i] for i in pick]
                report["folds"][fold][scale] = evaluate_fold(
                    sub, vecs[pick], act_vecs[pick], config, tmp, with_skills=fold == "report"
                )
                if args.weight_sweep:
                    report.setdefault("weight_sweep", {}).setdefault(fold, {})[scale] = weight_sweep(
                        sub,
                        vecs[pick],
                        act_vecs[pick],
                        config,
                        tmp,
                        with_skills=fold == "report",
                        evaluated=report["folds"][fold][scale],
                    )
                print(f"{fold}/{scale} done", file=sys.stderr, flush=True)
            if args.ablation and fold == "report":
                report["ablation"] = {
                    name: evaluate_fold(trajs, vecs, act_vecs, config.replace(over), tmp, with_skills=True)
                    for name, over in ABLATION.items()
                }
    text = json.dumps(report, indent=1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    print(table(report), file=sys.stderr)


if __name__ == "__main__":
    main()
