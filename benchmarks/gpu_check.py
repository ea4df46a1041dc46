"""GPU check, for a machine with a CUDA GPU (one prepared run, well under 10 minutes).

* FAISS: the engine's VectorIndex built once on the CPU, saved, and loaded twice: with
  ``index.use_gpu = "no"`` and with ``"yes"`` (GPU replicas searched, the CPU index kept as
  master). The same queries on both: single-query p50/p99, batched queries/s, recall@4
  against exact search in the query's environment. ``--n`` synthetic trajectories over the
  generator's environments, vectors made directly (as in cluster_scale.py), generated in
  parallel worker processes.
* Embedding: MiniLMEmbedder texts/s at about 128 tokens on CUDA (fp16) vs the CPU, and how
  closely the two agree (cosine of the same texts' vectors).

Needs ``faiss-gpu`` (or ``faiss-gpu-cu12``) instead of ``faiss-cpu``, and a CUDA torch.
Prints JSON, then a table; exits 2 with a message when no GPU is visible.

Usage: python benchmarks/gpu_check.py [--n 1000000] [--queries 10000] [--model-path DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from multiprocessing import get_context

import numpy as np

CHUNK = 50_000
LENGTH_SCALE = 0.05  # as cluster_scale.py: only the task text feeds the vectors


def _chunk(job: tuple[int, int]) -> tuple[np.ndarray, list[str]]:
    from lifemem_ray.lab.synthetic import generate, text_vectors

    seed, count = job
    trajs = list(generate(count, seed=seed, length_scale=LENGTH_SCALE, id_prefix=f"g{seed}"))
    return text_vectors([x.task for x in trajs]), [x.env for x in trajs]


def make_data(n: int, seed_base: int, workers: int) -> tuple[np.ndarray, np.ndarray]:
    """(vectors, envs) of ``n`` synthetic trajectories, generated in ``workers`` processes."""
    jobs = [(seed_base + i, min(CHUNK, n - start)) for i, start in enumerate(range(0, n, CHUNK))]
    with get_context("fork").Pool(workers) as pool:
        parts = pool.map(_chunk, jobs)
    return np.vstack([p[0] for p in parts]), np.asarray([e for p in parts for e in p[1]], dtype=object)


def timed_search(index, queries: np.ndarray, envs: np.ndarray) -> dict[str, float]:
    index.search_envs(queries[:64], 4, list(envs[:64]))  # GPU replicas are copied on first use
    lat = []
    for q, e in zip(queries[:500], envs[:500], strict=True):
        t = time.perf_counter()
        index.search_envs(q[None, :], 4, [e])
        lat.append(time.perf_counter() - t)
    t = time.perf_counter()
    index.search_envs(queries, 4, list(envs))
    batched = len(queries) / (time.perf_counter() - t)
    ms = np.asarray(lat) * 1000
    return {
        "p50_ms": round(float(np.percentile(ms, 50)), 3),
        "p99_ms": round(float(np.percentile(ms, 99)), 3),
        "batched_queries_per_s": round(batched, 1),
    }


def recall_at_4(index, vecs: np.ndarray, envs: np.ndarray, queries: np.ndarray, qenvs: np.ndarray) -> float:
    """Share of the exact top-4 scores (per environment, brute force) that the index returns."""
    scores, _ = index.search_envs(queries, 4, list(qenvs))
    hits = total = 0
    for e in np.unique(qenvs):
        rows = np.flatnonzero(qenvs == e)
        exact = np.sort(queries[rows] @ vecs[envs == e].T, axis=1)[:, ::-1][:, :4]
        hits += int(np.sum(scores[rows] >= exact[:, -1:] - 1e-4))
        total += exact.size
    return round(hits / total, 4)


def embedding_check(model_path: str) -> dict:
    import torch

    from lifemem_ray.engine.embedding import MiniLMEmbedder
    from lifemem_ray.engine.memory_config import EmbeddingConfig

    words = [
        "search",
        "the",
        "catalogue",
        "for",
        "a",
        "waterproof",
        "pair",
        "of",
        "running",
        "shoes",
        "under",
        "fifty",
        "dollars",
        "then",
        "compare",
    ]
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(words, size=110)) for _ in range(4096)]
    out: dict = {"torch": torch.__version__}
    vectors = {}
    for device in ("cuda", "cpu"):
        if device == "cuda" and not torch.cuda.is_available():
            out["cuda_per_s"] = None
            continue
        count = 4096 if device == "cuda" else 256
        embedder = MiniLMEmbedder(
            EmbeddingConfig(device=device, batch_size=256 if device == "cuda" else 64, model_path=model_path)
        )
        embedder.embed(texts[:64])
        t = time.perf_counter()
        vectors[device] = embedder.embed(texts[:count])
        out[f"{device}_per_s"] = round(count / (time.perf_counter() - t), 1)
        out["tokens_per_text"] = round(float(np.mean(embedder.count_tokens(texts[:64]))), 1)
    if "cuda" in vectors:
        cos = np.sum(vectors["cuda"][:256] * vectors["cpu"], axis=1)
        out["cuda_vs_cpu_cosine_min"] = round(float(cos.min()), 5)
        out["cuda_over_cpu"] = round(out["cuda_per_s"] / out["cpu_per_s"], 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--queries", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    parser.add_argument("--model-path", default="", help="embedding model folder (default: the packaged MiniLM)")
    parser.add_argument("--progress", default="", help="also write the report so far to this file after each stage")
    args = parser.parse_args()
    started = time.perf_counter()

    def stage(name: str) -> None:
        print(f"[{time.perf_counter() - started:7.1f} s] {name}", file=sys.stderr, flush=True)
        if args.progress:
            with open(args.progress, "w", encoding="utf-8") as f:
                json.dump(report, f, indent=1)

    import faiss

    from lifemem_ray.engine.index.vector_index import VectorIndex
    from lifemem_ray.engine.memory_config import IndexConfig

    gpus = faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0
    if gpus == 0:
        print("no GPU visible to FAISS (install faiss-gpu on a CUDA machine)", file=sys.stderr)
        sys.exit(2)
    report: dict = {"faiss": faiss.__version__, "faiss_gpus": gpus, "cpu_cores": os.cpu_count(), "n": args.n}
    t = time.perf_counter()
    vecs, envs = make_data(args.n, 1000, args.workers)
    queries, qenvs = make_data(args.queries, 99, args.workers)
    report["generate_s"] = round(time.perf_counter() - t, 1)
    report["envs"] = len(np.unique(envs))
    stage("generated")

    t = time.perf_counter()
    built = VectorIndex(vecs.shape[1], IndexConfig(use_gpu="no"))
    ids = np.arange(args.n, dtype=np.int64)
    for e in np.unique(envs):
        rows = np.flatnonzero(envs == e)
        built.add(e, ids[rows], vecs[rows])
    report["build_cpu_s"] = round(time.perf_counter() - t, 1)
    stage("built")
    with tempfile.TemporaryDirectory() as tmp:
        built.save(tmp, stamp=1)
        del built
        results = {}
        for mode, name in (("no", "cpu"), ("yes", "gpu")):
            t = time.perf_counter()
            loaded = VectorIndex.load(tmp, vecs.shape[1], IndexConfig(use_gpu=mode))
            assert loaded is not None, "the saved index did not load"
            index = loaded[0]
            report[f"load_{name}_s"] = round(time.perf_counter() - t, 1)
            t = time.perf_counter()
            results[name] = timed_search(index, queries, qenvs)
            results[name]["recall@4"] = recall_at_4(index, vecs, envs, queries[:1000], qenvs[:1000])
            results[name]["seconds"] = round(time.perf_counter() - t, 1)
            if name == "gpu":
                results[name]["searched_on_gpu"] = index.stats()["gpu"]
            del index, loaded
            report[name] = results[name]
            stage(f"searched on {name}")
    report["gpu_over_cpu_batched"] = round(
        results["gpu"]["batched_queries_per_s"] / results["cpu"]["batched_queries_per_s"], 2
    )
    report["gpu_over_cpu_p50"] = round(results["cpu"]["p50_ms"] / results["gpu"]["p50_ms"], 2)
    report["embedding"] = embedding_check(args.model_path)
    stage("embedded")
    print(json.dumps(report, indent=2))
    print(f"\n{'':10}{'p50 ms':>9}{'p99 ms':>9}{'batched q/s':>13}{'recall@4':>10}")
    for name in ("cpu", "gpu"):
        r = results[name]
        print(f"{name:10}{r['p50_ms']:>9}{r['p99_ms']:>9}{r['batched_queries_per_s']:>13}{r['recall@4']:>10}")
    emb = report["embedding"]
    print(
        f"embedding texts/s: cuda {emb.get('cuda_per_s')}, cpu {emb.get('cpu_per_s')}, min cosine {emb.get('cuda_vs_cpu_cosine_min')}"
    )


if __name__ == "__main__":
    main()
