"""A deployment whose coordinator is gone but whose shards still run: its head node was lost
(without GCS fault tolerance the coordinator dies with it; with it, it comes back by itself),
or the coordinator was killed. What runs, what the shards hold, and the one command that
brings the deployment back (``serve`` adopts the live shards: nothing acknowledged is lost),
for ``status``; and ``stop``, which ends them too.

>>> recovery_command("/srv/lifemem/store", "exp-1")
'lifemem-ray serve --store /srv/lifemem/store --namespace exp-1'
"""

from __future__ import annotations

import logging
import shlex
from pathlib import Path
from typing import Any

import ray

from lifemem_ray.actors.cluster.placement import EMBEDDER_PREFIX, SHARD_PREFIX
from lifemem_ray.actors.cluster.remote_errors import actor_failures

__all__ = ["deployment_actors", "orphan_status", "recovery_command", "stop_orphans"]

log = logging.getLogger(__name__)


def recovery_command(store: str, namespace: str) -> str:
    """The command that serves the deployment again over its live shards."""
    return f"lifemem-ray serve --store {shlex.quote(store)} --namespace {shlex.quote(namespace)}"


def deployment_actors(namespace: str) -> dict[str, Any]:
    """The deployment's named shard and embedder actors in ``namespace`` (Ray's live and
    restarting ones), by name."""
    named: list[Any] = ray.util.list_named_actors(all_namespaces=True)
    names = sorted(
        str(a["name"])
        for a in named
        if a["namespace"] == namespace and str(a["name"]).startswith((SHARD_PREFIX, EMBEDDER_PREFIX))
    )
    found: dict[str, Any] = {}
    for name in names:
        try:
            found[name] = ray.get_actor(name, namespace=namespace)
        except ValueError:  # gone meanwhile
            continue
    return found


def orphan_status(namespace: str, timeout_s: float = 30.0) -> dict[str, Any] | None:
    """What runs of a deployment whose coordinator is gone: each shard's health, node and
    counts, the store folder, and the command that serves it again. None: no shard runs.
    """
    actors = deployment_actors(namespace)
    shards = sorted((n for n in actors if n.startswith(SHARD_PREFIX)), key=lambda n: int(n.removeprefix(SHARD_PREFIX)))
    if not shards:
        return None
    rows, store = [], None
    for name in shards:
        index = int(name.removeprefix(SHARD_PREFIX))
        try:
            details = ray.get(actors[name].info.remote(), timeout=timeout_s)
        except actor_failures(ray.exceptions.GetTimeoutError) as exc:
            why = f"{type(exc).__name__}: {exc}"[:200]
            rows.append({"index": index, "name": name, "health": "down", "why": why, "address": None, "node_id": None})
            continue
        store = store or str(Path(details["path"]).parent)
        rows.append(
            {
                "index": index,
                "name": name,
                "health": "up",
                "node_id": details["node_id"],
                "address": details["address"],
                "trajectories": details["trajectories"],
                "clusters": details["clusters"],
                "durable": None,
            }
        )
    return {
        "namespace": namespace,
        "store": store,
        "coordinator": "down",
        "shards": rows,
        "embedders": sorted(n for n in actors if n.startswith(EMBEDDER_PREFIX)),
        "recover": None if store is None else recovery_command(store, namespace),
    }


def stop_orphans(namespace: str, timeout_s: float = 120.0) -> list[str]:
    """End the shard and embedder actors of a deployment whose coordinator is gone (each shard
    closed first, saving its index cache); returns their names."""
    actors = deployment_actors(namespace)
    for name, handle in actors.items():
        if name.startswith(SHARD_PREFIX):
            try:
                ray.get(handle.close.remote(), timeout=timeout_s)
            except Exception:  # ended anyway; what it acknowledged is durable
                log.warning("could not close shard %s cleanly", name, exc_info=True)
        ray.kill(handle, no_restart=True)
    return sorted(actors)
