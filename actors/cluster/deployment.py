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
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.actors.cluster.coordinator import Coordinator
from lifemem_ray.actors.cluster.coordinator_watch import COORDINATOR, CoordinatorSpec, start_coordinator_actor
from lifemem_ray.actors.cluster.durable_owner import claim_durable_address
from lifemem_ray.actors.cluster.placement import (
    cluster_gpus,
    embedder_name,
    home_node_resource,
    place_shards,
    shard_folder,
    shard_name,
    start_embedder,
    start_shard,
)
from lifemem_ray.actors.cluster.remote_errors import DeploymentNotFoundError, actor_failures
from lifemem_ray.actors.cluster.routing import RoutingTable
from lifemem_ray.core.errors import (
    ConfigError,
    DeploymentExistsError,
    PathExistsError,
    ResourcesUnavailableError,
)
from lifemem_ray.engine.embedding import DIM as MINILM_DIM

__all__ = [
    "COORDINATOR",
    "RESTORE_MARKER",
    "DeploymentPlan",
    "arm_watches",
    "compact",
    "deploy",
    "ending_on_failure",
    "find_coordinator",
    "live_workers",
    "plan_deployment",
    "snapshot",
    "start_coordinator",
    "start_workers",
    "stop",
    "wait_ready",
]

log = logging.getLogger(__name__)

SNAPSHOT_MANIFEST = "snapshot.json"
RESTORE_MARKER = "restoring.json"  # in a store folder while a restore fills it (actors/cluster/restore.py)


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


@dataclass(frozen=True)
class DeploymentPlan:
    """What a start needs, read from (or first written to) the store's routing table."""

    store: Path  # the store folder (its routing table on this node, each shard's folder on its node)
    config: DeploymentConfig  # validated; store.shared_log_owner set to the deployment's id
    deployment_id: str  # the deployment's identity, kept in its routing table (its durable address's owner)
    dim: int  # the vectors' dimension
    nodes: list[str]  # the node of each shard
    shard_names: list[str]  # the shard actors' names
    embedder_names: list[str]  # the embedder actors' names (one per GPU where the cluster has GPUs)
    gpus: int  # GPUs in the cluster now
    home: str  # the resource that places the coordinator on this node, also after it was restarted

    @property
    def namespace(self) -> str:
        return self.config.cluster.namespace

    @property
    def coordinator(self) -> CoordinatorSpec:
        """What the coordinator is started with (by this start, or anew by a shard's watch)."""
        return CoordinatorSpec(
            str(self.store), self.config, self.shard_names, self.embedder_names, self.dim, self.home, Coordinator
        )


def plan_deployment(
    store_dir: str | Path,
    config: DeploymentConfig | None = None,
    *,
    shards: int | None = None,
    dim: int | None = None,
    restoring: bool = False,
) -> DeploymentPlan:
    """The deployment of ``store_dir``: its shard count, dimension, placement and id, its
    durable address claimed for it (before any actor starts).

    Raises:
        DeploymentExistsError: a deployment already runs in the namespace.
        PathExistsError: the folder holds an interrupted restore (and this is not its rerun).
        DurableAddressOwnedError: another deployment owns ``<durable_uri>/<namespace>``.
        ConfigError: ``shards`` differs from the store's.
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
    if (store / RESTORE_MARKER).exists() and not restoring:
        raise PathExistsError(
            f"{store}: a restore into this folder was interrupted ({RESTORE_MARKER}); run the same "
            "`lifemem-ray restore` command again to finish it, or remove the folder"
        )
    routing = RoutingTable(store / "coordinator")  # refused while another deployment serves this store
    try:
        saved = routing.get_meta("deployment")
        deployment_id = (saved or {}).get("deployment_id") or uuid.uuid4().hex
        claim_durable_address(config.cluster, deployment_id, store)
        if saved is not None:
            count = saved["shards"]
            if shards is not None and shards != count:
                raise ConfigError(
                    f"{store} holds {count} shards; to change the count, snapshot and restore into a new store"
                )
            dim = saved["dim"]
            nodes = place_shards(count, saved.get("nodes"), store, durable=bool(config.cluster.durable_uri))
        else:
            count = config.shard_count(shards)
            dim = dim or MINILM_DIM
            nodes = place_shards(count, None)
        record = {"shards": count, "dim": dim, "nodes": nodes, "namespace": ns, "created": time.time()}
        routing.put_meta("deployment", {**record, "deployment_id": deployment_id})
        routing.put_meta("store", str(store))
        routing.put_meta("nodes", nodes)
        home = home_node_resource()
        routing.put_meta("home", home)
    finally:
        routing.close()  # the coordinator takes the store over
    gpus = cluster_gpus()
    return DeploymentPlan(
        store=store,
        config=config.replace({"store.shared_log_owner": deployment_id}),
        deployment_id=deployment_id,
        dim=dim,
        nodes=nodes,
        shard_names=[shard_name(i) for i in range(count)],
        embedder_names=[embedder_name(i) for i in range(max(config.cluster.embedders, gpus))],
        gpus=gpus,
        home=home,
    )


@contextmanager
def ending_on_failure(namespace: str) -> Iterator[list[str]]:
    """The names of the actors started in the block (the block appends them); if the block
    fails, those actors, and only those, are ended: a start that fails never ends actors it
    did not create (a live deployment's, or those of an interrupted restore)."""
    started: list[str] = []
    try:
        yield started
    except BaseException:
        _kill_named(namespace, started)
        raise


def live_workers(plan: DeploymentPlan) -> list[str]:
    """The plan's shard and embedder actors that already run although no coordinator does (it
    died with its node, or was killed): a new start adopts them instead of failing on their
    names, and never ends them. A shard is adopted only if it serves this store's folder.

    Raises:
        DeploymentExistsError: an actor of a shard's name serves another store folder.
    """
    adopted: list[str] = []
    for i, name in enumerate(plan.shard_names):
        try:
            handle = _actor(name, plan.namespace)
        except ValueError:
            continue
        try:
            path = ray.get(handle.info.remote(), timeout=plan.config.cluster.start_timeout_s)["path"]
        except actor_failures(ray.exceptions.GetTimeoutError):  # restarting: its name is held, adopt it
            adopted.append(name)
            continue
        if Path(path).resolve() != (plan.store / shard_folder(i)).resolve():
            raise DeploymentExistsError(
                f"actor {name} in namespace {plan.namespace!r} serves {path}, not {plan.store}: another "
                "deployment's shard; give this one another --namespace, or stop that one first"
            )
        adopted.append(name)
    for name in plan.embedder_names:
        try:
            _actor(name, plan.namespace)
        except ValueError:
            continue
        adopted.append(name)
    if adopted:
        log.warning(
            "namespace %r: adopting %d live actors of %s (%s)", plan.namespace, len(adopted), plan.store, adopted
        )
    return adopted


def start_workers(plan: DeploymentPlan, started: list[str], adopted: Sequence[str] = ()) -> None:
    """The shard and embedder actors of the plan (not waited for), but those ``adopted``."""
    config = plan.config
    for i in range(len(plan.shard_names)):
        if plan.shard_names[i] not in adopted:
            start_shard(i, plan.nodes[i], plan.store, config, plan.dim, plan.coordinator)
            started.append(plan.shard_names[i])
    for i, name in enumerate(plan.embedder_names):
        if name in adopted:
            continue
        start_embedder(name, config, gpu=i < plan.gpus)
        started.append(name)


def start_coordinator(plan: DeploymentPlan, started: list[str]) -> Any:
    """The coordinator (not waited for). It opens the routing table in the store folder of the
    node that started the deployment (a node-local disk, like the shards'): it runs there, and
    comes back there after that node was lost and started again (placed by
    :func:`~.placement.home_node_resource`, which a restarted head has again, not by node id;
    started anew by the shards' watch, :mod:`~.coordinator_watch`); a new coordinator rebuilds
    its routes from the live shards."""
    handle = start_coordinator_actor(plan.coordinator)
    started.append(COORDINATOR)
    return handle


def wait_ready(plan: DeploymentPlan, names: list[str]) -> None:
    """Every named actor answers a ping within ``cluster.start_timeout_s``.

    Raises:
        ResourcesUnavailableError: some did not start (what the deployment needs is named).
    """
    cluster = plan.config.cluster
    pings = [_actor(n, plan.namespace).ping.remote() for n in names]
    ready, waiting = ray.wait(pings, num_returns=len(pings), timeout=cluster.start_timeout_s)
    if waiting:
        need = (
            len(plan.shard_names) * cluster.shard_cpus
            + len(plan.embedder_names) * cluster.embedder_cpus
            + cluster.coordinator_cpus
        )
        raise ResourcesUnavailableError(
            f"the deployment's actors did not start within {cluster.start_timeout_s:.0f} s; it needs {need:g} CPUs "
            f"(cluster.shard_cpus, embedder_cpus, coordinator_cpus) and each shard its node; available now: "
            f"{ray.available_resources().get('CPU', 0):g} CPUs"
        )
    ray.get(ready)


def arm_watches(plan: DeploymentPlan) -> None:
    """Tell every shard that the coordinator runs: its watch starts a new one if it dies for
    good (:mod:`~.coordinator_watch`)."""
    ray.get(
        [_actor(name, plan.namespace).arm_coordinator_watch.remote() for name in plan.shard_names],
        timeout=plan.config.cluster.start_timeout_s,
    )


def deploy(
    store_dir: str | Path, config: DeploymentConfig | None = None, *, shards: int | None = None, dim: int | None = None
) -> dict[str, Any]:
    """Start (or re-attach to) the deployment for ``store_dir``.

    Call after ``ray.init``. An existing store keeps its shard count, node placement and id.
    Shard and embedder actors of this store that still run without a coordinator are adopted.
    A start that fails ends the actors it started, and only those.

    Args:
        store_dir: the deployment's store folder (one shard store under it per shard).
        config: its settings (None: the defaults; ``cluster.namespace`` names it in Ray).
        shards: the shard count of a new store (None: ``cluster.shards``); an existing store keeps its own.
        dim: the vector size of a new store (None: the embedding model's).

    Returns:
        The deployment's description (namespace, shards, embedders, dim, id).

    Raises:
        DeploymentExistsError: another deployment runs in the namespace.
        DurableAddressOwnedError: another deployment owns ``cluster.durable_uri``.
    """
    plan = plan_deployment(store_dir, config, shards=shards, dim=dim)
    try:
        adopted = live_workers(plan)
        with ending_on_failure(plan.namespace) as started:
            start_workers(plan, started, adopted)
            coordinator = start_coordinator(plan, started)
            wait_ready(plan, [*adopted, *started])
            arm_watches(plan)
            ray.get(coordinator.resync.remote())
            return dict(ray.get(coordinator.deployment.remote()))
    except BaseException as exc:
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
    """Close every shard (saving its index cache) and end the deployment's actors; a deployment
    whose coordinator is gone has its live shards and embedders ended too.

    Args:
        namespace: the deployment's Ray namespace.
        timeout_s: how long each actor may take to close.

    Returns:
        Whether a deployment (or leftovers of one) was found and ended.
    """
    try:
        coordinator = find_coordinator(namespace)
    except DeploymentNotFoundError:
        from lifemem_ray.actors.cluster.orphans import stop_orphans

        return bool(stop_orphans(namespace, timeout_s))
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

    Args:
        directory: an empty (or new) folder for the copy.
        namespace: the deployment's Ray namespace.
        timeout_s: how long the copy may take.

    Returns:
        What was copied (per shard: trajectories, bytes; the routing; seconds).

    Raises:
        PathExistsError: ``directory`` is not empty.
        DeploymentNotFoundError: no deployment runs in ``namespace``.
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
            [_actor(n, namespace).snapshot.remote(str(target / shard_folder(i))) for i, n in enumerate(info["shards"])],
            timeout=timeout_s,
        )
        routes = ray.get(coordinator.snapshot_routing.remote(str(target / "coordinator")), timeout=timeout_s)
    manifest = {
        "created": started,
        "seconds": round(time.time() - started, 3),
        "shards": len(info["shards"]),
        "dim": info["dim"],
        "routes": routes,
        "shard_dirs": [shard_folder(i) for i in range(len(info["shards"]))],
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


def remove_store(store_dir: str | Path) -> None:
    """Delete a stopped deployment's files (tests and benchmarks)."""
    shutil.rmtree(store_dir, ignore_errors=True)
