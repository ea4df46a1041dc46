"""Run as a script: a Ray cluster of several nodes on one machine (ray.cluster_utils.Cluster),
shards on separate worker nodes, one node removed mid-service with its disk out of reach (no
durable address), a restore from the last snapshot, then the disk back: the shard keeper
starts the shard again. Prints one JSON report; the test in test_multinode.py checks it. It
runs in its own process because it owns its own Ray cluster."""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import ray
from scenario_cluster import ACTORS, emit_report, local_cluster

from lifemem_ray.actors.client.blocking import MemoryClient
from lifemem_ray.actors.cluster import deployment as dep
from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.actors.cluster.remote_errors import ShardUnavailableError
from lifemem_ray.actors.cluster.restore import restore
from lifemem_ray.lab.synthetic import generate, text_vectors


def first_answer(client: MemoryClient, trajs: list, vecs: np.ndarray) -> list[str]:
    return [h.id for h in client.retrieve(trajs[0].task, trajs[0].env, vector=vecs[0]).trajectories]


def node_lost(client: MemoryClient, trajs: list, vecs: np.ndarray) -> dict:
    """Calls that need the lost shard: each a clear ShardUnavailableError naming it."""
    errors = []
    started = time.time()
    try:
        client.add_many(trajs[400:500], vecs[400:500]).result(timeout=300)
        errors.append("add succeeded")
    except ShardUnavailableError as exc:
        errors.append(f"add: {exc}")
    try:
        client.retrieve(trajs[0].task, trajs[0].env, vector=vecs[0])
        errors.append("retrieve succeeded")
    except ShardUnavailableError as exc:
        errors.append(f"retrieve: {exc}")
    return {"errors": errors, "error_seconds": round(time.time() - started, 1)}


def restored_from_snapshot(root: Path, trajs: list, vecs: np.ndarray) -> dict:
    """Back from the last snapshot, on the nodes that are left."""
    config = DeploymentConfig().replace({"cluster.namespace": "mn2", **ACTORS})
    restored = restore(root / "snap", root / "restored", config, shards=2)
    client = MemoryClient("mn2", config)
    report = {
        "restored": {k: restored[k] for k in ("trajectories", "clusters", "nodes")},
        "after": client.stats()["trajectories"],
        "verify_ok": client.verify()["ok"],
        "retrieve_after": first_answer(client, trajs, vecs),
    }
    dep.stop("mn2")
    return report


def disk_back(root: Path, client: MemoryClient, trajs: list, vecs: np.ndarray) -> dict:
    """The disk is back (on this machine every live node sees it): the shard keeper starts the
    shard on a live shard node, and the first deployment serves again."""
    (root / "shard-01-away").rename(root / "store" / "shard-01")
    back = time.time()
    while time.time() - back < 120:
        try:
            answer = first_answer(client, trajs, vecs)
            break
        except ShardUnavailableError:
            time.sleep(0.5)
    report = {
        "came_back_s": round(time.time() - back, 1),
        "came_back": {
            "trajectories": client.stats()["trajectories"],
            "retrieve": answer,
            "node": ray.get(dep.find_coordinator("mn").deployment.remote())["nodes"][1],
        },
    }
    dep.stop("mn", timeout_s=60)
    return report


def reopened(root: Path, live_workers: set[str], trajs: list, vecs: np.ndarray) -> dict:
    """The original store again: shard 1's node is gone, but its files are on this machine, so
    the live nodes see them and the shard moves to one of them."""
    config = DeploymentConfig().replace({"cluster.namespace": "mn3", **ACTORS})
    info = dep.deploy(root / "store", config)
    client = MemoryClient("mn3", config)
    report = {
        "reopened_nodes": info["nodes"],
        "reopened_on_workers": set(info["nodes"]) <= live_workers,
        "reopened": client.stats()["trajectories"],
        "reopened_verify_ok": client.verify()["ok"],
        "reopened_retrieve": first_answer(client, trajs, vecs),
    }
    dep.stop("mn3")
    return report


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp())
    report: dict = {}
    shard_node = {"num_cpus": 2, "resources": {"lifemem_shard": 1}}
    # Two nodes marked for shards (as in cluster_configs/), one plain worker that must get none.
    with local_cluster("mn", [shard_node, shard_node, {"num_cpus": 1}]) as (cluster, nodes):
        worker_ids = {w.node_id for w in nodes[:2]}
        config = DeploymentConfig().replace({"cluster.namespace": "mn", **ACTORS})
        info = dep.deploy(root / "store", config, shards=2)
        report["shard_nodes"] = info["nodes"]
        report["shards_on_distinct_workers"] = len(set(info["nodes"])) == 2 and set(info["nodes"]) <= worker_ids
        client = MemoryClient("mn", config)
        trajs = list(generate(500, seed=8, length_scale=0.1))
        vecs = text_vectors([t.task for t in trajs])
        client.add_many(trajs[:400], vecs[:400]).result(timeout=300)
        client.maintain()
        report["snapshot"] = client.snapshot(root / "snap")
        report["before"] = client.stats()["trajectories"]
        # A node dies, and its disk is out of reach (moved away here): the shard cannot come back.
        victim = next(w for w in nodes if w.node_id == info["nodes"][1])
        cluster.remove_node(victim)
        (root / "store" / "shard-01").rename(root / "shard-01-away")
        time.sleep(2)
        report.update(node_lost(client, trajs, vecs))
        report.update(restored_from_snapshot(root, trajs, vecs))
        report.update(disk_back(root, client, trajs, vecs))
        report.update(reopened(root, worker_ids - {victim.node_id}, trajs, vecs))
    emit_report(report)


if __name__ == "__main__":
    main()
