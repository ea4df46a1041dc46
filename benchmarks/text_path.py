"""What a text costs beside a vector, through ``MemoryClient`` on a 2-shard deployment (issue 26).

One local Ray (sized for 2 cores), and two deployments one after the other on the same data:

* ``before``: the embedding path as it was (torch, no cache, no batching across callers:
  ``embedding.backend = "torch"``, ``cache_entries = 0``, ``batch_wait_ms = 0``);
* ``after``: the defaults (ONNX Runtime on the CPU where installed, the cache, dynamic batching).

Each is seeded with ``--stored`` generated trajectories (with their vectors, computed once
here), then, for ``--seconds`` each: retrieve one at a time with vectors and with texts (each
text new: a cache miss); 8 concurrent clients with vectors and with texts; one text retrieved
again and again; adds of 8 trajectories from 8 clients with vectors and with texts; a
GRPO-shaped load (a prompt retrieved 8 times at once, then its 8 trajectories added, each
prompt new); and the stage times of one retrieve (the embedding alone, the search alone).
Ratios text / vector within a deployment, and after / before per phase, all from this run.

Prints JSON, then a table. Usage:
    python benchmarks/text_path.py [--stored 3000] [--seconds 8] [--clients 8]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import ray
from load_timing import percentile_ms, timed  # benchmarks/ (the script's folder)

from lifemem_ray.actors.client.blocking import MemoryClient
from lifemem_ray.actors.cluster import deployment as dep
from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.actors.cluster.ray_address import private_ray
from lifemem_ray.core.model import Trajectory
from lifemem_ray.engine.embedding import open_embedder
from lifemem_ray.engine.memory_config import EmbeddingConfig
from lifemem_ray.lab.synthetic import generate

ENVS = ["shop", "sql", "retail", "airline"]
ACTORS = {"cluster.shard_cpus": 0.25, "cluster.coordinator_cpus": 0.25, "cluster.embedder_cpus": 0.25}
BEFORE = {"embedding.backend": "torch", "embedding.cache_entries": 0, "embedding.batch_wait_ms": 0.0}
# The issue's own measurement on landed main (2 shards, 3,000 stored, this machine): for reference
# only, not this run's.
ISSUE_FIGURES = {
    "retrieve one at a time, vectors / texts ops/s": (133, 30),
    "retrieve 8 clients, vectors / texts ops/s": (198, 30),
    "same text again and again ops/s": 31,
    "add of 8, 8 clients, vectors / texts batches/s": (43, 7),
}


class Pool:
    """Fresh items handed out once each (thread-safe): query tasks, or trajectories to add."""

    def __init__(self, items: Iterator[Any]) -> None:
        self._items = items
        self._lock = threading.Lock()

    def take(self, n: int = 1) -> list[Any]:
        with self._lock:
            return [next(self._items) for _ in range(n)]


def distinct_tasks(n: int, seed: int, exclude: set[str]) -> list[tuple[str, str]]:
    """``n`` generated (task, env) pairs, no task twice and none in ``exclude`` (a text-in phase
    must not be helped by a text seen before)."""
    seen = set(exclude)
    out: list[tuple[str, str]] = []
    for t in generate(10**7, seed=seed, envs=ENVS, length_scale=0.1, id_prefix=f"q{seed}"):
        if t.task not in seen:
            seen.add(t.task)
            out.append((t.task, t.env))
            if len(out) == n:
                return out
    return out


def phases(client: MemoryClient, data: dict[str, Any], args: argparse.Namespace, tag: str) -> dict:
    """Every phase against one deployment; each text-in phase draws texts it never saw."""
    k, s, c = 4, args.seconds, args.clients
    fresh = Pool(iter(data["fresh"]))
    known = Pool(iter(list(data["vectors_of"].items()) * 1000))
    repeated = next(iter(data["vectors_of"]))

    def by_vector() -> int:
        ((task, vector),) = known.take()
        client.retrieve(task, None, k, vector=vector)
        return 1

    def by_text() -> int:
        ((task, _env),) = fresh.take()
        client.retrieve(task, None, k)
        return 1

    def renamed(t: Trajectory, i: int) -> Trajectory:
        return Trajectory.from_dict({**t.to_dict(), "id": f"{tag}-{i}"})

    def batches() -> Iterator[tuple[list[Trajectory], np.ndarray]]:
        """The prepared trajectories 8 at a time with their vectors, round and round, new ids each time."""
        adds, vecs, n = data["adds"], data["add_vecs"], 0
        while True:
            for a in range(0, len(adds) - 7, 8):
                yield [renamed(t, n + j) for j, t in enumerate(adds[a : a + 8])], vecs[a : a + 8]
                n += 8

    ready = Pool(batches())
    text_adds = Pool(iter(data["text_adds"]))

    def add_with_vectors() -> int:
        ((batch, vecs),) = ready.take()
        client.add_many(batch, vecs).result(timeout=600)
        return 1

    def add_with_texts() -> int:
        batch = [renamed(t, 10**8 + i) for i, t in text_adds.take(8)]
        client.add_many(batch).result(timeout=600)
        return 1

    group_ids = iter(range(10**9))

    def grpo_group() -> int:
        """One prompt rolled out 8 times: 8 retrieves of it at once, then its 8 trajectories."""
        ((task, env),) = fresh.take()
        threads = [threading.Thread(target=client.retrieve, args=(task, None, k)) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        base = data["adds"][0].to_dict()
        group = [
            Trajectory.from_dict({**base, "id": f"{tag}-grpo-{next(group_ids)}", "task": task, "env": env})
            for _ in range(8)
        ]
        client.add_many(group).result(timeout=600)
        return 16

    out = {
        "retrieve_1_vectors": timed(1, s, by_vector),
        "retrieve_1_texts": timed(1, s, by_text),
        "retrieve_8_vectors": timed(c, s, by_vector),
        "retrieve_8_texts": timed(c, s, by_text),
        "same_text_again": timed(1, s, lambda: (client.retrieve(repeated, None, k), 1)[1]),
        "add8_8_vectors": timed(c, s, add_with_vectors),
        "add8_8_texts": timed(c, s, add_with_texts),
        "grpo_8x8": timed(max(1, c // 8), s, grpo_group),
    }
    out["stages_ms"] = stage_times(client, fresh, known)
    return out


def stage_times(client: MemoryClient, fresh: Pool, known: Pool, n: int = 40) -> dict[str, float]:
    """Median of ``n`` single calls: embedding a new text alone, the search with a vector alone."""
    embed, search = [], []
    for _ in range(n):
        ((task, _env),) = fresh.take()
        began = time.perf_counter()
        client.embed([task])
        embed.append(time.perf_counter() - began)
        ((task, vector),) = known.take()
        began = time.perf_counter()
        client.retrieve(task, None, 4, vector=vector)
        search.append(time.perf_counter() - began)
    return {
        "embed_new_text": percentile_ms(embed, 50),
        "retrieve_with_vector": percentile_ms(search, 50),
    }


def one_deployment(name: str, overrides: dict[str, Any], data: dict[str, Any], args: argparse.Namespace) -> dict:
    namespace = f"bench-text-{name}"
    config = DeploymentConfig().replace({**ACTORS, **overrides, "cluster.namespace": namespace})
    store = Path(tempfile.mkdtemp(prefix=f"lifemem-text-{name}-"))
    dep.deploy(store, config, shards=2)
    try:
        client = MemoryClient(namespace, config)
        seed, seed_vecs = data["seed"], data["seed_vecs"]
        for i in range(0, len(seed), 500):
            client.add_many(seed[i : i + 500], seed_vecs[i : i + 500]).result(timeout=600)
        result = phases(client, data, args, name)
        result["embedding"] = client.stats().get("embedding")
        return result
    finally:
        dep.stop(namespace)
        dep.remove_store(store)


def prepare(args: argparse.Namespace) -> dict[str, Any]:
    """The same data for both deployments, the vectors computed here once (same model)."""
    local = open_embedder(EmbeddingConfig())
    try:
        seed = list(generate(args.stored, seed=3, envs=ENVS, length_scale=0.1, id_prefix="seed"))
        adds = list(generate(6000, seed=5, envs=ENVS, length_scale=0.1, id_prefix="add"))
        used = {t.task for t in seed} | {t.task for t in adds}
        known = distinct_tasks(400, 99, used)
        used |= {t for t, _ in known}
        fresh = distinct_tasks(20000, 7, used)
        used |= {t for t, _ in fresh}
        text_adds = [
            Trajectory.from_dict({**adds[i % len(adds)].to_dict(), "task": task, "env": env})
            for i, (task, env) in enumerate(distinct_tasks(8000, 13, used))
        ]
        return {
            "seed": seed,
            "seed_vecs": local.embed([t.task for t in seed]),
            "adds": adds,
            "add_vecs": local.embed([t.task for t in adds]),
            "vectors_of": dict(zip([t for t, _ in known], local.embed([t for t, _ in known]), strict=True)),
            "fresh": fresh,
            "text_adds": list(enumerate(text_adds)),
        }
    finally:
        local.close()


def ratios(row: dict) -> dict[str, float]:
    def r(a: str, b: str) -> float:
        return round(row[a]["ops_per_s"] / max(row[b]["ops_per_s"], 1e-9), 2)

    return {
        "text/vector, one at a time": r("retrieve_1_texts", "retrieve_1_vectors"),
        "text/vector, 8 clients": r("retrieve_8_texts", "retrieve_8_vectors"),
        "same text/vector": r("same_text_again", "retrieve_1_vectors"),
        "add texts/vectors, 8 clients": r("add8_8_texts", "add8_8_vectors"),
    }


PHASES = [
    "retrieve_1_vectors",
    "retrieve_1_texts",
    "retrieve_8_vectors",
    "retrieve_8_texts",
    "same_text_again",
    "add8_8_vectors",
    "add8_8_texts",
    "grpo_8x8",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stored", type=int, default=3000)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--clients", type=int, default=8)
    args = ap.parse_args()
    data = prepare(args)
    private_ray(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        rows = {
            "before": one_deployment("before", BEFORE, data, args),
            "after": one_deployment("after", {}, data, args),
        }
    finally:
        ray.shutdown()
    result = {
        "stored": args.stored,
        "seconds": args.seconds,
        "clients": args.clients,
        "rows": rows,
        "ratios": {name: ratios(row) for name, row in rows.items()},
        "after_over_before": {
            p: round(rows["after"][p]["ops_per_s"] / max(rows["before"][p]["ops_per_s"], 1e-9), 2) for p in PHASES
        },
        "issue_figures_for_reference": ISSUE_FIGURES,
    }
    print(json.dumps(result, indent=2))
    print(f"\n{'phase':<20} {'before ops/s':>12} {'p50 ms':>8} {'after ops/s':>12} {'p50 ms':>8} {'after/before':>12}")
    for p in PHASES:
        b, a = rows["before"][p], rows["after"][p]
        print(
            f"{p:<20} {b['ops_per_s']:>12.1f} {b['p50_ms']:>8.1f} {a['ops_per_s']:>12.1f} {a['p50_ms']:>8.1f} "
            f"{result['after_over_before'][p]:>12.2f}"
        )
    for name, r in result["ratios"].items():
        print(f"{name}: {json.dumps(r)}; stages ms {json.dumps(rows[name]['stages_ms'])}")


if __name__ == "__main__":
    main()
