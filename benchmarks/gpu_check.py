"""GPU check, for a machine with a CUDA GPU (one prepared run, well under 10 minutes).

* FAISS: the engine's VectorIndex with ``index.use_gpu = "yes"`` (a GPU replica searched,
  the CPU index kept as master) against the same index on the CPU, on ``--n`` synthetic
  vectors over 12 environments: single-query p50/p99, batched queries/s, recall@4 vs exact.
* Embedding: MiniLM texts/s at about 128 tokens on CUDA (fp16) vs the CPU.

Needs ``faiss-gpu`` (or ``faiss-gpu-cu12``) instead of ``faiss-cpu``, and a CUDA torch.
Prints JSON; exits 2 with a message when no GPU is visible.

Usage: python benchmarks/gpu_check.py [--n 1000000] [--queries 2000]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def timed_search(index, queries: np.ndarray, envs: list[str]) -> dict[str, float]:
    lat = []
    for q, e in zip(queries[:500], envs[:500]):
        t = time.perf_counter()
        index.search(q[None, :], 4, env=e)
        lat.append(time.perf_counter() - t)
    t = time.perf_counter()
    index.search_envs(queries, 4, envs)
    batched = len(queries) / (time.perf_counter() - t)
    ms = np.asarray(lat) * 1000
    return {"p50_ms": round(float(np.percentile(ms, 50)), 3), "p99_ms": round(float(np.percentile(ms, 99)), 3), "batched_queries_per_s": round(batched, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--queries", type=int, default=2000)
    args = parser.parse_args()
    import faiss

    from lifemem_ray.config import EmbeddingConfig, IndexConfig
    from lifemem_ray.index import VectorIndex
    from lifemem_ray.synthetic import generate, text_vectors

    gpus = faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0
    if gpus == 0:
        print("no GPU visible to FAISS (install faiss-gpu on a CUDA machine)", file=sys.stderr)
        sys.exit(2)
    report: dict = {"faiss_gpus": gpus, "n": args.n}
    t = time.perf_counter()
    trajs = list(generate(args.n + args.queries, seed=3, length_scale=0.05))
    vecs = text_vectors([x.task for x in trajs])
    envs = [x.env for x in trajs]
    report["generate_s"] = round(time.perf_counter() - t, 1)
    ids = np.arange(args.n, dtype=np.int64)
    indices = {}
    for mode in ("no", "yes"):
        t = time.perf_counter()
        index = VectorIndex(vecs.shape[1], IndexConfig(use_gpu=mode))
        env_arr = np.asarray(envs[: args.n])
        for e in sorted(set(envs)):
            rows = np.flatnonzero(env_arr == e)
            index.add(e, ids[rows], vecs[rows])
        indices[mode] = index
        report[f"build_{'gpu' if mode == 'yes' else 'cpu'}_s"] = round(time.perf_counter() - t, 1)
    q, qenv = vecs[args.n :], envs[args.n :]
    report["cpu"] = timed_search(indices["no"], q, qenv)
    report["gpu"] = timed_search(indices["yes"], q, qenv)
    report["gpu_stats"] = indices["yes"].stats()["gpu"]
    # Recall@4 of the GPU index against exact search in the environment.
    env_arr = np.asarray(envs[: args.n])
    scores, _ = indices["yes"].search_envs(q[:300], 4, qenv[:300])
    hits = total = 0
    for row, v, e in zip(scores, q[:300], qenv[:300]):
        exact = np.sort(vecs[: args.n][env_arr == e] @ v)[::-1][:4]
        hits += int(np.sum(row >= exact[-1] - 1e-4))
        total += len(exact)
    report["gpu_recall@4"] = round(hits / total, 4)

    import torch

    from lifemem_ray.embedding import MiniLMEmbedder

    words = "search the catalogue for a waterproof pair of running shoes under fifty dollars then compare".split()
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(words, size=110)) for _ in range(4096)]
    for device in ("cuda", "cpu"):
        if device == "cuda" and not torch.cuda.is_available():
            report["embedding_cuda_per_s"] = None
            continue
        count = 4096 if device == "cuda" else 256
        embedder = MiniLMEmbedder(EmbeddingConfig(device=device, batch_size=256 if device == "cuda" else 64))
        embedder.embed(texts[:64])
        t = time.perf_counter()
        embedder.embed(texts[:count])
        report[f"embedding_{device}_per_s"] = round(count / (time.perf_counter() - t), 1)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
