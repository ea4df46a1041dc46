"""Engine speed on one machine (issue section 10), each figure beside a raw baseline.

* ingest: trajectories/s through ``Memory.add_many`` (precomputed vectors, offline
  policy, durable commits) while the store grows to ``--n`` (default 100k), beside
  raw FAISS ``add`` of the same vectors;
* retrieve: single ``Memory.retrieve`` latency (p50/p99) at that size, beside a raw
  FAISS search restricted to the same environment (a flat index per environment);
* embedding: texts/s of the MiniLM encoder at about 128 tokens, beside
  sentence-transformers encoding the same texts.

Prints JSON on stdout and a readable table on stderr. No timing is asserted here.

Usage: python benchmarks/engine_speed.py [--n 100000] [--queries 1000] [--batch 1024] [--skip-embedding]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import faiss
import numpy as np

from lifemem_ray.engine.memory import Memory
from lifemem_ray.engine.memory_config import MemoryConfig
from lifemem_ray.lab.synthetic import generate, text_vectors


def percentiles(samples: list[float]) -> dict[str, float]:
    ms = np.asarray(samples) * 1000
    return {
        "p50_ms": round(float(np.percentile(ms, 50)), 3),
        "p99_ms": round(float(np.percentile(ms, 99)), 3),
        "mean_ms": round(float(ms.mean()), 3),
    }


def bench_ingest_and_retrieve(n: int, batch: int, queries: int, config: MemoryConfig) -> dict:
    t0 = time.perf_counter()
    trajs = list(generate(n + queries, seed=2, length_scale=0.5))
    vecs = text_vectors([t.task for t in trajs])
    gen_s = time.perf_counter() - t0
    train, train_vecs = trajs[:n], vecs[:n]
    held, held_vecs = trajs[n:], vecs[n:]

    windows = []
    with tempfile.TemporaryDirectory() as tmp, Memory.open(Path(tmp) / "m", config) as memory:
        start = time.perf_counter()
        mark, mark_n = start, 0
        for i in range(0, n, batch):
            memory.add_many(train[i : i + batch], train_vecs[i : i + batch])
            done = min(i + batch, n)
            if done - mark_n >= n // 10 or done == n:
                now = time.perf_counter()
                windows.append({"stored": done, "per_s": round((done - mark_n) / (now - mark), 1)})
                mark, mark_n = now, done
        ingest_s = time.perf_counter() - start
        stats = memory.stats()
        # Single retrieves, one query at a time, as an agent would ask.
        lat = []
        for q, v in zip(held, held_vecs, strict=True):
            t = time.perf_counter()
            memory.retrieve(q.task, q.env, 4, vector=v)
            lat.append(time.perf_counter() - t)
        # The same searches on the engine's own FAISS index alone: the rest is LMDB reads,
        # skill lookup and prompt rendering.
        index_lat = []
        for q, v in zip(held, held_vecs, strict=True):
            t = time.perf_counter()
            memory.index.search(v[None, :], 4, env=q.env)
            index_lat.append(time.perf_counter() - t)
        many_t = time.perf_counter()
        memory.retrieve_many([q.task for q in held], [q.env for q in held], 4, vectors=held_vecs)
        many_s = time.perf_counter() - many_t
        disk = sum(p.stat().st_size for p in (Path(tmp) / "m").rglob("*") if p.is_file())

    # Raw FAISS on the same data: add, then env-restricted search with one flat index per env.
    envs = sorted({t.env for t in train})
    env_of = np.array([envs.index(t.env) for t in train])
    t = time.perf_counter()
    raw = {}
    for e, name in enumerate(envs):
        index = faiss.IndexIDMap2(faiss.IndexFlatIP(vecs.shape[1]))
        rows = np.flatnonzero(env_of == e)
        index.add_with_ids(train_vecs[rows], rows.astype(np.int64))
        raw[name] = index
    raw_add_s = time.perf_counter() - t
    raw_lat = []
    for q, v in zip(held, held_vecs, strict=True):
        t = time.perf_counter()
        raw[q.env].search(v[None, :], 4)
        raw_lat.append(time.perf_counter() - t)

    return {
        "n": n,
        "batch": batch,
        "generate_s": round(gen_s, 1),
        "ingest": {
            "per_s": round(n / ingest_s, 1),
            "seconds": round(ingest_s, 1),
            "min_window_per_s": min(w["per_s"] for w in windows),
            "windows": windows,
            "raw_faiss_add_per_s": round(n / raw_add_s, 1),
        },
        "retrieve": {
            **percentiles(lat),
            "index_only": percentiles(index_lat),
            "raw_faiss_flat": percentiles(raw_lat),
            "many_queries_per_s": round(len(held) / many_s, 1),
        },
        "store": {
            "clusters": stats["clusters"],
            "splits": stats["splits"],
            "disk_bytes_per_trajectory": round(disk / n, 1),
            "index": {e: (v["kind"], v["nprobe"]) for e, v in stats["index"]["envs"].items()},
        },
    }


def bench_embedding(count: int) -> dict:
    from lifemem_ray.engine.embedding import MiniLMEmbedder, default_model_path

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
    texts = [" ".join(rng.choice(words, size=110)) for _ in range(count)]
    embedder = MiniLMEmbedder()
    tokens = float(np.mean(embedder.count_tokens(texts[:50])))
    embedder.embed(texts[:16])
    t = time.perf_counter()
    embedder.embed(texts)
    ours = count / (time.perf_counter() - t)
    out = {"texts": count, "mean_tokens": round(tokens, 1), "per_s": round(ours, 1), "device": embedder.device}
    try:
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(str(default_model_path()), device="cpu")
        st.encode(texts[:16])
        t = time.perf_counter()
        st.encode(texts, batch_size=64, normalize_embeddings=True)
        out["sentence_transformers_per_s"] = round(count / (time.perf_counter() - t), 1)
    except ImportError:
        out["sentence_transformers_per_s"] = None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--embed-texts", type=int, default=512)
    parser.add_argument("--skip-embedding", action="store_true")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = parser.parse_args()
    config = MemoryConfig.load(overrides=dict(item.split("=", 1) for item in args.set))
    report = {"engine": bench_ingest_and_retrieve(args.n, args.batch, args.queries, config)}
    if not args.skip_embedding:
        report["embedding"] = bench_embedding(args.embed_texts)
    print(json.dumps(report, indent=2))
    e = report["engine"]
    rows = [
        ("ingest (traj/s)", e["ingest"]["per_s"], e["ingest"]["raw_faiss_add_per_s"], "FAISS add"),
        ("ingest slowest 10% window (traj/s)", e["ingest"]["min_window_per_s"], None, ""),
        ("retrieve p50 (ms)", e["retrieve"]["p50_ms"], e["retrieve"]["index_only"]["p50_ms"], "its FAISS index alone"),
        ("retrieve p99 (ms)", e["retrieve"]["p99_ms"], e["retrieve"]["index_only"]["p99_ms"], "its FAISS index alone"),
        (
            "retrieve p50 vs raw flat (ms)",
            e["retrieve"]["p50_ms"],
            e["retrieve"]["raw_faiss_flat"]["p50_ms"],
            "raw IndexFlatIP per env",
        ),
        ("retrieve_many (queries/s)", e["retrieve"]["many_queries_per_s"], None, ""),
    ]
    if "embedding" in report:
        rows.append(
            (
                "embedding (texts/s, ~128 tok)",
                report["embedding"]["per_s"],
                report["embedding"]["sentence_transformers_per_s"],
                "sentence-transformers",
            )
        )
    print(f"\nengine at {e['n']:,} stored trajectories ({e['store']['clusters']} clusters)", file=sys.stderr)
    print(f"{'figure':<38}{'lifemem-ray':>14}{'baseline':>12}  {'ratio':>7}  baseline", file=sys.stderr)
    for name, ours, base, what in rows:
        ratio = f"{ours / base:.3g}" if base else ""
        print(f"{name:<38}{ours:>14}{'' if base is None else base:>12}  {ratio:>7}  {what}", file=sys.stderr)


if __name__ == "__main__":
    main()
