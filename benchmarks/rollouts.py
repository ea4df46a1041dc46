"""Rollout throughput with and without the memory, and what the memory buys (issue 4, section 6).

1. Throughput: N rollout workers (1, 2, 4) run the exemplar agent on a fast environment
   (TextWorldExpress coin by default) twice: without memory, and against a memory
   deployment (retrieve before every episode, submit the trajectory after it; the pool
   counts an episode done once the memory acknowledged it). The with/without ratio shows whether the memory is the
   bottleneck; the retrieve latency p50/p99 is measured under that load.
2. Success: a lifelong run (similarity stream, noisy-gold learning, exemplar agent) with
   the four memory modes; success per environment after learning everything.

Prints JSON, then a table. Usage:
    python benchmarks/rollouts.py [--env twx-coin] [--episodes 300] [--workers 1 2 4] [--success-envs ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import ray
from cpu_share import cpu_seconds, spent  # benchmarks/ (the script's folder)

from lifemem_ray.actors.cluster import deployment as dep
from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.actors.cluster.ray_address import private_ray
from lifemem_ray.actors.rollout.experiment import run_experiment
from lifemem_ray.actors.rollout.workers import EpisodeSpec, RolloutPool
from lifemem_ray.lab.envs import make_env
from lifemem_ray.lab.experiment_config import ExperimentConfig

ACTORS = {"cluster.shard_cpus": 0.25, "cluster.coordinator_cpus": 0.25, "cluster.embedder_cpus": 0.25}


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


def throughput(env_name: str, episodes: int, worker_counts: list[int], seed_tasks: int) -> list[dict]:
    env = make_env(env_name, n_train=episodes + seed_tasks, n_test=1)
    tasks = env.tasks("train")
    env.close()
    seed, load = tasks[:seed_tasks], tasks[seed_tasks : seed_tasks + episodes]
    options = {env_name: {"n_train": episodes + seed_tasks, "n_test": 1}}
    ns = "bench-rollouts"
    config = DeploymentConfig().replace({**ACTORS, "cluster.namespace": ns})
    store = Path(tempfile.mkdtemp(prefix="lifemem-rollouts-"))
    dep.deploy(store, config, shards=2)
    rows = []
    try:
        # Seed the memory with noisy-gold runs so retrieval returns real exemplars.
        with RolloutPool(2, env_options=options, config=config, worker_cpus=0.25) as pool:
            pool.run(
                seed,
                EpisodeSpec(run="seed", phase="learn", mode="lifemem", agent="noisy-gold", namespace=ns, write=True),
            )
        for n in worker_counts:
            for with_memory in (False, True):
                spec = EpisodeSpec(
                    run=f"w{n}-{int(with_memory)}",
                    phase="load",
                    mode="lifemem" if with_memory else "none",
                    agent="exemplar",
                    namespace=ns if with_memory else None,
                    write=with_memory,
                )
                with RolloutPool(n, env_options=options, config=config, worker_cpus=0.25) as pool:
                    pool.run(load[: 2 * n], spec)  # warm: environments created, model loaded
                    spec = EpisodeSpec(**{**spec.__dict__, "run": spec.run + "-m"})
                    started, cpu_before = time.perf_counter(), cpu_seconds()
                    outcomes = pool.run(load, spec)
                    seconds = time.perf_counter() - started
                    cpu = spent(cpu_before, cpu_seconds(), max(1, len(outcomes)))
                ok = [o for o in outcomes if o.error is None]
                steps = sum(o.summary["steps"] for o in ok)
                retrieve = [o.summary["memory_s"] - o.summary["submit_s"] for o in ok]
                ack = [o.summary.get("ack_s", 0.0) for o in ok]  # submitted -> acknowledged, seen by the pool
                rows.append(
                    {
                        "workers": n,
                        "memory": with_memory,
                        "episodes": len(ok),
                        "failed": len(outcomes) - len(ok),
                        "episodes_per_s": round(len(ok) / seconds, 2),
                        "steps_per_s": round(steps / seconds, 1),
                        "success": round(sum(o.success for o in ok) / max(1, len(ok)), 3),
                        "retrieve_p50_ms": round(1000 * _pct(retrieve, 0.5), 2),
                        "retrieve_p99_ms": round(1000 * _pct(retrieve, 0.99), 2),
                        "ack_p50_ms": round(1000 * _pct(ack, 0.5), 2),
                        "ack_p99_ms": round(1000 * _pct(ack, 0.99), 2),
                        "cpu_ms_per_episode": {k: round(1000 * v, 2) for k, v in cpu.items()},
                    }
                )
                print(json.dumps(rows[-1]), file=sys.stderr)
    finally:
        dep.stop(ns)
        dep.remove_store(store)
    for row in rows:
        if row["memory"]:
            base = next(r for r in rows if r["workers"] == row["workers"] and not r["memory"])
            row["ratio_vs_no_memory"] = round(row["episodes_per_s"] / base["episodes_per_s"], 3)
    return rows


def success(envs: list[str], train: int, test: int, workers: int) -> dict:
    out = Path(tempfile.mkdtemp(prefix="lifemem-success-"))
    exp = ExperimentConfig(
        name="bench-success",
        envs=envs,
        train_tasks=train,
        test_tasks=test,
        workers=workers,
        worker_cpus=0.25,
        self_learn=False,
        output=str(out),
    )
    report = run_experiment(exp, DeploymentConfig().replace(ACTORS), progress=None)
    return {
        "per_env": report["success_by_env"],
        "op": {m: r["metrics"]["op"] for m, r in report["modes"].items()},
        "memory": {k: report["memory"].get(k) for k in ("trajectories", "clusters", "mixed_env_clusters")},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--env", default="twx-coin")
    ap.add_argument("--episodes", type=int, default=300)
    ap.add_argument("--seed-tasks", type=int, default=100)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument(
        "--success-envs", nargs="*", default=["twx-coin", "twx-mapreader", "twx-twc", "twx-arithmetic", "twx-sorting"]
    )
    ap.add_argument("--train", type=int, default=30)
    ap.add_argument("--test", type=int, default=20)
    args = ap.parse_args()
    private_ray(num_cpus=8, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    result = {"env": args.env, "throughput": throughput(args.env, args.episodes, args.workers, args.seed_tasks)}
    if args.success_envs:
        result["success"] = success(args.success_envs, args.train, args.test, max(args.workers))
    ray.shutdown()
    print(json.dumps(result, indent=2))
    print(
        f"\n{'workers':>7} {'memory':>6} {'episodes/s':>10} {'steps/s':>8} {'ratio':>6} {'retrieve p50':>12} {'p99':>8} {'ack p50':>10}"
    )
    for r in result["throughput"]:
        print(
            f"{r['workers']:>7} {r['memory']!s:>6} {r['episodes_per_s']:>10.2f} {r['steps_per_s']:>8.1f} "
            f"{r.get('ratio_vs_no_memory', 1.0):>6.2f} {r['retrieve_p50_ms']:>10.1f}ms {r['retrieve_p99_ms']:>6.1f}ms {r['ack_p50_ms']:>8.1f}ms"
        )
    print("CPU ms an episode cost, by process kind:")
    for r in result["throughput"]:
        cpu = r["cpu_ms_per_episode"]
        label = f"{r['workers']} workers, memory {'on' if r['memory'] else 'off'}"
        print(
            f"  {label:<24} {sum(cpu.values()):6.1f} in all: " + ", ".join(f"{k} {v}" for k, v in list(cpu.items())[:7])
        )
    if "success" in result:
        modes = list(result["success"]["per_env"])
        print("\nsuccess after learning every environment (exemplar agent), %")
        print(f"{'env':<18}" + "".join(f"{m:>15}" for m in modes))
        for env in args.success_envs:
            print(
                f"{env:<18}"
                + "".join(f"{result['success']['per_env'][m].get(env, float('nan')):>15.1f}" for m in modes)
            )
        print(f"{'OP':<18}" + "".join(f"{result['success']['op'][m]:>15.1f}" for m in modes))


if __name__ == "__main__":
    main()
