"""A new deployment from a snapshot, a single store, or a deployment's durable address, on any
shard count, all or nothing.

A restore writes ``restoring.json`` into the new store folder before anything else, starts
the shards and embedders, has the shards absorb their clusters, and only then starts the
coordinator (which is how clients find a deployment) and removes the marker. So a restore
killed at any moment leaves no deployment a client can reach, and ``serve`` refuses the
folder; running the same command again ends the actors the interrupted run left, re-attaches
to the shard folders it made and absorbs again (absorbing is idempotent: a trajectory already
there is skipped), and finishes. A different command on that folder is refused.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ray

from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.actors.cluster.deployment import (
    COORDINATOR,
    RESTORE_MARKER,
    SNAPSHOT_MANIFEST,
    DeploymentPlan,
    arm_watches,
    ending_on_failure,
    find_coordinator,
    plan_deployment,
    start_coordinator,
    start_workers,
    wait_ready,
)
from lifemem_ray.actors.cluster.placement import EMBEDDER_PREFIX, SHARD_PREFIX
from lifemem_ray.core.errors import DeploymentExistsError, InvalidArgumentError, PathExistsError, PathNotFoundError
from lifemem_ray.core.failpoints import failpoint
from lifemem_ray.engine.store.durable_copy import materialize
from lifemem_ray.engine.store.lmdb_rewrite import fsync_dir
from lifemem_ray.engine.store.shared_log import shard_logs
from lifemem_ray.engine.store.storage import MemoryStore

__all__ = ["parse_accepted_loss", "restore", "restore_sources"]

log = logging.getLogger(__name__)

LEFTOVER_INFO_TIMEOUT_S = 30.0  # asking a leftover shard actor where its files are


def parse_accepted_loss(specs: list[str]) -> dict[str, int]:
    """``["shard-01:12", ...]`` (a shard log's folder and the first entry whose loss is
    accepted) as ``{"shard-01": 12}``.

    Raises:
        InvalidArgumentError: a spec is not ``NAME:ENTRY`` with ASCII digits, or names a shard twice.
    """
    out: dict[str, int] = {}
    for spec in specs:
        name, _, entry = spec.partition(":")
        if not name or not (entry.isascii() and entry.isdigit()) or int(entry) < 1 or len(spec) > 256:
            raise InvalidArgumentError(
                f"--accept-loss {spec[:80]!r}: expected SHARD_LOG:ENTRY, e.g. shard-01:12 (the entry a refused "
                "rebuild named, and everything after it)"
            )
        if name in out:
            raise InvalidArgumentError(f"--accept-loss: {name} is named twice")
        out[name] = int(entry)
    return out


def restore(
    snapshot_dir: str | Path,
    store_dir: str | Path,
    config: DeploymentConfig | None = None,
    *,
    shards: int | None = None,
    accept_loss: dict[str, int] | None = None,
) -> dict[str, Any]:
    """A new deployment in ``store_dir`` holding the snapshot's memory, on ``shards`` shards.

    Whole clusters move: each keeps its id, trajectories, vectors and skill, and goes to the
    shard with the fewest trajectories so far (largest clusters first). A single-process store
    folder is accepted as a snapshot of one shard, and so is a deployment's durable address
    (``<cluster.durable_uri>/<namespace>``: each shard's newest whole checkpoint plus its log,
    read only), for a deployment lost whole or moved to another shard count.

    Args:
        snapshot_dir: the snapshot, store folder or durable address to restore from.
        store_dir: a new, empty folder (or the folder of an interrupted run of this same restore).
        config: the new deployment's settings (its namespace among them).
        shards: the new shard count (default ``cluster.shards``).
        accept_loss: for a durable address, ``{shard log folder: entry}``: the operator accepts
            the loss of that (damaged) entry and every later one of that shard.

    Raises:
        PathExistsError: ``store_dir`` holds something else than an interrupted run of this restore.
        LogDamagedError: a shard log cannot be read back whole (and its loss was not accepted).
    """
    config = (config or DeploymentConfig()).validate()
    target = Path(store_dir).resolve()
    count = config.shard_count(shards)
    request: dict[str, Any] = {
        "source": str(snapshot_dir),
        "shards": count,
        "namespace": config.cluster.namespace,
        "accept_loss": dict(sorted((accept_loss or {}).items())),
    }
    if target.exists() and any(target.iterdir()) and not (target / RESTORE_MARKER).exists():
        raise PathExistsError(f"{target}: restore needs a new, empty store folder")
    with restore_sources(str(snapshot_dir), config.cluster.durable_endpoint_url, accept_loss) as found:
        sources, readable, dim, losses = found
        resumed = _begin(target, request)
        placement, pending_at = _clusters_of(readable)
        loads: list[int] = []
        if resumed == "finished":  # killed after the coordinator started: only the marker was left
            coordinator = find_coordinator(config.cluster.namespace)
        else:
            plan = plan_deployment(target, config, shards=count, dim=dim, restoring=True)
            with ending_on_failure(plan.namespace) as started:
                start_workers(plan, started)
                wait_ready(plan, started)
                failpoint("restore.shards_started")
                loads = _absorb(plan, sources, placement, pending_at, accept_loss or {})
                failpoint("restore.absorbed")
                coordinator = start_coordinator(plan, started)
                wait_ready(plan, [COORDINATOR])
                arm_watches(plan)
        routes = ray.get(coordinator.resync.remote())
        info = dict(ray.get(coordinator.deployment.remote()))
    failpoint("restore.served")
    _finish(target)
    held: list[dict[str, Any]] = ray.get(
        [ray.get_actor(n, namespace=config.cluster.namespace).info.remote() for n in info["shards"]]
    )
    return {
        **info,
        "restored_from": str(snapshot_dir),
        "resumed": resumed != "new",
        "clusters": len(placement),
        "trajectories": sum(h["trajectories"] for h in held),
        "routes": routes,
        "shard_trajectories": loads,
        "accepted_loss": losses,
    }


def _begin(target: Path, request: dict[str, Any]) -> str:
    """The marker of this restore written into a new folder ("new"), or an interrupted run of
    the same restore found: "resumed" (its leftover actors ended) or "finished" (it was killed
    after its coordinator started: everything was absorbed).

    Raises:
        PathExistsError: the folder is not empty and holds no interrupted run of this restore.
    """
    marker = target / RESTORE_MARKER
    if target.exists() and any(target.iterdir()):
        if not marker.exists():
            raise PathExistsError(f"{target}: restore needs a new, empty store folder")
        earlier = json.loads(marker.read_text())
        if earlier != request:
            raise PathExistsError(
                f"{target}: holds an interrupted restore of {earlier.get('source')!r} onto {earlier.get('shards')} "
                f"shards in namespace {earlier.get('namespace')!r}; run that same command again to finish it, "
                "or remove the folder"
            )
        if _end_leftovers(request["namespace"], target):
            return "finished"
        log.warning("%s: resuming an interrupted restore of %s", target, request["source"])
        return "resumed"
    target.mkdir(parents=True, exist_ok=True)
    staging = target / (RESTORE_MARKER + ".tmp")
    with open(staging, "w") as out:
        json.dump(request, out)
        out.flush()
        os.fsync(out.fileno())
    staging.replace(marker)
    fsync_dir(target)
    return "new"


def _finish(target: Path) -> None:
    """The restore is whole: its marker goes (durably), and ``serve`` accepts the folder."""
    (target / RESTORE_MARKER).unlink()
    fsync_dir(target)


def _end_leftovers(namespace: str, target: Path) -> bool:
    """End the actors an interrupted restore into ``target`` left in ``namespace``: its shards
    (each asked where its files are: only those under ``target``) and its embedders (no
    coordinator runs, so they serve no deployment). Returns True, ending nothing, when the
    restore's own coordinator runs (it was killed after everything was absorbed).

    Raises:
        DeploymentExistsError: another deployment (a coordinator) runs in the namespace, or a
            shard actor there holds files elsewhere.
    """
    named: list[Any] = ray.util.list_named_actors(all_namespaces=True)
    names = [str(a["name"]) for a in named if a["namespace"] == namespace]
    if COORDINATOR in names:
        store = ray.get(find_coordinator(namespace).deployment.remote(), timeout=LEFTOVER_INFO_TIMEOUT_S)["store"]
        if Path(store).resolve() == target:
            return True
        raise DeploymentExistsError(
            f"a lifemem-ray deployment of {store} runs in namespace {namespace!r}; stop it (`lifemem-ray stop`) "
            "before finishing the interrupted restore there"
        )
    for name in names:
        handle: Any = ray.get_actor(name, namespace=namespace)
        if name.startswith(SHARD_PREFIX):
            path = ray.get(handle.info.remote(), timeout=LEFTOVER_INFO_TIMEOUT_S)["path"]
            if not Path(path).resolve().is_relative_to(target):
                raise DeploymentExistsError(
                    f"actor {name} in namespace {namespace!r} serves {path}, not the interrupted restore into "
                    f"{target}; stop it first"
                )
        elif not name.startswith(EMBEDDER_PREFIX):
            continue
        ray.kill(handle, no_restart=True)
        log.warning("ended %s, left by the interrupted restore into %s", name, target)
    return False


def _clusters_of(readable: list[Path]) -> tuple[list[tuple[int, int, int]], list[int]]:
    """``(size, source position, cluster id)`` of every live cluster of the sources, and the
    positions of the sources holding unclustered (pending) trajectories."""
    placement: list[tuple[int, int, int]] = []
    pending_at: list[int] = []
    for at, folder in enumerate(readable):
        store = MemoryStore(folder, read_only=True)
        try:
            with store.read() as txn:
                placement += [(r.count, at, r.id) for r in store.iter_clusters(txn) if r.live]
                if store.get_meta("pending", txn):
                    pending_at.append(at)
        finally:
            store.close()
    return placement, pending_at


def _absorb(
    plan: DeploymentPlan,
    sources: list[str],
    placement: list[tuple[int, int, int]],
    pending_at: list[int],
    accept_loss: dict[str, int],
) -> list[int]:
    """Each cluster to the shard with the fewest trajectories so far (largest first); returns
    the trajectories planned per shard."""
    loads = [0] * len(plan.shard_names)
    assignment: dict[tuple[int, int], list[int]] = {}
    for size, at, cid in sorted(placement, key=lambda p: (-p[0], p[2])):
        shard = loads.index(min(loads))
        loads[shard] += size
        assignment.setdefault((shard, at), []).append(cid)
    handles = [ray.get_actor(n, namespace=plan.namespace) for n in plan.shard_names]

    def loss(at: int) -> int | None:
        return accept_loss.get(sources[at].rstrip("/").rsplit("/", 1)[-1])

    ray.get(
        [handles[shard].absorb.remote(sources[at], ids, False, loss(at)) for (shard, at), ids in assignment.items()]
    )
    if pending_at:
        ray.get([handles[0].absorb.remote(sources[at], [], True, loss(at)) for at in pending_at])
    return loads


@contextmanager
def restore_sources(
    source: str, endpoint_url: str = "", accept_loss: dict[str, int] | None = None
) -> Iterator[tuple[list[str], list[Path], int, dict[str, int]]]:
    """``(sources, readable, dim, losses)`` of a restore: what the shards absorb from (snapshot
    shard folders, or shared-log addresses each shard copies from itself), the same as folders
    this process reads to plan (a durable address is copied into a temporary folder, removed
    after), the vectors' dimension, and the losses accepted per shard log.

    Raises:
        InvalidArgumentError: ``accept_loss`` names a shard log the source does not hold, or
            the source is not a durable address.
        PathNotFoundError: the source is none of the three kinds.
    """
    accept_loss = accept_loss or {}
    logs = shard_logs(source, endpoint_url) if "://" in source or (Path(source) / "shard-00").is_dir() else []
    folders = [uri.rstrip("/").rsplit("/", 1)[-1] for uri in logs]
    unknown = sorted(set(accept_loss) - set(folders))
    if unknown:
        raise InvalidArgumentError(
            f"--accept-loss names {', '.join(unknown)}, which {source} does not hold"
            + (f" (its shard logs: {', '.join(folders)})" if folders else " (it is not a durable address)")
        )
    if logs:
        staging = Path(tempfile.mkdtemp(prefix="lifemem-restore-"))
        try:
            readable = [
                materialize(uri, staging / f"source-{i:02d}", endpoint_url, accept_loss_from=accept_loss.get(name))
                for i, (uri, name) in enumerate(zip(logs, folders, strict=True))
            ]
            yield logs, readable, _dim_of(readable[0]), dict(accept_loss)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return
    folder = Path(source).resolve()
    if (folder / SNAPSHOT_MANIFEST).exists():
        manifest = json.loads((folder / SNAPSHOT_MANIFEST).read_text())
        readable = [folder / d for d in manifest["shard_dirs"]]
        yield [str(p) for p in readable], readable, int(manifest["dim"]), {}
    elif (folder / "data.mdb").exists():
        yield [str(folder)], [folder], _dim_of(folder), {}
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
