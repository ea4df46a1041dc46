"""Memory quality on the real trajectories released with the paper (issue section 8).

Ingests all of ``shared/data/lifemem-trainset/`` (9 environments) with the offline
policy, holding out every 10th record per environment as a query, and prints:
clusters per environment, the cluster-size distribution, the share of clusters
that mix environments, workflow purity where labels exist (toolqa's two passes),
and same-environment precision@4 of retrieval for the held-out tasks, beside a
trajectory-only baseline (plain nearest neighbours over everything, no clusters,
no environment restriction). With ``--synthetic N`` it also reports purity
against the synthetic generator's ground-truth workflow labels.

Usage: python benchmarks/quality.py [--shared DIR] [--synthetic 3000] [--set section.key=value ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.core.importers import iter_jsonl
from lifemem_ray.engine.embedding import MiniLMEmbedder
from lifemem_ray.engine.memory import Memory
from lifemem_ray.lab.synthetic import generate, text_vectors

ROOT = Path(__file__).resolve().parents[1]


def toolqa_label(traj) -> str | None:
    """toolqa's published file holds two passes: SQLInterpreter answers, then FilterDB/GetValue ones."""
    if traj.env != "toolqa":
        return None
    line = traj.metadata.get("source_line")
    return None if line is None else ("sql-pass" if line <= 215 else "filter-pass")


def purity(memory: Memory, label_of) -> tuple[float, int]:
    agree = total = 0
    for cluster in memory.clusters():
        labels = Counter(label for i in memory.members(cluster.id) if (label := label_of(memory.get(i))) is not None)
        if labels:
            agree += labels.most_common(1)[0][1]
            total += sum(labels.values())
    return (agree / total if total else float("nan")), total


def size_distribution(sizes: list[int]) -> dict[str, float]:
    s = np.asarray(sorted(sizes))
    buckets = {
        "1": int((s == 1).sum()),
        "2-4": int(((s >= 2) & (s <= 4)).sum()),
        "5-9": int(((s >= 5) & (s <= 9)).sum()),
        "10-19": int(((s >= 10) & (s <= 19)).sum()),
        "20-50": int(((s >= 20) & (s <= 50)).sum()),
        ">50": int((s > 50).sum()),
    }
    return {
        "clusters": len(s),
        "min": int(s.min()),
        "median": float(np.median(s)),
        "mean": round(float(s.mean()), 2),
        "max": int(s.max()),
        "histogram": buckets,
    }


def cached_embed(embedder: MiniLMEmbedder, texts: list[str], cache: Path | None) -> np.ndarray:
    """Embeddings, reused from ``cache`` (an .npy file keyed by the texts' hash) when given."""
    if cache is None:
        return embedder.embed(texts)
    import hashlib

    key = hashlib.sha256("\x00".join(texts).encode()).hexdigest()[:16]
    path = cache.with_name(f"{cache.stem}-{key}.npy")
    if path.exists():
        return np.load(path)
    vecs = embedder.embed(texts)
    np.save(path, vecs)
    return vecs


def real_data(shared: Path, config: DeploymentConfig, embedder: MiniLMEmbedder, cache: Path | None = None) -> dict:
    folder = shared / "data" / "lifemem-trainset"
    if not folder.is_dir():
        raise SystemExit(f"{folder}: shared trajectory data not found (use --shared)")
    train, held = [], []
    for path in sorted(folder.glob("*.jsonl")):
        for n, traj in enumerate(iter_jsonl(path)):
            (held if n % 10 == 9 else train).append(traj)
    t0 = time.perf_counter()
    train_vecs = cached_embed(embedder, [t.query_text for t in train], cache)
    held_vecs = cached_embed(embedder, [t.query_text for t in held], cache)
    embed_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp, Memory.open(Path(tmp) / "m", config, embedder=embedder) as memory:
        t0 = time.perf_counter()
        memory.add_many(train, train_vecs)
        ingest_s = time.perf_counter() - t0
        stats = memory.stats()
        clusters = memory.clusters()
        k = 4
        results = memory.retrieve_many([t.query_text for t in held], [t.env for t in held], k, vectors=held_vecs)
        lifemem_prec = [
            np.mean([h.env == q.env for h in r.trajectories]) if r.trajectories else 0.0
            for q, r in zip(held, results, strict=True)
        ]
        skills_per_query = float(np.mean([len(r.skills) for r in results]))
        # Baseline: plain nearest neighbours over every stored trajectory, any environment.
        stored = np.asarray(train_vecs)
        top = np.argsort(-(held_vecs @ stored.T), axis=1)[:, :k]
        base_prec = [np.mean([train[j].env == q.env for j in row]) for q, row in zip(held, top, strict=True)]
        toolqa_purity, toolqa_n = purity(memory, toolqa_label)
        # R of clusters with 10+ members over their goal vectors vs their workflow vectors.
        with memory.store.read() as txn:
            records = [memory.store.get_cluster(txn, c.id) for c in clusters if c.count >= 10]
        r_goal = [float(np.linalg.norm(r.tsum) / r.count) for r in records]
        r_flow = [r.mrl for r in records]
        verify = memory.verify()
    from lifemem_ray.engine.clustering.workflow import action_tokens, workflow_vector

    wvecs = np.stack([workflow_vector(action_tokens(t)) for t in train])
    envs_of = np.array([t.env for t in train])
    per_env = {}
    for env in sorted({t.env for t in train}):
        idx = [i for i, q in enumerate(held) if q.env == env]
        env_clusters = [c for c in clusters if env in c.envs]
        per_env[env] = {
            "trajectories": stats["per_env"][env]["trajectories"],
            "clusters": len(env_clusters),
            "mean_cluster_size": round(float(np.mean([c.envs[env] for c in env_clusters])), 2) if env_clusters else 0.0,
            "precision@4_lifemem": round(float(np.mean([lifemem_prec[i] for i in idx])), 4),
            "precision@4_baseline": round(float(np.mean([base_prec[i] for i in idx])), 4),
            # Mean resultant length of the whole environment, over goal embeddings vs workflow vectors.
            "R_goal_text": round(float(np.linalg.norm(train_vecs[envs_of == env].mean(axis=0))), 3),
            "R_workflow": round(float(np.linalg.norm(wvecs[envs_of == env].mean(axis=0))), 3),
        }
    return {
        "records": len(train) + len(held),
        "stored": stats["trajectories"],
        "held_out_queries": len(held),
        "clusters": stats["clusters"],
        "splits": stats["splits"],
        "mixed_env_cluster_share": round(stats["mixed_env_clusters"] / max(stats["clusters"], 1), 4),
        "cluster_sizes": size_distribution([c.count for c in clusters]),
        "precision@4": {
            "lifemem": round(float(np.mean(lifemem_prec)), 4),
            "trajectory_only_baseline": round(float(np.mean(base_prec)), 4),
        },
        "skills_per_query": round(skills_per_query, 2),
        "toolqa_pass_purity": round(toolqa_purity, 4),
        "clusters_10plus": {
            "count": len(r_goal),
            "R_goal_text_median": round(float(np.median(r_goal)), 3) if r_goal else None,
            "R_workflow_median": round(float(np.median(r_flow)), 3) if r_flow else None,
            "share_R_goal_below_tau": round(
                float(np.mean([r < config.evolution.split_mrl_threshold for r in r_goal])), 3
            )
            if r_goal
            else None,
            "share_R_workflow_below_tau": round(
                float(np.mean([r < config.evolution.split_mrl_threshold for r in r_flow])), 3
            )
            if r_flow
            else None,
        },
        "toolqa_labelled": toolqa_n,
        "per_env": per_env,
        "seconds": {"embed": round(embed_s, 1), "ingest": round(ingest_s, 2)},
        "verify_ok": verify["ok"],
    }


def synthetic_data(n: int, config: DeploymentConfig) -> dict:
    trajs = list(generate(n, seed=11, length_scale=0.2))
    vecs = text_vectors([t.task for t in trajs])
    with tempfile.TemporaryDirectory() as tmp, Memory.open(Path(tmp) / "m", config) as memory:
        memory.add_many(trajs, vecs)
        p, _ = purity(memory, lambda t: t.metadata["workflow"])
        stats = memory.stats()
    labels = len({t.metadata["workflow"] for t in trajs})
    return {
        "trajectories": n,
        "workflow_labels": labels,
        "clusters": stats["clusters"],
        "splits": stats["splits"],
        "purity": round(p, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shared", type=Path, default=ROOT.parent / "shared")
    parser.add_argument(
        "--synthetic", type=int, default=3000, help="also measure purity on N labelled synthetic trajectories (0: skip)"
    )
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument(
        "--no-ablation", dest="ablation", action="store_false", help="skip the goal-text-only comparison"
    )
    parser.add_argument("--vector-cache", type=Path, help="reuse task embeddings across runs (an .npy path prefix)")
    args = parser.parse_args()
    config = DeploymentConfig.load(overrides=dict(item.split("=", 1) for item in args.set))
    embedder = MiniLMEmbedder(config.embedding)
    report = {"config_overrides": args.set, "real": real_data(args.shared, config, embedder, args.vector_cache)}
    if args.synthetic:
        report["synthetic"] = synthetic_data(args.synthetic, config)
    if args.ablation:
        # The same with the goal text alone deciding (no workflow similarity).
        text_only = config.replace({"policy.workflow_weight": 0.0})
        real = real_data(args.shared, text_only, embedder, args.vector_cache)
        report["ablation_goal_text_only"] = {
            k: real[k] for k in ("clusters", "splits", "toolqa_pass_purity", "precision@4", "mixed_env_cluster_share")
        }
        if args.synthetic:
            report["ablation_goal_text_only"]["synthetic"] = synthetic_data(args.synthetic, text_only)
    print(json.dumps(report, indent=2))
    real = report["real"]
    print("\nLifeMem quality on the paper's released trajectories (offline policy)", file=sys.stderr)
    print(
        f"{'env':<14}{'stored':>8}{'clusters':>10}{'mean size':>11}{'P@4 LifeMem':>13}{'P@4 baseline':>14}{'R goal':>8}{'R flow':>8}",
        file=sys.stderr,
    )
    for env, e in real["per_env"].items():
        print(
            f"{env:<14}{e['trajectories']:>8}{e['clusters']:>10}{e['mean_cluster_size']:>11}{e['precision@4_lifemem']:>13.3f}"
            f"{e['precision@4_baseline']:>14.3f}{e['R_goal_text']:>8}{e['R_workflow']:>8}",
            file=sys.stderr,
        )
    p = real["precision@4"]
    print(
        f"{'all':<14}{real['stored']:>8}{real['clusters']:>10}{'':>11}{p['lifemem']:>13.3f}{p['trajectory_only_baseline']:>14.3f}",
        file=sys.stderr,
    )
    sizes = real["cluster_sizes"]
    print(
        f"cluster sizes: median {sizes['median']}, mean {sizes['mean']}, max {sizes['max']}, histogram {sizes['histogram']}",
        file=sys.stderr,
    )
    print(
        f"clusters mixing environments: {real['mixed_env_cluster_share']:.1%}; toolqa pass purity {real['toolqa_pass_purity']:.3f}",
        file=sys.stderr,
    )
    c10 = real["clusters_10plus"]
    print(
        f"clusters with 10+ members: {c10['count']}; median R over goal vectors {c10['R_goal_text_median']} "
        f"({c10['share_R_goal_below_tau']:.0%} below tau) vs over workflow vectors {c10['R_workflow_median']} "
        f"({c10['share_R_workflow_below_tau']:.0%} below tau)",
        file=sys.stderr,
    )
    if args.synthetic:
        s = report["synthetic"]
        print(
            f"synthetic: {s['trajectories']} trajectories, {s['workflow_labels']} workflows -> {s['clusters']} clusters, purity {s['purity']:.3f}",
            file=sys.stderr,
        )
    if args.ablation:
        a = report["ablation_goal_text_only"]
        line = f"goal text only (policy.workflow_weight=0): {a['clusters']} clusters, toolqa pass purity {a['toolqa_pass_purity']:.3f}"
        if "synthetic" in a:
            line += f", synthetic purity {a['synthetic']['purity']:.3f} ({a['synthetic']['clusters']} clusters)"
        print(line, file=sys.stderr)


if __name__ == "__main__":
    main()
