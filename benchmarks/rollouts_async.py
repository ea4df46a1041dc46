"""LLM-driven rollouts with many episodes per worker (issue 26): one worker, 1 episode at a
time against N at once (asyncio), with the memory on (2 shards) and off.

The ReAct agent plays the ``sql`` environment against the local OpenAI-protocol stub
(``tests/support/openai_stub.py``), which answers every call after ``--latency-s`` (500 ms): a
query, then an answer, so each episode takes two LLM calls. With the memory on, every
episode retrieves (lifemem mode: the same environment's exemplars and skills, through the
async client) and submits its trajectory; the worker awaits each acknowledgement before it
reports the task done. The memory is seeded with gold runs first, so retrieval returns
exemplars. One worker (``RolloutPool(1, episodes_per_worker=N)``) with ``llm.concurrency = N``;
each measurement follows a warm-up run on the same pool.

Prints JSON, then a table: episodes/s per setting, the ratio of N at once to 1 (the issue's
target: at least 30x at N = 64), the most calls the stub had in flight at once, and the
retrieve and acknowledgement latencies. Usage::

    python benchmarks/rollouts_async.py [--concurrent 64] [--episodes-single 6] [--episodes-concurrent 256]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # support/openai_stub.py, shared with the tests

import ray
from support.openai_stub import OpenAIStub, Reply

from lifemem_ray.actors.cluster import deployment as dep
from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.actors.cluster.ray_address import private_ray
from lifemem_ray.actors.rollout.workers import EpisodeSpec, RolloutPool, TaskOutcome
from lifemem_ray.lab.envs import Task, make_env

ACTORS = {"cluster.shard_cpus": 0.25, "cluster.coordinator_cpus": 0.25, "cluster.embedder_cpus": 0.25}
NAMESPACE = "bench-rollouts-async"


def react_turn(request: dict[str, Any]) -> Reply | None:
    """The stub's answer to a ReAct turn on sql: a query first, then an answer."""
    if not request["messages"][0]["content"].startswith("You are an agent"):
        return None  # not an agent's turn (the memory's own LLM is off here)
    if "Your steps so far:" not in request["messages"][1]["content"]:
        return Reply.json({"thought": "look at the data first", "action": "Operation: SELECT 1;"})
    return Reply.json({"thought": "answer", "action": "Action: Answer\nFinal Answer: []"})


def _median_ms(values: list[float]) -> float:
    return round(1000 * statistics.median(values), 1) if values else 0.0


def measure(
    pool: RolloutPool, tasks: list[Task], spec: EpisodeSpec, warm: list[Task], stub: OpenAIStub
) -> dict[str, Any]:
    """One measured run on a warm pool: episodes/s and what the stub saw."""
    pool.run(warm, EpisodeSpec(**{**spec.__dict__, "run": spec.run + "-warm"}))
    stub.max_in_flight = 0
    calls = len(stub.requests)
    started = time.perf_counter()
    outcomes: list[TaskOutcome] = pool.run(tasks, spec)
    seconds = time.perf_counter() - started
    ok = [o for o in outcomes if o.error is None]
    return {
        "episodes": len(ok),
        "failed": len(outcomes) - len(ok),
        "seconds": round(seconds, 2),
        "episodes_per_s": round(len(ok) / seconds, 3),
        "llm_calls": len(stub.requests) - calls,
        "max_in_flight": stub.max_in_flight,
        "retrieve_p50_ms": _median_ms([o.summary["memory_s"] - o.summary["submit_s"] for o in ok]),
        "ack_p50_ms": _median_ms([o.summary.get("ack_s", 0.0) for o in ok]),
    }


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    total = args.seed_tasks + 2 * (args.episodes_single + args.episodes_concurrent + args.concurrent + 1)
    env = make_env("sql", n_train=total, n_test=1)
    tasks = env.tasks("train")
    env.close()
    options = {"sql": {"n_train": total, "n_test": 1}}
    seed, rest = tasks[: args.seed_tasks], tasks[args.seed_tasks :]
    rows: list[dict[str, Any]] = []
    store = Path(tempfile.mkdtemp(prefix="lifemem-rollouts-async-"))
    with OpenAIStub(responder=react_turn, latency_s=args.latency_s) as stub:
        base = DeploymentConfig().replace(
            {**ACTORS, "cluster.namespace": NAMESPACE, "llm.base_url": stub.base_url, "llm.model": "stub-agent"}
        )
        dep.deploy(store, base, shards=2)  # the memory's own decisions stay offline: only the agent calls the stub
        try:
            with RolloutPool(1, env_options=options, config=base, worker_cpus=0.25) as pool:
                learn = EpisodeSpec(run="seed", phase="learn", agent="gold", namespace=NAMESPACE, write=True)
                pool.run(seed, learn)
            for memory in (False, True):
                for n, count in ((1, args.episodes_single), (args.concurrent, args.episodes_concurrent)):
                    todo, rest = rest[: count + n], rest[count + n :]
                    spec = EpisodeSpec(
                        run=f"m{int(memory)}-n{n}",
                        phase="load",
                        mode="lifemem" if memory else "none",
                        agent="react",
                        namespace=NAMESPACE if memory else None,
                        write=memory,
                    )
                    config = base.replace({"llm.backend": "openai", "llm.concurrency": max(n, 8), "llm.timeout_s": 30})
                    with RolloutPool(
                        1, env_options=options, config=config, worker_cpus=0.25, episodes_per_worker=n
                    ) as pool:
                        row = {"memory": memory, "episodes_per_worker": n}
                        row.update(measure(pool, todo[n:], spec, todo[:n], stub))
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr)
        finally:
            dep.stop(NAMESPACE)
            dep.remove_store(store)
    for row in rows:
        single = next(r for r in rows if r["memory"] == row["memory"] and r["episodes_per_worker"] == 1)
        row["ratio_vs_1"] = round(row["episodes_per_s"] / single["episodes_per_s"], 2)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrent", type=int, default=64, help="episodes per worker at once")
    ap.add_argument("--episodes-single", type=int, default=6, help="measured episodes at 1 per worker")
    ap.add_argument("--episodes-concurrent", type=int, default=256, help="measured episodes at --concurrent")
    ap.add_argument("--seed-tasks", type=int, default=20, help="gold runs stored before the measurements")
    ap.add_argument("--latency-s", type=float, default=0.5, help="the stub's delay per LLM call")
    args = ap.parse_args()
    private_ray(num_cpus=8, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    started = time.perf_counter()
    rows = run(args)
    ray.shutdown()
    result = {
        "env": "sql",
        "agent": "react",
        "llm_latency_s": args.latency_s,
        "workers": 1,
        "rows": rows,
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(result, indent=2))
    print(
        f"\n{'memory':>6} {'episodes/worker':>15} {'episodes':>8} {'episodes/s':>10} {'ratio':>6} "
        f"{'in flight':>9} {'retrieve p50':>12} {'ack p50':>8}"
    )
    for r in rows:
        print(
            f"{r['memory']!s:>6} {r['episodes_per_worker']:>15} {r['episodes']:>8} {r['episodes_per_s']:>10.2f} "
            f"{r['ratio_vs_1']:>6.1f} {r['max_in_flight']:>9} {r['retrieve_p50_ms']:>10.1f}ms {r['ack_p50_ms']:>6.1f}ms"
        )


if __name__ == "__main__":
    main()
