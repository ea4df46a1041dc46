"""Where a deployment's shards run: one node per shard, kept where its files are, moved to a
node that sees them when its own is gone, rebuilt from its shared log elsewhere (with
``cluster.durable_uri``) when none does; and starting a shard actor on its node. Used by
:mod:`.deployment` when a deployment starts and by :mod:`.shard_keeper` while it runs."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.actors.cluster.remote_errors import ShardUnavailableError
from lifemem_ray.actors.cluster.shard_actor import MemoryShard

__all__ = [
    "SHARD_RESOURCE",
    "alive_nodes",
    "least_loaded_shard_node",
    "nodes_seeing",
    "place_shards",
    "shard_name",
    "start_shard",
    "this_node_resource",
]

log = logging.getLogger(__name__)

SHARD_RESOURCE = "lifemem_shard"  # nodes offering this custom resource host the shards


SHARD_PREFIX = "lifemem-shard-"  # the shard actors' names: SHARD_PREFIX + index
EMBEDDER_PREFIX = "lifemem-embedder-"  # the embedder actors' names: EMBEDDER_PREFIX + index


def shard_name(i: int) -> str:
    return f"{SHARD_PREFIX}{i}"


def embedder_name(i: int) -> str:
    return f"{EMBEDDER_PREFIX}{i}"


def shard_folder(i: int) -> str:
    """Shard ``i``'s store folder's name, in the deployment's store folder and in a snapshot."""
    return f"shard-{i:02d}"


def this_node_resource() -> str:
    """The ``node:<address>`` resource of the node this process runs on: an actor asking for a
    sliver of it (0.001) is placed on this node. Ray gives every node that resource."""
    here = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == here:
            return f"node:{node['NodeManagerAddress']}"
    return f"node:{ray.util.get_node_ip_address()}"


HEAD_RESOURCE = "node:__internal_head__"  # Ray gives it to the head node, and again to a head restarted after a loss


def home_node_resource() -> str:
    """The resource an actor asks a sliver of (0.001) to live on this process's node, and to
    come back there after that node was restarted: the head's own (:data:`HEAD_RESOURCE`, which
    a head restarted after a loss declares again whatever its address or node id) when this is
    the head node, else this node's ``node:<address>`` (a node started again at the same
    address has it again). Never the node id: a restarted node gets a new one, and an actor
    pinned to the old id is marked dead ("actor_unschedulable")."""
    here = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == here and HEAD_RESOURCE in node.get("Resources", {}):
            return HEAD_RESOURCE
    return this_node_resource()


def alive_nodes() -> list[dict[str, Any]]:
    return sorted((n for n in ray.nodes() if n.get("Alive")), key=lambda n: n["NodeID"])


def place_shards(
    shards: int, saved: list[str] | None, store: Path | None = None, *, durable: bool = False
) -> list[str]:
    """Node per shard: where it lived before (its files are there), else spread over the nodes.
    Nodes with GPUs come first, so shards there can use GPU indices.

    A shard whose node is gone (a Ray restart gives every node a new id) moves to a live
    node that sees its files: the same machine after a restart, or any node of a shared
    filesystem. With ``durable`` (``cluster.durable_uri``) a shard whose files no live node
    sees is rebuilt from its shared log on the shard node with the fewest shards; without,
    that is an error."""
    nodes = alive_nodes()
    alive = {n["NodeID"]: n.get("Resources", {}) for n in nodes}
    if saved and len(saved) == shards:
        placed = list(saved)
        missing = [i for i, node in enumerate(saved) if node not in alive]
        if missing and store is not None:
            seen = nodes_seeing(sorted(alive), [store / shard_folder(i) / "data.mdb" for i in missing])
            for i, where in zip(missing, seen, strict=True):
                if where:
                    placed[i] = least_loaded_shard_node(nodes, placed, among=where)
            missing = [i for i in missing if placed[i] not in alive]
        if missing and durable:
            for i in missing:
                placed[i] = least_loaded_shard_node(nodes, placed)
            log.warning("shards %s rebuilt from their shared logs on %s", missing, [placed[i] for i in missing])
            missing = []
        if missing:
            raise ShardUnavailableError(
                f"shard(s) {missing} are pinned to node(s) that are gone and no live node sees their files "
                f"under {store}; restore the memory from a snapshot into a new deployment"
            )
        if placed != saved:
            log.warning("shards moved to the live nodes that see their files: %s -> %s", saved, placed)
        return placed
    # Nodes marked for shards (custom resource `lifemem_shard`, see cluster_configs/) first;
    # else worker nodes; else any. The head keeps the coordinator.
    marked = [n for n in nodes if n.get("Resources", {}).get(SHARD_RESOURCE)]
    workers = marked or [n for n in nodes if not n.get("Resources", {}).get("node:__internal_head__")] or nodes
    workers.sort(key=lambda n: (-n.get("Resources", {}).get("GPU", 0), n["NodeID"]))
    return [workers[i % len(workers)]["NodeID"] for i in range(shards)]


def least_loaded_shard_node(nodes: list[dict[str, Any]], placed: list[str], among: list[str] | None = None) -> str:
    """The live node for one more shard (of ``among``, when given): nodes marked
    ``lifemem_shard`` first, the head last, then the fewest shards among ``placed``, then the
    node id."""
    allowed = [n for n in nodes if among is None or n["NodeID"] in among]
    if not allowed:
        raise ShardUnavailableError(f"no live node to place a shard on (wanted one of {among})")
    return min(
        allowed,
        key=lambda n: (
            not n.get("Resources", {}).get(SHARD_RESOURCE),
            bool(n.get("Resources", {}).get("node:__internal_head__")),
            placed.count(n["NodeID"]),
            n["NodeID"],
        ),
    )["NodeID"]


def files_exist(paths: list[str]) -> list[bool]:
    return [Path(p).is_file() for p in paths]


def nodes_seeing(nodes: list[str], paths: list[Path], timeout_s: float = 60.0) -> list[list[str]]:
    """For each path, the nodes on which it exists (one zero-CPU task per node)."""
    probe = ray.remote(num_cpus=0, max_retries=0)(files_exist)
    refs = {
        node: probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False)).remote(
            [str(p) for p in paths]
        )
        for node in nodes
    }
    answers: dict[str, list[bool]] = {}
    for node, ref in refs.items():
        try:
            answers[node] = ray.get(ref, timeout=timeout_s)
        except Exception:  # a node that cannot answer is not a place for a shard
            log.warning("node %s did not answer the shard-file probe", node, exc_info=True)
    return [[node for node, seen in answers.items() if seen[i]] for i in range(len(paths))]


def start_shard(index: int, node: str, store: Path, config: DeploymentConfig, dim: int, coordinator: Any = None) -> Any:
    """Start shard ``index`` on ``node`` (a detached, named actor pinned there) over its folder
    ``store/shard-NN`` on that node's disk; with ``cluster.durable_uri``, a folder the node lacks
    is rebuilt from the shard's shared log. ``coordinator``: the deployment's
    :class:`~.coordinator_watch.CoordinatorSpec`, for the shard's coordinator watch. Returns the
    handle (not waited for)."""
    return (
        ray.remote(MemoryShard)
        .options(
            name=shard_name(index),
            namespace=config.cluster.namespace,
            lifetime="detached",
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
            **MemoryShard.ray_options(config),
        )
        .remote(index, str(store / shard_folder(index)), config, dim, coordinator)
    )


def start_embedder(name: str, config: DeploymentConfig, *, gpu: bool) -> Any:
    """Start the detached, named embedder actor ``name`` of the deployment (``gpu``: on one
    GPU). Returns the handle (not waited for).

    Raises:
        ValueError: the name is taken.
    """
    from lifemem_ray.actors.cluster.embedder import EmbedderActor

    namespace = config.cluster.namespace
    return (
        ray.remote(EmbedderActor)
        .options(name=name, namespace=namespace, lifetime="detached", **EmbedderActor.ray_options(config, gpu=gpu))
        .remote(config.embedding, namespace)
    )


def cluster_gpus() -> int:
    """GPUs of the cluster's live nodes."""
    return int(sum(n.get("Resources", {}).get("GPU", 0) for n in alive_nodes()))
