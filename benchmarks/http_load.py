"""The REST front door under load, beside the in-Ray client, and with a shard killed (issue 16.7).

Loopback only, bounded in time (``--seconds`` per phase). One local Ray, a 2-shard deployment
seeded with ``--seed`` trajectories, the front door on a free loopback port with one API key.

1. In-Ray: ``--clients`` threads call ``MemoryClient`` directly (retrieve one task, or add a
   batch of ``--batch``), the mix set by ``--retrieve-share``.
2. HTTP: ``--clients`` concurrent httpx (async) clients send the same operations as
   ``POST /v1/retrieve`` and ``POST /v1/trajectories``. Throughput and p50 / p99 of both, and
   the HTTP overhead as ratios. Every answer must be a 2xx: the coordinator's queue is bounded
   and waits, it does not fail, at this load.
3. Fault: the HTTP load again, and a third of the way in shard 0 is killed (``ray.kill`` with
   restart). Answers while it restarts are 503 with ``Retry-After``; clients wait that long (at
   most ``--max-wait``) and send the same batch again. Afterwards every acknowledged id must be
   there: the tenant's trajectory count equals the seed plus every id acknowledged.

Prints JSON, then a table. Usage:
    python benchmarks/http_load.py [--clients 4] [--seconds 10] [--batch 8] [--seed 300]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import ray
from cpu_share import cpu_seconds, spent  # benchmarks/ (the script's folder)

from lifemem_ray.actors.client.blocking import MemoryClient
from lifemem_ray.actors.cluster import deployment as dep
from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.actors.cluster.ray_address import private_ray
from lifemem_ray.actors.frontdoor.app import start_http, stop_http
from lifemem_ray.core.model import Trajectory
from lifemem_ray.lab.synthetic import generate
from lifemem_ray.service.auth import KeyRing, new_key

ACTORS = {
    "cluster.shard_cpus": 0.25,
    "cluster.coordinator_cpus": 0.25,
    "cluster.embedder_cpus": 0.25,
    "http.replica_cpus": 0.25,
}
TENANT = "bench"
ENVS = ["shop", "sql", "retail", "airline"]


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Feed:
    """Fresh trajectories (unique ids) and query tasks, shared by every client of a phase."""

    def __init__(self, prefix: str, seed: int) -> None:
        self._source = generate(10**7, seed=seed, envs=ENVS, length_scale=0.1, id_prefix=prefix)
        self._lock = threading.Lock()

    def batch(self, n: int) -> list[Trajectory]:
        with self._lock:
            return [next(self._source) for _ in range(n)]


class Queries:
    """What a retrieve asks for: one of the stored tasks (``seed``: texts met again, as a
    fleet's repeated tasks are; the caches serve them after the first time) or a task never
    sent before (``new``: each text is a model call)."""

    def __init__(self, mode: str, tasks: list[tuple[str, str]], prefix: str) -> None:
        self._mode, self._tasks = mode, tasks
        self._fresh = Feed(f"q-{prefix}", 404 + len(prefix))
        self._sent: set[str] = {task for task, _ in tasks}

    def next(self, rng: random.Random) -> tuple[str, str]:
        if self._mode == "seed":
            return rng.choice(self._tasks)
        while True:
            t = self._fresh.batch(1)[0]
            if t.task not in self._sent:  # a generated task can repeat a template's text
                self._sent.add(t.task)
                return t.task, t.env


def _summary(
    name: str, latencies: dict[str, list[float]], seconds: float, errors: dict[str, int], extra: dict | None = None
) -> dict:
    ops = sum(len(v) for v in latencies.values())
    row = {
        "phase": name,
        "seconds": round(seconds, 2),
        "ops": ops,
        "ops_per_s": round(ops / seconds, 1),
        "errors": dict(errors),
    }
    for op, values in latencies.items():
        row[op] = {
            "n": len(values),
            "per_s": round(len(values) / seconds, 1),
            "p50_ms": round(1000 * _pct(values, 0.5), 2),
            "p99_ms": round(1000 * _pct(values, 0.99), 2),
        }
    row.update(extra or {})
    return row


def with_cpu(phase: Callable[[], dict]) -> dict:
    """``phase()``'s row, with the CPU milliseconds an operation cost each kind of process."""
    before = cpu_seconds()
    row = phase()
    row["cpu_ms_per_op"] = {k: round(1000 * v, 2) for k, v in spent(before, cpu_seconds(), max(1, row["ops"])).items()}
    return row


def in_ray(client: MemoryClient, tasks: list[tuple[str, str]], args: argparse.Namespace) -> dict:
    feed, latencies, errors = Feed("ray", 101), {"retrieve": [], "add": []}, {}
    queries = Queries(args.queries, tasks, "ray")
    stop = time.monotonic() + args.seconds
    lock = threading.Lock()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < stop:
            started = time.perf_counter()
            try:
                if rng.random() < args.retrieve_share:
                    task, env = queries.next(rng)
                    client.retrieve_many([task], [env], args.k, tenant=TENANT)
                    op = "retrieve"
                else:
                    client.add_many([_tenanted(t) for t in feed.batch(args.batch)]).result()
                    op = "add"
            except Exception as exc:  # counted: the in-Ray client should not fail either
                with lock:
                    errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                continue
            with lock:
                latencies[op].append(time.perf_counter() - started)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(args.clients)]
    began = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return _summary("in-ray MemoryClient", latencies, time.monotonic() - began, errors)


def _tenanted(t: Trajectory) -> Trajectory:
    return Trajectory.from_dict({**t.to_dict(), "tenant": TENANT})


async def _http_phase(
    url: str, key: str, tasks: list[tuple[str, str]], args: argparse.Namespace, name: str, kill: Any = None
) -> dict:
    """The HTTP load; ``kill`` (a callable) runs a third of the way in. Adds refused with 503 are
    sent again after Retry-After until acknowledged (every acknowledged id is returned)."""
    feed = Feed("http" if kill is None else "fault", 202 if kill is None else 303)
    queries = Queries(args.queries, tasks, name)
    latencies: dict[str, list[float]] = {"retrieve": [], "add": []}
    errors: dict[str, int] = {}
    acked: set[str] = set()
    unavailable = {"count": 0, "with_retry_after": 0, "first": None, "last": None}
    began = time.monotonic()
    stop = began + args.seconds
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)

    async def send(http: httpx.AsyncClient, path: str, body: dict) -> httpx.Response:
        while True:
            r = await http.post(path, json=body)
            if r.status_code != 503:
                return r
            now = time.monotonic() - began
            unavailable["count"] += 1
            unavailable["with_retry_after"] += "retry-after" in r.headers
            unavailable["first"] = unavailable["first"] if unavailable["first"] is not None else round(now, 2)
            unavailable["last"] = round(now, 2)
            if time.monotonic() > stop + args.drain:
                return r
            await asyncio.sleep(min(args.max_wait, float(r.headers.get("retry-after", 1))))

    async def client(seed: int, http: httpx.AsyncClient) -> None:
        rng = random.Random(seed)
        while time.monotonic() < stop:
            started = time.perf_counter()
            if rng.random() < args.retrieve_share:
                task, env = queries.next(rng)
                op, r = (
                    "retrieve",
                    await send(http, "/v1/retrieve", {"queries": [{"task": task, "env": env}], "k": args.k}),
                )
            else:
                batch = [t.to_dict() for t in feed.batch(args.batch)]
                op, r = "add", await send(http, "/v1/trajectories", {"trajectories": batch})
                if r.status_code == 200:
                    acked.update(i["id"] for i in r.json()["items"])
            if r.status_code == 200:
                latencies[op].append(time.perf_counter() - started)
            else:
                errors[str(r.status_code)] = errors.get(str(r.status_code), 0) + 1

    async def killer() -> float | None:
        if kill is None:
            return None
        await asyncio.sleep(args.seconds / 3)
        await asyncio.to_thread(kill)
        return round(time.monotonic() - began, 2)

    async with httpx.AsyncClient(
        base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=600, limits=limits
    ) as http:
        results = await asyncio.gather(killer(), *[client(i, http) for i in range(args.clients)])
    extra = {"acknowledged_ids": len(acked), "unavailable_503": unavailable}
    if kill is not None:
        extra["killed_at_s"] = results[0]
    row = _summary(name, latencies, time.monotonic() - began, errors, extra)
    row["_acked"] = acked
    return row


def _wait_healthy(url: str, timeout_s: float = 300) -> float:
    began = time.monotonic()
    while time.monotonic() - began < timeout_s:
        try:
            if httpx.get(f"{url}/healthz", timeout=10).status_code == 200:
                return time.monotonic() - began
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{url}/healthz did not answer 200 within {timeout_s} s")


def run(args: argparse.Namespace) -> dict:
    private_ray(num_cpus=max(4, args.clients), include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    namespace = "bench-http"
    config = DeploymentConfig().replace(
        {
            **ACTORS,
            "cluster.namespace": namespace,
            "cluster.batch_wait_ms": 5,
            "http.read_timeout_s": args.read_timeout,
            "http.retry_after_s": 1,
        }
    )
    store = Path(tempfile.mkdtemp(prefix="lifemem-http-load-"))
    dep.deploy(store, config, shards=2)
    key, entry = new_key(TENANT, "read,write", name="bench")
    url = start_http(namespace, config, KeyRing.from_entries([entry]), host="127.0.0.1", port=_free_port())["url"]
    try:
        _wait_healthy(url)
        client = MemoryClient(namespace, config)
        seed = [_tenanted(t) for t in generate(args.seed, seed=7, envs=ENVS, length_scale=0.1, id_prefix="seed")]
        for i in range(0, len(seed), 100):
            client.add_many(seed[i : i + 100]).result()
        tasks = [(t.task, t.env) for t in seed]
        rows = [with_cpu(lambda: in_ray(client, tasks, args))]
        rows.append(with_cpu(lambda: asyncio.run(_http_phase(url, key, tasks, args, "http"))))
        before = client.stats(tenant=TENANT)["trajectories"]

        def kill() -> None:
            ray.kill(client.shards[0], no_restart=False)

        fault = with_cpu(lambda: asyncio.run(_http_phase(url, key, tasks, args, "http shard-kill", kill)))
        fault["recovered_after_s"] = round(_wait_healthy(url), 2)
        after = MemoryClient(namespace, config).stats(tenant=TENANT)["trajectories"]
        fault["count_check"] = {
            "before": before,
            "acknowledged": len(fault["_acked"]),
            "after": after,
            "nothing_lost": after == before + len(fault["_acked"]),
        }
        rows.append(fault)
        for row in rows:
            row.pop("_acked", None)
        base, over = rows[0], rows[1]
        ratios = {
            op: {
                "p50": round(over[op]["p50_ms"] / base[op]["p50_ms"], 2),
                "p99": round(over[op]["p99_ms"] / base[op]["p99_ms"], 2),
                "throughput": round(over[op]["per_s"] / base[op]["per_s"], 2),
            }
            for op in ("retrieve", "add")
            if base.get(op, {}).get("n") and over.get(op, {}).get("n")
        }
        return {
            "clients": args.clients,
            "seconds": args.seconds,
            "batch": args.batch,
            "k": args.k,
            "seed": args.seed,
            "retrieve_share": args.retrieve_share,
            "queries": args.queries,
            "rows": rows,
            "http_over_in_ray": ratios,
        }
    finally:
        stop_http(namespace)
        from ray import serve

        serve.shutdown()
        dep.stop(namespace)
        dep.remove_store(store)
        ray.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=10.0, help="length of each phase")
    ap.add_argument("--batch", type=int, default=8, help="trajectories per add")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--seed", type=int, default=300, help="trajectories stored before the load")
    ap.add_argument("--retrieve-share", type=float, default=0.8)
    ap.add_argument(
        "--queries",
        choices=("seed", "new"),
        default="seed",
        help="retrieve the stored tasks (texts met again) or a text never sent before each time",
    )
    ap.add_argument("--max-wait", type=float, default=1.0, help="most seconds a client waits on Retry-After")
    ap.add_argument(
        "--read-timeout",
        type=float,
        default=1.5,
        help="http.read_timeout_s: a retrieve the shards do not answer by then (a restart) is a 503",
    )
    ap.add_argument(
        "--drain", type=float, default=120.0, help="seconds after the phase an unacknowledged add keeps retrying"
    )
    args = ap.parse_args()
    result = run(args)
    print(json.dumps(result, indent=2))
    print(
        f"\n{'phase':<22} {'ops/s':>7} {'retr/s':>7} {'r p50':>7} {'r p99':>7} {'add/s':>6} {'a p50':>7} {'a p99':>7} {'errors':>8}"
    )
    for r in result["rows"]:
        ret, add = r.get("retrieve", {}), r.get("add", {})
        print(
            f"{r['phase']:<22} {r['ops_per_s']:>7.1f} {ret.get('per_s', 0):>7.1f} {ret.get('p50_ms', 0):>7.1f} {ret.get('p99_ms', 0):>7.1f} "
            f"{add.get('per_s', 0):>6.1f} {add.get('p50_ms', 0):>7.1f} {add.get('p99_ms', 0):>7.1f} {sum(r['errors'].values()):>8}"
        )
    print(f"HTTP / in-Ray: {json.dumps(result['http_over_in_ray'])}")
    print("CPU ms an operation cost, by process kind (2 cores: at most 2,000 ms of CPU a second in all):")
    for r in result["rows"]:
        cpu = r["cpu_ms_per_op"]
        print(
            f"  {r['phase']:<22} {sum(cpu.values()):6.1f} in all: "
            + ", ".join(f"{k} {v}" for k, v in list(cpu.items())[:7])
        )
    fault = result["rows"][-1]
    print(
        f"shard killed at {fault.get('killed_at_s')} s: {fault['unavailable_503']['count']} answers 503 "
        f"({fault['unavailable_503']['with_retry_after']} with Retry-After), healthy again after {fault['recovered_after_s']} s; "
        f"count check {fault['count_check']}"
    )
    sys.exit(0 if fault["count_check"]["nothing_lost"] else 1)


if __name__ == "__main__":
    main()
