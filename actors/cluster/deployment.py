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
import tempfile
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
from lifemem_ray.actors.cluster.placement import alive_nodes, place_shards, shard_name, start_shard
from lifemem_ray.actors.cluster.remote_errors import DeploymentNotFoundError
from lifemem_ray.actors.cluster.routing import RoutingTable
from lifemem_ray.core.errors import (
    ConfigError,
    DeploymentExistsError,
    PathExistsError,
    PathNotFoundError,
    ResourcesUnavailableError,
)
from lifemem_ray.engine.embedding import DIM as MINILM_DIM
from lifemem_ray.engine.store.durable_copy import materialize
from lifemem_ray.engine.store.shared_log import shard_logs
from lifemem_ray.engine.store.storage import MemoryStore

__all__ = [
    "COORDINATOR",
    "compact",
    "deploy",
    "find_coordinator",
    "restore",
    "snapshot",
    "stop",
]

log = logging.getLogger(__name__)

COORDINATOR = "lifemem-coordinator"
SNAPSHOT_MANIFEST = "snapshot.json"


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
            nodes = place_shards(count, saved.get("nodes"), store, durable=bool(config.cluster.durable_uri))
        else:
            count = shards or config.cluster.shards
            dim = dim or MINILM_DIM
            nodes = place_shards(count, None)
        routing.put_meta(
            "deployment", {"shards": count, "dim": dim, "nodes": nodes, "namespace": ns, "created": time.time()}
        )
        routing.put_meta("store", str(store))
        routing.put_meta("nodes", nodes)
    finally:
        routing.close()  # the coordinator takes the store over

    common = {"namespace": ns, "lifetime": "detached"}
    shard_names = [shard_name(i) for i in range(count)]
    gpus = int(sum(n.get("Resources", {}).get("GPU", 0) for n in alive_nodes()))
    embedder_names = [_embedder_name(i) for i in range(max(config.cluster.embedders, gpus))]
    try:
        for i in range(count):
            start_shard(i, nodes[i], store, config, dim)
        for i, name in enumerate(embedder_names):
            ray.remote(EmbedderActor).options(
                name=name, **EmbedderActor.ray_options(config, gpu=i < gpus), **common
            ).remote(config.embedding, ns)
        # The coordinator opens the routing table in the store folder of the node that started the
        # deployment (a node-local disk, like the shards'): it runs there, and restarts there.
        here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
        ray.remote(Coordinator).options(
            name=COORDINATOR, scheduling_strategy=here, **Coordinator.ray_options(config), **common
        ).remote(str(store), config, shard_names, embedder_names, dim)
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
    process store folder is accepted as a snapshot of one shard, and so is a deployment's
    durable address (``<cluster.durable_uri>/<namespace>``: each shard's newest checkpoint plus
    its log, read only), for a deployment lost whole or moved to another shard count.
    """
    config = (config or DeploymentConfig()).validate()
    target = Path(store_dir).resolve()
    if target.exists() and any(target.iterdir()):
        raise PathExistsError(f"{target}: restore needs a new, empty store folder")
    with restore_sources(str(snapshot_dir), config.cluster.durable_endpoint_url) as (sources, readable, dim):
        # Which clusters are where, and how big.
        plan: list[tuple[int, int, int]] = []  # (size, source position, cluster id)
        pending_at: list[int] = []
        for at, folder in enumerate(readable):
            store = MemoryStore(folder, read_only=True)
            try:
                with store.read() as txn:
                    plan += [(r.count, at, r.id) for r in store.iter_clusters(txn) if r.live]
                    if store.get_meta("pending", txn):
                        pending_at.append(at)
            finally:
                store.close()
        info = deploy(target, config, shards=shards or config.cluster.shards, dim=dim)
        count = len(info["shards"])
        loads = [0] * count
        assignment: dict[tuple[int, int], list[int]] = {}
        for size, at, cid in sorted(plan, key=lambda p: (-p[0], p[2])):
            shard = loads.index(min(loads))
            loads[shard] += size
            assignment.setdefault((shard, at), []).append(cid)
        ns = config.cluster.namespace
        handles = [_actor(n, ns) for n in info["shards"]]
        moved = ray.get(
            [handles[shard].absorb.remote(sources[at], ids, False) for (shard, at), ids in assignment.items()]
        )
        if pending_at:
            ray.get([handles[0].absorb.remote(sources[at], [], True) for at in pending_at])
    coordinator = find_coordinator(ns)
    routes = ray.get(coordinator.resync.remote())
    return {
        **info,
        "restored_from": str(snapshot_dir),
        "clusters": len(plan),
        "trajectories": sum(m["trajectories"] - m["skipped"] for m in moved),
        "routes": routes,
        "shard_trajectories": loads,
    }


@contextmanager
def restore_sources(source: str, endpoint_url: str = "") -> Iterator[tuple[list[str], list[Path], int]]:
    """``(sources, readable, dim)`` of a restore: what the shards absorb from (snapshot shard
    folders, or shared-log addresses each shard copies from itself), the same as folders this
    process reads to plan (a durable address is copied into a temporary folder, removed after),
    and the vectors' dimension."""
    logs = shard_logs(source, endpoint_url) if "://" in source or (Path(source) / "shard-00").is_dir() else []
    if logs:
        staging = Path(tempfile.mkdtemp(prefix="lifemem-restore-"))
        try:
            readable = [materialize(uri, staging / f"source-{i:02d}", endpoint_url) for i, uri in enumerate(logs)]
            yield logs, readable, _dim_of(readable[0])
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return
    folder = Path(source).resolve()
    if (folder / SNAPSHOT_MANIFEST).exists():
        manifest = json.loads((folder / SNAPSHOT_MANIFEST).read_text())
        readable = [folder / d for d in manifest["shard_dirs"]]
        yield [str(p) for p in readable], readable, int(manifest["dim"])
    elif (folder / "data.mdb").exists():
        yield [str(folder)], [folder], _dim_of(folder)
    else:
        raise PathNotFoundError(
            f"{folder}: neither a snapshot ({SNAPSHOT_MANIFEST}), a store (data.mdb) nor a durable address (shard-NN logs)"
        )


def _dim_of(folder: Path) -> int:
    store = MemoryStore(folder, read_only=True)
    try:
        return store.dim
    finally:
        store.close()


def remove_store(store_dir: str | Path) -> None:
    """Delete a stopped deployment's files (tests and benchmarks)."""
    shutil.rmtree(store_dir, ignore_errors=True)
