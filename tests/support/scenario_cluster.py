"""The Ray cluster of a scenario script (several nodes on one machine,
``ray.cluster_utils.Cluster``) and how it reports: one ``REPORT <json>`` line that
tests/actors/cluster/test_multinode.py reads."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray
from ray.cluster_utils import Cluster

# Small actors: a scenario's nodes share this machine's two cores.
ACTORS = {
    "cluster.shard_cpus": 0.25,
    "cluster.coordinator_cpus": 0.25,
    "cluster.embedder_cpus": 0.25,
    "cluster.call_timeout_s": 30,
    "cluster.start_timeout_s": 120,
    "cluster.batch_wait_ms": 5,
}


@contextmanager
def local_cluster(namespace: str, workers: list[dict[str, Any]]) -> Iterator[tuple[Cluster, list[Any]]]:
    """A head (1 CPU) and one node per entry of ``workers`` (``add_node`` arguments), joined by
    this process in ``namespace``; everything ends on exit."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        nodes = [cluster.add_node(**worker) for worker in workers]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace=namespace, log_to_driver=False, logging_level="WARNING")
        yield cluster, nodes
    finally:
        ray.shutdown()
        cluster.shutdown()


def emit_report(report: dict[str, Any]) -> None:
    print("REPORT " + json.dumps(report, default=str))
