"""Starting, stopping, snapshotting and restoring a sharded memory on Ray.

A deployment is a set of named, detached actors in one Ray namespace:
``lifemem-shard-<i>`` (pinned to a node, so a restart finds its files),
``lifemem-embedder-<i>`` (one per GPU where the cluster has GPUs) and
``lifemem-coordinator``. They restart on failure and reload from LMDB.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.actors.cluster.coordinator import Coordinator
from lifemem_ray.actors.cluster.embedder import EmbedderActor
from lifemem_ray.actors.cluster.remote_errors import DeploymentNotFoundError, ShardUnavailableError
from lifemem_ray.actors.cluster.routing import RoutingTable
from lifemem_ray.actors.cluster.shard_actor import MemoryShard
from lifemem_ray.core.errors import (
    ConfigError,
    DeploymentExistsError,
    PathExistsError,
    PathNotFoundError,
    ResourcesUnavailableError,
)
from lifemem_ray.engine.embedding import DIM as MINILM_DIM
from lifemem_ray.engine.store.storage import MemoryStore

__all__ = ["COORDINATOR", "compact", "deploy", "find_coordinator", "restore", "snapshot", "stop"]

log = logging.getLogger(__name__)

COORDINATOR = "lifemem-coordinator"
SHARD_RESOURCE = "lifemem_shard"  # nodes offering this custom resource host the shards
SNAPSHOT_MANIFEST = "snapshot.json"


def _shard_name(i: int) -> str:
    return f"lifemem-shard-{i}"


def _embedder_name(i: int) -> str:
    return f"lifemem-embedder-{i}"


def _actor(name: str, namespace: str) -> Any:
    """A named actor's handle. Any: Ray types an actor's methods (``ActorHandle.__getattr__``)
    as Never, which would make each ``handle.method.remote()`` dead code to a type checker."""
    return ray.get_actor(name, namespace=namespace)


def find_coordinator(namespace: str) -> Any:
    try:
        return ray.get_actor(COORDINATOR, namespace=namespace)
    except ValueError:
        raise DeploymentNotFoundError(
            f"no lifemem-ray deployment runs in Ray namespace {namespace!r} (start one with `lifemem-ray serve`)"
        ) from None


def _alive_nodes() -> list[dict[str, Any]]:
    return sorted((n for n in ray.nodes() if n.get("Alive")), key=lambda n: n["NodeID"])


def _placement(shards: int, saved: list[str] | None, store: Path | None = None) -> list[str]:
    """Node per shard: where it lived before (its files are there), else spread over the nodes.
    Nodes with GPUs come first, so shards there can use GPU indices.

    A shard whose node is gone (a Ray restart gives every node a new id) moves to a live
    node that sees its files: the same machine after a restart, or any node of a shared
    filesystem. Only a shard whose files no live node can see is an error."""
    nodes = _alive_nodes()
    alive = {n["NodeID"]: n.get("Resources", {}) for n in nodes}
    if saved and len(saved) == shards:
        placed = list(saved)
        missing = [i for i, node in enumerate(saved) if node not in alive]
        if missing and store is not None:
            seen = _nodes_seeing(sorted(alive), [store / f"shard-{i:02d}" / "data.mdb" for i in missing])
            for i, where in zip(missing, seen, strict=True):
                if where:  # nodes marked for shards first, the head last, then the fewest shards so far
                    placed[i] = min(
                        where,
                        key=lambda node: (
                            not alive[node].get(SHARD_RESOURCE),
                            bool(alive[node].get("node:__internal_head__")),
                            placed.count(node),
                            node,
                        ),
                    )
            missing = [i for i in missing if placed[i] not in alive]
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


def _files_exist(paths: list[str]) -> list[bool]:
    return [Path(p).is_file() for p in paths]


def _nodes_seeing(nodes: list[str], paths: list[Path], timeout_s: float = 60.0) -> list[list[str]]:
    """For each path, the nodes on which it exists (one zero-CPU task per node)."""
    probe = ray.remote(num_cpus=0, max_retries=0)(_files_exist)
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


def deploy(
    store_dir: str | Path, config: DeploymentConfig | None = None, *, shards: int | None = None, dim: int | None = None
) -> dict[str, Any]:
    """Start (or re-attach to) the deployment for ``store_dir``; returns its description.

    Call after ``ray.init``. An existing store keeps its shard count and node placement.
    """
    config = (config or DeploymentConfig()).validate()
    ns = config.cluster.namespace
    try:
        ray.get_actor(COORDINATOR, namespace=ns)
        raise DeploymentExistsError(
            f"a lifemem-ray deployment already runs in namespace {ns!r}; stop it first (`lifemem-ray stop`)"
        )
    except ValueError:
        pass
    store = Path(store_dir).resolve()
    store.mkdir(parents=True, exist_ok=True)
    routing = RoutingTable(store / "coordinator")  # refused while another deployment serves this store
    try:
        saved = routing.get_meta("deployment")
        if saved is not None:
            count = saved["shards"]
            if shards is not None and shards != count:
                raise ConfigError(
                    f"{store} holds {count} shards; to change the count, snapshot and restore into a new store"
                )
            dim = saved["dim"]
            nodes = _placement(count, saved.get("nodes"), store)
        else:
            count = shards or config.cluster.shards
            dim = dim or MINILM_DIM
            nodes = _placement(count, None)
        routing.put_meta(
            "deployment", {"shards": count, "dim": dim, "nodes": nodes, "namespace": ns, "created": time.time()}
        )
        routing.put_meta("store", str(store))
        routing.put_meta("nodes", nodes)
    finally:
        routing.close()  # the coordinator takes the store over

    common = {"namespace": ns, "lifetime": "detached"}
    shard_names = [_shard_name(i) for i in range(count)]
    gpus = int(sum(n.get("Resources", {}).get("GPU", 0) for n in _alive_nodes()))
    embedder_names = [_embedder_name(i) for i in range(max(config.cluster.embedders, gpus))]
    try:
        for i, name in enumerate(shard_names):
            ray.remote(MemoryShard).options(
                name=name,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=nodes[i], soft=False),
                **MemoryShard.ray_options(config),
                **common,
            ).remote(i, str(store / f"shard-{i:02d}"), config, dim)
        for i, name in enumerate(embedder_names):
            ray.remote(EmbedderActor).options(
                name=name, **EmbedderActor.ray_options(config, gpu=i < gpus), **common
            ).remote(config.embedding)
        ray.remote(Coordinator).options(name=COORDINATOR, **Coordinator.ray_options(config), **common).remote(
            str(store), config, shard_names, embedder_names, dim
        )
        coordinator = _actor(COORDINATOR, ns)
        pings = [_actor(n, ns).ping.remote() for n in shard_names + embedder_names] + [coordinator.ping.remote()]
        ready, waiting = ray.wait(pings, num_returns=len(pings), timeout=config.cluster.start_timeout_s)
        if waiting:
            need = (
                count * config.cluster.shard_cpus
                + len(embedder_names) * config.cluster.embedder_cpus
                + config.cluster.coordinator_cpus
            )
            raise ResourcesUnavailableError(
                f"the deployment's actors did not start within {config.cluster.start_timeout_s:.0f} s; it needs {need:g} CPUs "
                f"(cluster.shard_cpus, embedder_cpus, coordinator_cpus) and each shard its node; available now: {ray.available_resources().get('CPU', 0):g} CPUs"
            )
        ray.get(ready)
        ray.get(coordinator.resync.remote())
        return ray.get(coordinator.deployment.remote())
    except BaseException as exc:
        _kill_named(ns, shard_names + embedder_names + [COORDINATOR])  # nothing of a failed start is left running
        cause = getattr(exc, "cause", None)
        if isinstance(cause, DeploymentExistsError):  # the coordinator could not take the store: served meanwhile
            raise DeploymentExistsError(str(cause)) from None
        raise


def _kill_named(namespace: str, names: list[str]) -> None:
    """End the named actors that exist (a deployment that failed to start)."""
    for name in names:
        try:
            ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
        except ValueError:  # never created, or already gone
            pass


def stop(namespace: str = "lifemem", *, timeout_s: float = 120.0) -> bool:
    """Close every shard (saving its index cache) and end the deployment's actors."""
    try:
        coordinator = find_coordinator(namespace)
    except DeploymentNotFoundError:
        return False
    info = ray.get(coordinator.deployment.remote(), timeout=timeout_s)
    try:
        ray.get(coordinator.pause.remote(), timeout=timeout_s)
    except Exception:  # stopping anyway; what was acknowledged is durable
        log.warning("coordinator did not pause before stop", exc_info=True)
    for name in info["shards"]:
        try:
            shard = _actor(name, namespace)
            ray.get(shard.close.remote(), timeout=timeout_s)
            ray.kill(shard, no_restart=True)
        except Exception:
            log.warning("could not close shard %s cleanly", name, exc_info=True)
    for name in info["embedders"] + [COORDINATOR]:
        try:
            ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
        except ValueError:
            pass
    return True


@contextmanager
def _ingest_paused(coordinator: Any, what: str, namespace: str, timeout_s: float) -> Iterator[None]:
    """Ingest held for the block (the micro-batch in flight finishes first), resumed after it
    whatever happens. The block's own error is the one raised; a resume that fails too (the
    coordinator is gone) is logged, not raised over it."""
    token = uuid.uuid4().hex  # pairs the pause with its resume, whichever the actor starts first
    try:
        # Inside the try: a pause that times out still holds (it goes on waiting for the batch
        # in flight, then holds ingest), so it is resumed like one that returned.
        ray.get(coordinator.pause.remote(token), timeout=timeout_s)
        yield
    except BaseException:
        try:
            ray.get(coordinator.resume.remote(token), timeout=timeout_s)
        except Exception:
            log.warning("%s of namespace %r failed, and ingest could not be resumed", what, namespace, exc_info=True)
        raise
    ray.get(coordinator.resume.remote(token), timeout=timeout_s)


def snapshot(directory: str | Path, namespace: str = "lifemem", *, timeout_s: float = 600.0) -> dict[str, Any]:
    """A consistent copy of every shard and the routing table.

    Ingest pauses (the micro-batch in flight finishes first), each shard copies its
    store in one read transaction, record by record into fresh pages (no byte of a deleted
    trajectory is in the copy), then ingest resumes. On a real cluster ``directory`` should
    be a shared filesystem every shard's node can write.
    """
    coordinator = find_coordinator(namespace)
    target = Path(directory).resolve()
    if target.exists() and any(target.iterdir()):
        raise PathExistsError(f"{target}: snapshot folder is not empty")
    target.mkdir(parents=True, exist_ok=True)
    info = ray.get(coordinator.deployment.remote())
    started = time.time()
    with _ingest_paused(coordinator, "snapshot", namespace, timeout_s):
        copies = ray.get(
            [
                _actor(n, namespace).snapshot.remote(str(target / f"shard-{i:02d}"))
                for i, n in enumerate(info["shards"])
            ],
            timeout=timeout_s,
        )
        routes = ray.get(coordinator.snapshot_routing.remote(str(target / "coordinator")), timeout=timeout_s)
    manifest = {
        "created": started,
        "seconds": round(time.time() - started, 3),
        "shards": len(info["shards"]),
        "dim": info["dim"],
        "routes": routes,
        "shard_dirs": [f"shard-{i:02d}" for i in range(len(info["shards"]))],
        "bytes": sum(c["bytes"] for c in copies),
    }
    tmp = target / (SNAPSHOT_MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2))
    tmp.replace(target / SNAPSHOT_MANIFEST)
    return manifest


def compact(namespace: str = "lifemem", *, timeout_s: float = 600.0) -> dict[str, Any]:
    """Every shard of a running deployment rewrites its store in place into fresh pages and
    saves its index cache anew (:meth:`MemoryShard.compact`), so the bytes of deleted
    trajectories that LMDB keeps in free pages and page slack are gone. Ingest pauses
    meanwhile, as for a snapshot; searches go on (each shard holds them only while it swaps
    its data file). Returns per shard the data file's bytes before and after, and the totals."""
    coordinator = find_coordinator(namespace)
    info = ray.get(coordinator.deployment.remote())
    started = time.time()
    with _ingest_paused(coordinator, "compaction", namespace, timeout_s):
        shards = ray.get([_actor(n, namespace).compact.remote() for n in info["shards"]], timeout=timeout_s)
    return {
        "seconds": round(time.time() - started, 3),
        "shards": shards,
        "bytes_before": sum(s["bytes_before"] for s in shards),
        "bytes_after": sum(s["bytes_after"] for s in shards),
    }


def restore(
    snapshot_dir: str | Path,
    store_dir: str | Path,
    config: DeploymentConfig | None = None,
    *,
    shards: int | None = None,
) -> dict[str, Any]:
    """A new deployment in ``store_dir`` holding the snapshot's memory, on ``shards`` shards.

    Whole clusters move: each keeps its id, trajectories, vectors and skill, and goes to
    the shard with the fewest trajectories so far (largest clusters first). A single-
    process store folder is accepted as a snapshot of one shard.
    """
    config = (config or DeploymentConfig()).validate()
    source = Path(snapshot_dir).resolve()
    manifest_path = source / SNAPSHOT_MANIFEST
    if manifest_path.exists():
        manifest = json.loads(manifest_path.read_text())
        sources = [source / d for d in manifest["shard_dirs"]]
        dim = manifest["dim"]
    elif (source / "data.mdb").exists():
        sources = [source]
        store = MemoryStore(source, read_only=True)
        dim = store.dim
        store.close()
    else:
        raise PathNotFoundError(f"{source}: neither a snapshot ({SNAPSHOT_MANIFEST}) nor a store (data.mdb)")
    target = Path(store_dir).resolve()
    if target.exists() and any(target.iterdir()):
        raise PathExistsError(f"{target}: restore needs a new, empty store folder")
    # Which clusters are where, and how big.
    plan: list[tuple[int, Path, int]] = []  # (size, source, cluster id)
    pending_at: list[Path] = []
    for src in sources:
        store = MemoryStore(src, read_only=True)
        try:
            with store.read() as txn:
                for record in store.iter_clusters(txn):
                    if record.live:
                        plan.append((record.count, src, record.id))
                if store.get_meta("pending", txn):
                    pending_at.append(src)
        finally:
            store.close()
    info = deploy(target, config, shards=shards or config.cluster.shards, dim=dim)
    count = len(info["shards"])
    loads = [0] * count
    assignment: dict[tuple[int, Path], list[int]] = {}
    for size, src, cid in sorted(plan, key=lambda p: (-p[0], p[2])):
        shard = loads.index(min(loads))
        loads[shard] += size
        assignment.setdefault((shard, src), []).append(cid)
    ns = config.cluster.namespace
    handles = [_actor(n, ns) for n in info["shards"]]
    moved = ray.get([handles[shard].absorb.remote(str(src), ids, False) for (shard, src), ids in assignment.items()])
    if pending_at:
        ray.get([handles[0].absorb.remote(str(src), [], True) for src in pending_at])
    coordinator = find_coordinator(ns)
    routes = ray.get(coordinator.resync.remote())
    return {
        **info,
        "restored_from": str(source),
        "clusters": len(plan),
        "trajectories": sum(m["trajectories"] - m["skipped"] for m in moved),
        "routes": routes,
        "shard_trajectories": loads,
    }


def remove_store(store_dir: str | Path) -> None:
    """Delete a stopped deployment's files (tests and benchmarks)."""
    shutil.rmtree(store_dir, ignore_errors=True)
