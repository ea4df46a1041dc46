"""Where a retrieve's time goes through the Ray deployment, and what a text costs beside a
vector (issue 26, items 3 and 4).

Starts its own local Ray (2 CPUs, the actors sized for 2 cores; only that Ray is stopped at
the end) and one deployment of 2 shards, seeded with ``--stored`` trajectories whose task texts
come from the released trainset (``../shared/data/lifemem-trainset/*.jsonl``; beyond its 1,202
unique tasks, numbered variants of them: ``<task> (#n)``), generated where the trainset is not
there; steps and observations are generated at the released data's lengths (2.9 kB a
trajectory as JSON), and the seed's vectors are computed here once with the deployment's own
model. Then, through ``MemoryClient``, for ``--seconds`` each:

* retrieve one at a time with vectors, and with texts (each text new: no cache can help);
* ``--clients`` concurrent clients (threads sharing one client) with vectors, and with texts;
* one text retrieved again and again (the caches);
* adds of 8 trajectories from ``--clients`` concurrent clients, with vectors and with texts;
* a GRPO-shaped load: a new prompt retrieved by its 8 rollouts at once, then its 8 trajectories
  added (memory operations/s: 16 a prompt), once with the 8 rollouts sharing one client and
  once with a client each (as separate rollout workers would);
* the stage times of a single retrieve: the embedder call, inside the embedder (and the model
  call alone), the shard calls, inside the shards, Ray's no-op round trip, the merge.

Then (``--scale``, 0 to skip) a second deployment loaded with that many generated trajectories
(vectors made directly, as ``cluster_scale.py``): a single retrieve with a vector against the
same query's time inside the shards (``Memory.retrieve_many`` there, the slower shard).

Every ratio is of figures from this run. ``ISSUE_EARLIER_FIGURES`` are the issue's own
measurement before this work, printed beside for reference only. Usage:

    python benchmarks/client_path.py [--stored 3000] [--seconds 8] [--clients 8] [--scale 100000]
        [--set SECTION.KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import json
import logging
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import ray
from load_timing import percentile_ms, timed, together  # benchmarks/ (the script's folder)
from shard_probes import timed_retrieve_many

from lifemem_ray.actors.client.blocking import MemoryClient
from lifemem_ray.actors.client.rules import one_round_results
from lifemem_ray.actors.cluster import deployment as dep
from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.actors.cluster.ray_address import private_ray
from lifemem_ray.core.model import Trajectory
from lifemem_ray.core.tenancy import DEFAULT_TENANT, search_targets
from lifemem_ray.engine.embedding import open_embedder
from lifemem_ray.engine.memory_config import EmbeddingConfig
from lifemem_ray.lab.synthetic import generate, text_vectors

SHARED = Path(os.environ.get("LIFEMEM_SHARED_DIR", Path(__file__).resolve().parents[2] / "shared"))
TRAINSET = SHARED / "data" / "lifemem-trainset"
ACTORS = {"cluster.shard_cpus": 0.25, "cluster.coordinator_cpus": 0.25, "cluster.embedder_cpus": 0.25}
LENGTH_SCALE = 1.2  # steps and observations at the released data's length (as cluster_scale.py)
K = 4
GROUP = 8  # a GRPO group: one prompt, 8 rollouts
# Issue 26's own measurement on this machine before this work (2 shards, 3,000 stored): for
# reference only, NOT this run's figures. Operations/s (adds: batches of 8/s).
ISSUE_EARLIER_FIGURES = {
    "retrieve_1_vectors": 133,
    "retrieve_1_texts": 30,
    "retrieve_8_vectors": 198,
    "retrieve_8_texts": 30,
    "same_text_again": 31,
    "add8_8_vectors": 43,
    "add8_8_texts": 7,
}
PHASES = [
    "retrieve_1_vectors",
    "retrieve_1_texts",
    "retrieve_8_vectors",
    "retrieve_8_texts",
    "same_text_again",
    "add8_8_vectors",
    "add8_8_texts",
    "grpo_shared_client",
    "grpo_client_each",
]


# -- texts ------------------------------------------------------------------------------------
def trainset_tasks(folder: Path) -> list[tuple[str, str]]:
    """(task, env) of the released trainset, unique tasks round-robin over its files (env: the
    file's name); empty where it is not there."""
    per_file: list[list[tuple[str, str]]] = []
    seen: set[str] = set()
    for path in sorted(folder.glob("*.jsonl")):
        tasks = []
        for line in path.read_text(encoding="utf-8").splitlines():
            task = json.loads(line).get("task")
            if isinstance(task, str) and task.strip() and task not in seen:
                seen.add(task)
                tasks.append((task, path.stem))
        per_file.append(tasks)
    longest = max(map(len, per_file), default=0)
    return [tasks[i] for i in range(longest) for tasks in per_file if i < len(tasks)]


class Texts:
    """Task texts by index, each index its own text: the trainset's tasks, then numbered
    variants of them (generated tasks where there is no trainset). Thread-safe :meth:`fresh`
    hands out indices never used before."""

    def __init__(self, base: list[tuple[str, str]], source: str) -> None:
        self.base = base
        self.source = source
        self._next = itertools.count()
        self._lock = threading.Lock()

    @classmethod
    def load(cls, folder: Path) -> Texts:
        base = trainset_tasks(folder)
        if base:
            return cls(base, f"{folder} (task field, {len(base):,} unique, then numbered variants)")
        generated = {t.task: t.env for t in generate(20_000, seed=11, length_scale=0.1, id_prefix="g")}
        return cls(list(generated.items()), "generated (lifemem_ray.lab.synthetic): no trainset found")

    def at(self, i: int) -> tuple[str, str]:
        task, env = self.base[i % len(self.base)]
        return (task, env) if i < len(self.base) else (f"{task} (#{i // len(self.base)})", env)

    def fresh(self) -> tuple[str, str]:
        with self._lock:
            return self.at(next(self._next))

    def take(self, n: int) -> list[tuple[str, str]]:
        return [self.fresh() for _ in range(n)]


def trajectories(pairs: list[tuple[str, str]], seed: int, prefix: str) -> list[Trajectory]:
    """Generated trajectories (steps at the released data's length) carrying these tasks and envs."""
    made = generate(len(pairs), seed=seed, length_scale=LENGTH_SCALE, id_prefix=prefix)
    return [
        Trajectory.from_dict({**t.to_dict(), "task": task, "env": env})
        for t, (task, env) in zip(made, pairs, strict=True)
    ]


def prepare(args: argparse.Namespace) -> dict[str, Any]:
    """The seed, the known queries and the vector adds with their vectors (the deployment's own
    model, computed here before Ray starts); every later text is new (:class:`Texts`)."""
    texts = Texts.load(args.trainset)
    seed = trajectories(texts.take(args.stored), 3, "seed")
    known = texts.take(400)
    adds = trajectories(texts.take(2_000), 5, "add")
    local = open_embedder(EmbeddingConfig())
    try:
        return {
            "texts": texts,
            "seed": seed,
            "seed_vecs": local.embed([t.task for t in seed]),
            "known": [(task, env, v) for (task, env), v in zip(known, local.embed([t for t, _ in known]), strict=True)],
            "adds": adds,
            "add_vecs": local.embed([t.task for t in adds]),
        }
    finally:
        local.close()


# -- the phases -------------------------------------------------------------------------------
def phases(client: MemoryClient, clients: list[MemoryClient], data: dict[str, Any], args: argparse.Namespace) -> dict:
    """Every throughput phase; each text-in phase draws texts no phase used before."""
    s, c, texts = args.seconds, args.clients, data["texts"]
    known = itertools.cycle(data["known"])
    known_lock = threading.Lock()
    ids = itertools.count()
    repeated = texts.fresh()
    client.retrieve(repeated[0], repeated[1], K)  # embedded once: from then on, cached

    def by_vector() -> int:
        with known_lock:
            task, env, vector = next(known)
        client.retrieve(task, env, K, vector=vector)
        return 1

    def same_text() -> int:
        client.retrieve(repeated[0], repeated[1], K)
        return 1

    def by_text() -> int:
        task, env = texts.fresh()
        client.retrieve(task, env, K)
        return 1

    def renamed(t: Trajectory, **fields: str) -> Trajectory:
        return Trajectory.from_dict({**t.to_dict(), "id": f"a{next(ids)}", **fields})

    def add_with_vectors() -> int:
        at = (next(ids) * GROUP) % (len(data["adds"]) - GROUP)
        batch = [renamed(t) for t in data["adds"][at : at + GROUP]]
        client.add_many(batch, data["add_vecs"][at : at + GROUP]).result(timeout=600)
        return 1

    def add_with_texts() -> int:
        batch = [renamed(data["adds"][i], task=task, env=env) for i, (task, env) in enumerate(texts.take(GROUP))]
        client.add_many(batch).result(timeout=600)
        return 1

    def grpo(rollouts: list[MemoryClient]) -> Callable[[], int]:
        def group() -> int:
            task, env = texts.fresh()
            together([functools.partial(m.retrieve, task, env, K) for m in rollouts])
            client.add_many([renamed(data["adds"][i], task=task, env=env) for i in range(GROUP)]).result(timeout=600)
            return 2 * GROUP

        return group

    return {
        "retrieve_1_vectors": timed(1, s, by_vector),
        "retrieve_1_texts": timed(1, s, by_text),
        "retrieve_8_vectors": timed(c, s, by_vector),
        "retrieve_8_texts": timed(c, s, by_text),
        "same_text_again": timed(1, s, same_text),
        "add8_8_vectors": timed(c, s, add_with_vectors),
        "add8_8_texts": timed(c, s, add_with_texts),
        "grpo_shared_client": timed(1, s, grpo([client] * GROUP)),
        "grpo_client_each": timed(1, s, grpo(clients)),
    }


# -- the stages of one retrieve ---------------------------------------------------------------
def inside_embedder(actor: Any, texts: list[str], model_only: bool) -> float:
    """Seconds of one embedding inside the embedder actor: the service (cache, batcher, model), or the model call alone."""
    began = time.perf_counter()
    (actor.embedder.backend if model_only else actor.embedder).embed(texts)
    return time.perf_counter() - began


def inside_shard(shard: Any, targets: list[str], k: int, vectors: np.ndarray) -> float:
    """Seconds of one ``search_records`` inside a shard actor."""
    began = time.perf_counter()
    shard.search_records(targets, k, vectors, True)
    return time.perf_counter() - began


def stage_times(client: MemoryClient, data: dict[str, Any], n: int = 80) -> dict[str, float]:
    """p50 of each stage of a single retrieve of a new text, each measured alone (ms)."""
    texts, shards, embedder = data["texts"], client.shards, client.embedders[0]
    cfg = client.config.retrieval
    took: dict[str, list[float]] = {}

    def clock(name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        out = fn(*args, **kwargs)
        took.setdefault(name, []).append(time.perf_counter() - began)
        return out

    def noop_round_trip() -> Any:
        return ray.get([s.ping.remote() for s in shards])

    for _ in range(n):
        task, env = texts.fresh()
        clock("retrieve_text", client.retrieve, task, env, K)
        task, env = texts.fresh()
        vec = clock("embed_call", client.embed, [task])
        targets = search_targets(DEFAULT_TENANT, [env])
        # The client's own one-round search (the shard calls, and the merge measured below).
        clock("search_and_merge", client._retrieve_one_round, [task], [env], targets, K, vec, True, cfg.token_budget)
        per_shard = ray.get([s.search_records.remote(targets, K, vec, True) for s in shards])
        clock("merge", one_round_results, [task], [env], per_shard, K, cfg.max_skills, cfg.token_budget)
        clock("retrieve_vector", client.retrieve, task, env, K, vector=vec[0])
        clock("ray_noop_round_trip", noop_round_trip)
        inside = ray.get([s.__ray_call__.remote(inside_shard, targets, K, vec) for s in shards])
        took.setdefault("inside_shards", []).append(max(inside))
        for name, model_only in (("inside_embedder", False), ("model_call", True)):
            took.setdefault(name, []).append(
                ray.get(embedder.__ray_call__.remote(inside_embedder, [texts.fresh()[0]], model_only))
            )
    out = {name: percentile_ms(values, 50) for name, values in took.items()}
    out["shard_calls"] = round(out["search_and_merge"] - out["merge"], 2)
    out["rest_of_text_retrieve"] = round(
        out["retrieve_text"] - out["embed_call"] - out["search_and_merge"], 2
    )  # the client's own work, less what the stages measured alone overlap
    out["embed_hop"] = round(out["embed_call"] - out["inside_embedder"], 2)
    out["embedder_besides_model"] = round(out["inside_embedder"] - out["model_call"], 2)
    out["shard_calls_besides_search"] = round(out["shard_calls"] - out["inside_shards"], 2)
    return out


# -- deployments ------------------------------------------------------------------------------
def deployed(name: str, stored: Path, overrides: dict[str, str]) -> tuple[DeploymentConfig, str]:
    namespace = f"bench-client-path-{name}"
    config = DeploymentConfig().replace({**ACTORS, **overrides, "cluster.namespace": namespace})
    dep.deploy(stored, config, shards=2)
    return config, namespace


def text_path(data: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The 3,000-stored deployment: every phase, then the stage times."""
    store = Path(tempfile.mkdtemp(prefix="lifemem-client-path-"))
    config, namespace = deployed("text", store, args.overrides)
    try:
        client = MemoryClient(namespace, config)
        rollouts = [MemoryClient(namespace, config) for _ in range(GROUP)]
        seed, vecs = data["seed"], data["seed_vecs"]
        for i in range(0, len(seed), 500):
            client.add_many(seed[i : i + 500], vecs[i : i + 500]).result(timeout=600)
        client.maintain()
        for task, env, vector in data["known"][:50]:  # warm: connections, the index's first searches
            client.retrieve(task, env, K, vector=vector)
        result: dict[str, Any] = phases(client, rollouts, data, args)
        result["stages_ms"] = stage_times(client, data)
        result["embedding"] = {k: v for k, v in (client.stats().get("embedding") or {}).items() if k != "replicas"}
        return result
    finally:
        dep.stop(namespace)
        dep.remove_store(store)


def at_scale(n: int, overrides: dict[str, str]) -> dict[str, Any]:
    """A single retrieve with a vector at ``n`` stored against the same query inside the shards."""
    store = Path(tempfile.mkdtemp(prefix="lifemem-client-path-scale-"))
    config, namespace = deployed("scale", store, overrides)
    try:
        client = MemoryClient(namespace, config)
        for part in range(0, n, 20_000):
            made = list(
                generate(min(20_000, n - part), seed=1000 + part, length_scale=LENGTH_SCALE, id_prefix=f"s{part}")
            )
            vecs = text_vectors([t.task for t in made])
            pending = [client.add_many(made[i : i + 2048], vecs[i : i + 2048]) for i in range(0, len(made), 2048)]
            for future in pending:
                future.result(timeout=3600)
        client.maintain()
        queries = list(generate(400, seed=99, length_scale=0.1, id_prefix="q"))
        qvecs = text_vectors([q.task for q in queries])
        for q, v in zip(queries[:50], qvecs[:50], strict=True):  # warm
            client.retrieve(q.task, q.env, K, vector=v)
        through, inside, noop = [], [], []
        for q, v in zip(queries[50:], qvecs[50:], strict=True):
            began = time.perf_counter()
            client.retrieve(q.task, q.env, K, vector=v)
            through.append(time.perf_counter() - began)
            parts = ray.get(
                [s.__ray_call__.remote(timed_retrieve_many, [q.task], [q.env], K, v[None, :]) for s in client.shards]
            )
            inside.append(max(p[1] for p in parts))
            began = time.perf_counter()
            ray.get([s.ping.remote() for s in client.shards])
            noop.append(time.perf_counter() - began)
        return {
            "stored": client.stats()["trajectories"],
            "client_p50_ms": percentile_ms(through, 50),
            "client_p99_ms": percentile_ms(through, 99),
            "in_shard_p50_ms": percentile_ms(inside, 50),
            "ray_noop_round_trip_p50_ms": percentile_ms(noop, 50),
            "client_over_in_shard_p50": round(statistics.median(through) / statistics.median(inside), 2),
        }
    finally:
        dep.stop(namespace)
        dep.remove_store(store)


# -- report -----------------------------------------------------------------------------------
def ratios(row: dict[str, Any]) -> dict[str, float]:
    def r(a: str, b: str) -> float:
        return round(row[a]["ops_per_s"] / max(row[b]["ops_per_s"], 1e-9), 2)

    return {
        "text/vector, one at a time": r("retrieve_1_texts", "retrieve_1_vectors"),
        "text/vector, 8 clients": r("retrieve_8_texts", "retrieve_8_vectors"),
        "same text/vector, one at a time": r("same_text_again", "retrieve_1_vectors"),
        "add texts/vectors, 8 clients": r("add8_8_texts", "add8_8_vectors"),
    }


def print_table(result: dict[str, Any]) -> None:
    rows = result["text_path"]
    print(f"\n{result['stored']:,} stored, 2 shards, {result['seconds']:g} s a phase; texts: {result['texts']}")
    print(f"{'phase':<22}{'ops/s':>9}{'p50 ms':>9}{'p99 ms':>9}   issue's earlier figure (not this run)")
    for p in PHASES:
        row = rows[p]
        earlier = ISSUE_EARLIER_FIGURES.get(p, "")
        print(f"{p:<22}{row['ops_per_s']:>9.1f}{row['p50_ms']:>9.2f}{row['p99_ms']:>9.2f}   {earlier}")
    for name, value in result["ratios"].items():
        print(f"{name:<36}{value:>6.2f}")
    print("stages of a single retrieve, p50 ms (each measured alone):")
    for name, value in rows["stages_ms"].items():
        print(f"  {name:<32}{value:>8.2f}")
    scale = result.get("scale")
    if scale:
        print(
            f"at {scale['stored']:,} stored: client p50 {scale['client_p50_ms']} ms (p99 {scale['client_p99_ms']}), "
            f"in the shards {scale['in_shard_p50_ms']} ms: {scale['client_over_in_shard_p50']}x; "
            f"Ray's no-op round trip to both shards {scale['ray_noop_round_trip_p50_ms']} ms"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stored", type=int, default=3000)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--scale", type=int, default=100_000, help="stored at the scale check (0: skip it)")
    ap.add_argument("--trainset", type=Path, default=TRAINSET)
    ap.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="a setting of both deployments"
    )
    args = ap.parse_args()
    args.overrides = dict(item.split("=", 1) for item in args.set)
    data = prepare(args)
    gc.freeze()  # the benchmark's own data (trajectories, texts) out of the collector's way
    private_ray(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    try:
        rows = text_path(data, args)
        scale = at_scale(args.scale, args.overrides) if args.scale else None
    finally:
        ray.shutdown()  # the Ray this script started, nothing else
    result = {
        "stored": args.stored,
        "seconds": args.seconds,
        "clients": args.clients,
        "settings": args.overrides,
        "texts": data["texts"].source,
        "text_path": rows,
        "ratios": ratios(rows),
        "scale": scale,
        "issue_earlier_figures_not_this_run": ISSUE_EARLIER_FIGURES,
    }
    print(json.dumps(result, indent=2))
    print_table(result)


if __name__ == "__main__":
    main()
