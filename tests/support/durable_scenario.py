"""Run as a script: a Ray cluster of several nodes on one machine (ray.cluster_utils.Cluster)
serving a memory with a durable address (cluster.durable_uri, a folder), one shard node removed
for good and its disk with it (the shard's folder deleted) mid-service. The shard keeper
rebuilds that shard on a spare node from its checkpoint and shared log. Prints one JSON
report; tests/actors/cluster/test_multinode.py checks it. Its own process: it owns its own Ray cluster."""

from __future__ import annotations

import shutil
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
from lifemem_ray.actors.cluster.status import deployment_status
from lifemem_ray.engine.ingest import pack_trajectories
from lifemem_ray.lab.synthetic import generate, text_vectors

SETTINGS = {
    **ACTORS,
    "cluster.namespace": "durable",
    "cluster.node_lost_after_s": 3,
    "cluster.health_check_s": 0.5,
    "cluster.snapshot_every_s": 0,  # checkpoints taken by hand below, at a known point
}
SERVE_AGAIN_BOUND_S = 120.0  # the scenario gives up waiting after this


def answers(client: MemoryClient, trajs: list, vecs: np.ndarray, queries: list[int]) -> list[list[str]]:
    return [[h.id for h in client.retrieve(trajs[q].task, trajs[q].env, vector=vecs[q]).trajectories] for q in queries]


def serving_again(client: MemoryClient, trajs: list, vecs: np.ndarray) -> dict:
    """Retrieve until it answers (bounded): how long the memory did not serve, and what callers got meanwhile."""
    lost = time.monotonic()
    errors: list[str] = []
    while time.monotonic() - lost < SERVE_AGAIN_BOUND_S:
        try:
            client.retrieve(trajs[0].task, trajs[0].env, vector=vecs[0])
            break
        except ShardUnavailableError as exc:
            errors.append(str(exc)[:160])
            time.sleep(0.5)
    return {
        "serving_again_s": round(time.monotonic() - lost, 1),
        "errors_while_down": errors[:3],
        "error_count": len(errors),
    }


def nothing_lost(client: MemoryClient, config: DeploymentConfig, trajs: list, vecs: np.ndarray) -> dict:
    """Every acknowledged id on exactly one shard, with its content; the deep check."""
    batch = pack_trajectories(trajs, vecs, client.dim, config.evolution.workflow_features)
    found = ray.get([s.known.remote(list(batch.ids), list(batch.fingerprints)) for s in client.shards])
    holders = [sum(1 for per_shard in found if per_shard[i] is not None) for i in range(len(trajs))]
    return {
        "after": client.stats()["trajectories"],
        "held_once": holders.count(1),
        "same_content": all(r.status == "duplicate" for per_shard in found for r in per_shard if r is not None),
        "verify_ok": client.verify(deep=True)["ok"],
    }


def adds_after(client: MemoryClient) -> list[str] | str:
    more = list(generate(20, seed=6, length_scale=0.1))
    try:
        return [r.status for r in client.add_many(more, text_vectors([t.task for t in more])).result(timeout=120)]
    except ShardUnavailableError as exc:
        return f"{type(exc).__name__}: {exc}"


def resharded(root: Path, trajs: list, vecs: np.ndarray, queries: list[int], final: list[list[str]]) -> dict:
    """The whole deployment from its durable address alone, on three shards (a reshard)."""
    config = DeploymentConfig().replace({**SETTINGS, "cluster.namespace": "durable3"})
    restored = restore(root / "shared" / "durable", root / "resharded", config, shards=3)
    client = MemoryClient("durable3", config)
    report = {
        "shards": len(restored["shards"]),
        "trajectories": client.stats()["trajectories"],
        "verify_ok": client.verify(deep=True)["ok"],
        # The same trajectories per query; among equal scores (tasks with the same text) the
        # order follows the shards, which a reshard changes.
        "same_answers": [sorted(ids) for ids in answers(client, trajs, vecs, queries)]
        == [sorted(ids) for ids in final],
    }
    dep.stop("durable3", timeout_s=60)
    return report


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp())
    report: dict = {}
    shard_node = {"num_cpus": 1, "resources": {"lifemem_shard": 1}}
    with local_cluster("durable", [shard_node] * 3) as (cluster, workers):
        config = DeploymentConfig().replace({**SETTINGS, "cluster.durable_uri": str(root / "shared")})
        info = dep.deploy(root / "store", config, shards=2)
        client = MemoryClient("durable", config)
        trajs = list(generate(400, seed=5, length_scale=0.1))
        vecs = text_vectors([t.task for t in trajs])
        client.add_many(trajs[:300], vecs[:300]).result(timeout=300)
        client.maintain()
        report["checkpoints"] = ray.get([s.checkpoint.remote() for s in client.shards])
        client.add_many(trajs[300:], vecs[300:]).result(timeout=300)  # acknowledged after the checkpoint
        queries = list(range(0, 400, 37))
        before = answers(client, trajs, vecs, queries)
        report["before"] = client.stats()["trajectories"]
        victim = next(w for w in workers if w.node_id == info["nodes"][1])
        cluster.remove_node(victim)
        shutil.rmtree(root / "store" / "shard-01")  # its disk is gone with it
        report.update(serving_again(client, trajs, vecs))
        report["same_answers"] = answers(client, trajs, vecs, queries) == before
        report.update(nothing_lost(client, config, trajs, vecs))
        status = deployment_status("durable")
        report["status"] = [{k: s.get(k) for k in ("index", "health", "node_id", "durable")} for s in status["shards"]]
        report["moved_to_spare"] = status["shards"][1]["node_id"] not in (victim.node_id, info["nodes"][0])
        report["keeper"] = ray.get(dep.find_coordinator("durable").health.remote())
        report["adds_after"] = adds_after(client)
        final = answers(client, trajs, vecs, queries)
        dep.stop("durable", timeout_s=60)
        report["resharded"] = resharded(root, trajs, vecs, queries, final)
    emit_report(report)


if __name__ == "__main__":
    main()
