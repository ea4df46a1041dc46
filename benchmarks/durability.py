"""The cost of durability beyond a node (issue 25, item 6), on the multi-host harness, in one run.

Four simulated hosts (``tests/multihost/harness.py``: network namespaces on a private bridge,
a local disk each, one shared folder; root only), Ray from the wheel installed in a fresh
virtual environment, a 2-shard deployment served from the head:

1. Durability off (the stores on the workers' local disks only): ``--threads`` clients on the
   head add batches of ``--batch`` trajectories (with their vectors: no embedding model in the
   way) for ``--seconds``. Throughput, and p50 / p99 of one add (until acknowledged).
2. Durability on (``cluster.durable_uri`` = the shared folder: every committed transaction is
   in the shard's shared log before it is acknowledged; checkpoints every ``--snapshot-every``
   seconds): the same load, on a new deployment. The ratios on / off.
3. A node lost: the "on" deployment is filled to ``--stored`` trajectories, a checkpoint is
   waited for and a few more batches added after it (so a rebuild replays log entries), then
   the worker of shard 1 is killed for good (every process SIGKILLed, its link down, its disk
   deleted). The time until a retrieval through every shard answers again (shard 1 rebuilt on
   the spare worker from its checkpoint and log), split into until the shard keeper acted
   (Ray declaring the node dead, then ``cluster.node_lost_after_s``) and the rebuild itself.

Targets (the issue's): on / off throughput at least 0.7; serving again under 60 s at 100k
stored. Prints JSON, then a table. Usage (as root):
    python benchmarks/durability.py [--stored 100000] [--seconds 30] [--threads 2] [--batch 32]
        [--venv DIR]   # DIR: an environment made by tests/support/wheel_env.py (else one is built)
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests")]

from multihost.harness import Hosts, RayNodes, namespaces_refused  # noqa: E402 - from the test harness, after its path
from multihost.served import Served, wait_until  # noqa: E402
from support.wheel_env import build_dists, fresh_venv  # noqa: E402

SUBNET = ipaddress.ip_network("10.213.81.0/24")  # beside the multihost tests' hosts
THROUGHPUT_TARGET = 0.7
SERVING_TARGET_S = 60.0
BASE = {
    "cluster": {"call_timeout_s": 30, "health_check_s": 1},
    "http": {"read_timeout_s": 30},
}


class BenchmarkError(RuntimeError):
    """The benchmark cannot run here, or a phase failed; the message says which and why."""


@contextmanager
def environment(given: str | None) -> Iterator[Path]:
    """``given``, or the checkout's wheel installed (with its ``s3`` extra) in a new environment."""
    if given:
        yield Path(given)
        return
    work = Path(tempfile.mkdtemp(prefix="lifemem-durability-"))
    try:
        print("building the wheel and a fresh environment (minutes)...", file=sys.stderr)
        yield fresh_venv(build_dists(work / "dist").wheel, work / "venv", extras=["s3"])
    finally:
        shutil.rmtree(work, ignore_errors=True)


def settings(args: argparse.Namespace, durable_uri: str = "") -> dict[str, dict[str, Any]]:
    cluster = {**BASE["cluster"], "node_lost_after_s": args.node_lost_after, "snapshot_every_s": args.snapshot_every}
    if durable_uri:
        cluster["durable_uri"] = durable_uri
    return {"cluster": cluster, "http": BASE["http"]}


def ingest(served: Served, args: argparse.Namespace, name: str) -> dict[str, Any]:
    """The add load of phases 1 and 2 (throughput, p50 / p99 of one add)."""
    spec = {"prefix": f"bench-{name}", "threads": args.threads, "batch": args.batch, "seconds": args.seconds}
    return served.job("bench_add", args.seconds + 600, **spec)


def node_loss(served: Served, hosts: Hosts, ray_nodes: RayNodes, args: argparse.Namespace) -> dict[str, Any]:
    """Phase 3: fill to ``--stored``, checkpoint, a few batches more, lose shard 1's worker."""
    stored = served.lifemem("stats")["trajectories"]
    more = max(0, args.stored - stored)
    preload = served.job("preload", 7200, prefix="fill", count=more, batch=500, threads=2) if more else {}
    first = served.status()["shards"][1]["durable"]["checkpoint_seq"] or 0
    newest = wait_until(
        "a checkpoint of shard 1 after the fill",
        args.snapshot_every * 3 + 600,
        lambda: _checkpoint_after(served, first),
    )
    served.job("preload", 600, prefix="after-checkpoint", count=200, batch=20, threads=1)
    before = served.status()
    victim = served.host_of(before["shards"][1]["address"])
    if victim in (None, 0):
        raise BenchmarkError(f"shard 1 runs on {before['shards'][1]['address']}, not on a worker host")
    killed_at = time.time()
    ray_nodes.kill_node(victim)
    hosts.disconnect(victim)
    shutil.rmtree(hosts.local_path(victim))
    serving = served.job("until_serving", 900, prefix="fill", queries=8, seconds=600)
    if serving["serving_at"] is None:
        raise BenchmarkError(f"the memory did not serve again within 600 s after the loss: {serving}")
    after = served.status()
    shard = after["shards"][1]
    # The keeper records a rebuild once the shard answers, with how long starting it took.
    rebuilds = [h for h in (shard["keeper"] or {}).get("history", []) if h["action"] == "rebuild"]
    acted = [h["at"] - h.get("took_s", 0.0) for h in rebuilds]
    durable = before["shards"][1]["durable"]
    return {
        "stored": served.lifemem("stats")["trajectories"],
        "fill": preload,
        "lost_shard_trajectories": before["shards"][1]["trajectories"],
        "checkpoint_seq": newest,
        "log_entries_after_checkpoint": durable["entries_after_checkpoint"],
        "serving_again_s": round(serving["serving_at"] - killed_at, 1),
        "until_keeper_acted_s": round(acted[0] - killed_at, 1) if acted else None,
        "rebuild_s": rebuilds[0].get("took_s") if rebuilds else None,
        "errors_while_down": serving["errors"],
        "moved": {"from": before["shards"][1]["address"], "to": shard["address"], "health": shard["health"]},
        "shard_0_on": after["shards"][0]["address"],
    }


def _checkpoint_after(served: Served, seq: int) -> int | None:
    durable = served.status()["shards"][1]["durable"] or {}
    newest = durable.get("checkpoint_seq")
    return newest if newest is not None and newest > seq else None


def run(args: argparse.Namespace) -> dict[str, Any]:
    refused = namespaces_refused()
    if refused:
        raise BenchmarkError(f"benchmarks/durability.py runs on the multi-host harness: {refused}")
    with (
        environment(args.venv) as venv,
        Hosts(4, prefix="lmb", subnet=SUBNET) as hosts,
        RayNodes(hosts, venv) as ray_nodes,
    ):
        off = Served.start(hosts, ray_nodes, "bench-off", settings(args), http=False)
        rows = {"off": ingest(off, args, "off")}
        off.stop()
        durable_uri = str(hosts.shared / "durable")
        on = Served.start(hosts, ray_nodes, "bench-on", settings(args, durable_uri), http=False)
        rows["on"] = ingest(on, args, "on")
        loss = node_loss(on, hosts, ray_nodes, args)
        on.stop()
    ratios = {
        "throughput_on_over_off": round(rows["on"]["per_s"] / rows["off"]["per_s"], 2),
        "p50_on_over_off": round(rows["on"]["p50_ms"] / rows["off"]["p50_ms"], 2),
        "p99_on_over_off": round(rows["on"]["p99_ms"] / rows["off"]["p99_ms"], 2),
    }
    return {
        "hosts": "4 (head + 3 workers, 1 CPU each), one machine",
        "durable_uri": "shared folder (hosts.shared)",
        "settings": settings(args, "<shared folder>"),
        "load": {"threads": args.threads, "batch": args.batch, "seconds": args.seconds},
        "ingest": rows,
        "ratios": ratios,
        "loss": loss,
        "targets": {
            "throughput_on_over_off >= 0.7": ratios["throughput_on_over_off"] >= THROUGHPUT_TARGET,
            f"serving again < 60 s (at {loss['stored']} stored; the target is at 100k)": loss["serving_again_s"]
            < SERVING_TARGET_S,
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stored", type=int, default=100_000, help="trajectories stored when the node is lost")
    ap.add_argument("--seconds", type=float, default=30.0, help="length of each ingest phase")
    ap.add_argument("--threads", type=int, default=2, help="clients adding at once")
    ap.add_argument("--batch", type=int, default=32, help="trajectories per add")
    ap.add_argument("--snapshot-every", type=float, default=20.0, help="cluster.snapshot_every_s")
    ap.add_argument("--node-lost-after", type=float, default=10.0, help="cluster.node_lost_after_s")
    ap.add_argument("--venv", help="an environment with the wheel installed (tests/support/wheel_env.py); else built")
    args = ap.parse_args()
    try:
        result = run(args)
    except BenchmarkError as exc:
        sys.exit(f"durability benchmark: {exc}")
    print(json.dumps(result, indent=2))
    print(f"\n{'durability':<12} {'traj/s':>8} {'add p50 ms':>11} {'add p99 ms':>11} {'adds':>6}")
    for name, row in result["ingest"].items():
        print(f"{name:<12} {row['per_s']:>8.1f} {row['p50_ms']:>11.1f} {row['p99_ms']:>11.1f} {row['adds']:>6}")
    ratios, loss = result["ratios"], result["loss"]
    print(
        f"on / off: throughput {ratios['throughput_on_over_off']}, p50 {ratios['p50_on_over_off']}, "
        f"p99 {ratios['p99_on_over_off']}"
    )
    print(
        f"node lost at {loss['stored']} stored ({loss['lost_shard_trajectories']} on the lost shard, "
        f"{loss['log_entries_after_checkpoint']} log entries after its checkpoint): serving again after "
        f"{loss['serving_again_s']} s (keeper acted after {loss['until_keeper_acted_s']} s, rebuild "
        f"{loss['rebuild_s']} s), shard 1 {loss['moved']['from']} -> {loss['moved']['to']}"
    )
    print(f"targets: {json.dumps(result['targets'])}")


if __name__ == "__main__":
    main()
