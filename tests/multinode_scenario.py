"""Run as a script: a three-node Ray cluster on one machine (ray.cluster_utils.Cluster),
shards on separate worker nodes, one node removed mid-service, then a restore from the
last snapshot. Prints one JSON report; the test in test_multinode.py checks it.
It runs in its own process because it owns its own Ray cluster."""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

from lifemem_ray.actors.cluster import deployment as dep
from lifemem_ray.actors.cluster.client import MemoryClient
from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.actors.cluster.remote_errors import ShardUnavailableError
from lifemem_ray.lab.synthetic import generate, text_vectors

ACTORS = {
    "cluster.shard_cpus": 0.25,
    "cluster.coordinator_cpus": 0.25,
    "cluster.embedder_cpus": 0.25,
    "cluster.call_timeout_s": 30,
    "cluster.start_timeout_s": 120,
    "cluster.batch_wait_ms": 5,
}


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp())
    report: dict = {}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    # Two nodes marked for shards (as in cluster_configs/), one plain worker that must get none.
    workers = [
        cluster.add_node(num_cpus=2, resources={"lifemem_shard": 1}),
        cluster.add_node(num_cpus=2, resources={"lifemem_shard": 1}),
    ]
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="mn", log_to_driver=False, logging_level="WARNING")
    try:
        config = DeploymentConfig().replace({"cluster.namespace": "mn", **ACTORS})
        info = dep.deploy(root / "store", config, shards=2)
        worker_ids = {w.node_id for w in workers}
        report["shard_nodes"] = info["nodes"]
        report["shards_on_distinct_workers"] = len(set(info["nodes"])) == 2 and set(info["nodes"]) <= worker_ids
        client = MemoryClient("mn", config)
        trajs = list(generate(500, seed=8, length_scale=0.1))
        vecs = text_vectors([t.task for t in trajs])
        client.add_many(trajs[:400], vecs[:400]).result(timeout=300)
        client.maintain()
        report["snapshot"] = client.snapshot(root / "snap")
        report["before"] = client.stats()["trajectories"]

        # A node dies: the shard pinned there cannot come back.
        victim = next(w for w in workers if w.node_id == info["nodes"][1])
        cluster.remove_node(victim)
        time.sleep(2)
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
        report["errors"] = errors
        report["error_seconds"] = round(time.time() - started, 1)
        try:
            dep.stop("mn", timeout_s=30)
        except Exception as exc:  # the dead shard cannot close; its actors are gone anyway
            report["stop_error"] = repr(exc)

        # Back from the last snapshot, on the nodes that are left.
        config2 = DeploymentConfig().replace({"cluster.namespace": "mn2", **ACTORS})
        restored = dep.restore(root / "snap", root / "restored", config2, shards=2)
        report["restored"] = {k: restored[k] for k in ("trajectories", "clusters", "nodes")}
        client2 = MemoryClient("mn2", config2)
        report["after"] = client2.stats()["trajectories"]
        report["verify_ok"] = client2.verify()["ok"]
        hit = client2.retrieve(trajs[0].task, trajs[0].env, vector=vecs[0])
        report["retrieve_after"] = [h.id for h in hit.trajectories]
        dep.stop("mn2")

        # The original store again: shard 1's node is gone, but its files are on this
        # machine, so the live nodes see them and the shard moves to one of them.
        config3 = DeploymentConfig().replace({"cluster.namespace": "mn3", **ACTORS})
        reopened = dep.deploy(root / "store", config3)
        report["reopened_nodes"] = reopened["nodes"]
        report["reopened_on_workers"] = set(reopened["nodes"]) <= worker_ids - {victim.node_id}
        client3 = MemoryClient("mn3", config3)
        report["reopened"] = client3.stats()["trajectories"]
        report["reopened_verify_ok"] = client3.verify()["ok"]
        report["reopened_retrieve"] = [
            h.id for h in client3.retrieve(trajs[0].task, trajs[0].env, vector=vecs[0]).trajectories
        ]
        dep.stop("mn3")
    finally:
        ray.shutdown()
        cluster.shutdown()
    print("REPORT " + json.dumps(report, default=str))


if __name__ == "__main__":
    main()
