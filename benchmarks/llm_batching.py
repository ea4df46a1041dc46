"""What the coordinator's batching saves when an LLM decides (issue 3, section 5).

A local server speaking the OpenAI chat protocol (tests/support/openai_stub.py) answers every
call validly after ``--latency`` seconds (300 ms by default), as a hosted model would.
The same synthetic stream is ingested through a Ray deployment twice:

* batched: micro-batches, several trajectories per assignment call, calls issued
  concurrently, unambiguous joins decided offline, descriptions and skills refreshed
  lazily (the defaults);
* one at a time: micro-batches of one, one trajectory per call, one call in flight,
  every decision asked of the LLM.

It reports trajectories/s for both and their ratio, LLM calls and tokens per 1,000
trajectories per operation, and cluster purity against the generator's labels, also
for the batched run with every decision asked (to show what deciding offline costs).

Usage: python benchmarks/llm_batching.py [--n 1000] [--serial-n 60] [--latency 0.3]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from shard_probes import label_purity
from support.openai_stub import OpenAIStub

from lifemem_ray.actors.client.blocking import MemoryClient
from lifemem_ray.actors.cluster import deployment as dep
from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.actors.cluster.ray_address import private_ray
from lifemem_ray.lab.synthetic import generate, text_vectors

ACTORS = {"cluster.shard_cpus": 0.25, "cluster.coordinator_cpus": 0.25, "cluster.embedder_cpus": 0.25}


def run(name: str, stub_url: str, n: int, overrides: dict, request: int) -> dict:
    trajs = list(generate(n, seed=31, length_scale=0.2))
    vecs = text_vectors([t.task for t in trajs])
    ns = f"llm-{name}"
    config = DeploymentConfig().replace(
        {
            "cluster.namespace": ns,
            "llm.backend": "openai",
            "llm.base_url": stub_url,
            "llm.model": "stub",
            "llm.timeout_s": 30,
            **ACTORS,
            **overrides,
        }
    )
    store = Path(tempfile.mkdtemp(prefix=f"lifemem-{name}-"))
    dep.deploy(store, config, shards=2)
    try:
        client = MemoryClient(ns, config)
        started = time.perf_counter()
        futures = [client.add_many(trajs[i : i + request], vecs[i : i + request]) for i in range(0, n, request)]
        for f in futures:
            f.result(timeout=7200)
        ingest_s = time.perf_counter() - started
        # Skills and descriptions are distilled in the background: wait for them, counted apart.
        t = time.perf_counter()
        client.maintain()
        maintain_s = time.perf_counter() - t
        stats = client.stats()
        purity = ray.get([s.__ray_call__.remote(label_purity, "workflow") for s in client.shards])
        shard_usage = ray.get([s.stats.remote() for s in client.shards])
    finally:
        dep.stop(ns)
    ops: Counter = Counter()
    tokens: Counter = Counter()
    for usage in [stats["coordinator"]["llm"]] + [s["llm"]["by_operation"] for s in shard_usage]:
        for op, v in usage.items():
            ops[op] += int(v.get("calls", 0))
            tokens[op] += int(v.get("prompt_tokens", 0)) + int(v.get("completion_tokens", 0))
    per_k = 1000 / n
    return {
        "n": n,
        "ingest_seconds": round(ingest_s, 2),
        "trajectories_per_s": round(n / ingest_s, 2),
        "background_maintenance_seconds": round(maintain_s, 2),
        "calls_per_1000": {op: round(c * per_k, 1) for op, c in sorted(ops.items())},
        "calls_per_trajectory": round(sum(ops.values()) / n, 3),
        "tokens_per_1000": round(sum(tokens.values()) * per_k),
        "fallbacks": stats["llm"]["fallbacks"],
        "clusters": stats["clusters"],
        "purity": round(sum(p["agree"] for p in purity) / max(1, sum(p["total"] for p in purity)), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--serial-n", type=int, default=60)
    parser.add_argument("--latency", type=float, default=0.3)
    args = parser.parse_args()
    private_ray(num_cpus=4, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    report: dict = {"latency_s": args.latency}
    with OpenAIStub(sensible=True, latency_s=args.latency) as stub:
        report["batched"] = run(
            "batched", stub.base_url, args.n, {"llm.concurrency": 16, "cluster.batch_size": 512}, request=50
        )
        report["batched_ask_every_decision"] = run(
            "ask-all",
            stub.base_url,
            args.n,
            {"llm.concurrency": 16, "cluster.batch_size": 512, "llm.skip_confident": False},
            request=50,
        )
        report["one_at_a_time"] = run(
            "serial",
            stub.base_url,
            args.serial_n,
            {
                "llm.concurrency": 1,
                "llm.items_per_call": 1,
                "llm.skip_confident": False,
                "cluster.batch_size": 1,
                "cluster.batch_wait_ms": 0,
            },
            request=1,
        )
    ray.shutdown()
    b, a, s = report["batched"], report["batched_ask_every_decision"], report["one_at_a_time"]
    report["speedup"] = round(b["trajectories_per_s"] / s["trajectories_per_s"], 1)
    print(json.dumps(report, indent=2))
    print(f"\nLLM decisions with {args.latency * 1000:.0f} ms per call (local OpenAI-protocol server)", file=sys.stderr)
    print(f"{'':<30}{'traj/s':>10}{'calls/traj':>12}{'tokens/1k':>11}{'purity':>8}{'clusters':>9}", file=sys.stderr)
    for name, r in (("batched (defaults)", b), ("batched, LLM for every item", a), ("one call at a time", s)):
        print(
            f"{name:<30}{r['trajectories_per_s']:>10}{r['calls_per_trajectory']:>12}{r['tokens_per_1000']:>11}{r['purity']:>8}{r['clusters']:>9}",
            file=sys.stderr,
        )
    print(
        f"speed-up of batching: {report['speedup']}x (goal >= 30x); calls per 1,000 (batched): {b['calls_per_1000']}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
