"""What an operator needs to see of a running deployment (``lifemem-ray status``): per shard,
its node and address, whether it answers (up, down, or deposed: another writer took its
shared log over, and it refuses writes), what it holds, and its durability (the shared log's
head, the newest checkpoint and its age, the entries a rebuild would replay, how far this
copy is behind the log, this writer's epoch), beside what the shard keeper did."""

from __future__ import annotations

import time
from typing import Any

import ray

from lifemem_ray.actors.cluster.deployment import find_coordinator
from lifemem_ray.actors.cluster.orphans import orphan_status
from lifemem_ray.actors.cluster.remote_errors import DeploymentNotFoundError, actor_failures

__all__ = ["deployment_status", "status_table"]


def _node_addresses() -> dict[str, dict[str, Any]]:
    return {n["NodeID"]: {"address": n.get("NodeManagerAddress"), "alive": bool(n.get("Alive"))} for n in ray.nodes()}


def deployment_status(namespace: str, *, timeout_s: float = 30.0) -> dict[str, Any]:
    """The deployment in ``namespace``: per shard, placement, health and durability. When its
    coordinator is gone but shards run, says so, with their counts and the command that serves
    it again (:func:`~.orphans.orphan_status`).

    Raises:
        DeploymentNotFoundError: neither a coordinator nor a shard runs in the namespace.
    """
    try:
        coordinator = find_coordinator(namespace)
    except DeploymentNotFoundError:
        orphaned = orphan_status(namespace, timeout_s)
        if orphaned is None:
            raise
        return orphaned
    try:
        info = ray.get(coordinator.deployment.remote(), timeout=timeout_s)
        health = ray.get(coordinator.health.remote(), timeout=timeout_s)
    except actor_failures(ray.exceptions.GetTimeoutError) as exc:  # it is being restarted, or its node is gone
        orphaned = orphan_status(namespace, timeout_s) or {"namespace": namespace, "store": None, "shards": []}
        return {**orphaned, "coordinator": f"not answering ({type(exc).__name__}): its node may be restarting"}
    nodes = _node_addresses()
    kept = {h["index"]: h for h in health["shards"]}
    shards = []
    for i, name in enumerate(info["shards"]):
        placed = (info.get("nodes") or [None] * len(info["shards"]))[i]
        row: dict[str, Any] = {
            "index": i,
            "name": name,
            "node_id": placed,
            "address": nodes.get(placed or "", {}).get("address"),
            "node_alive": nodes.get(placed or "", {}).get("alive", False),
            "keeper": kept.get(i),
        }
        try:
            shard: Any = ray.get_actor(name, namespace=namespace)
            details: dict[str, Any] = ray.get(shard.info.remote(), timeout=timeout_s)
            row.update(
                health="up",
                node_id=details["node_id"],
                address=details["address"],
                trajectories=details["trajectories"],
                clusters=details["clusters"],
                durable=_durable_row(details.get("durable")),
            )
            if (row["durable"] or {}).get("deposed"):  # another writer took its log over: it refuses writes
                row.update(health="deposed", why=row["durable"]["deposed"])
        except actor_failures(ValueError, ray.exceptions.GetTimeoutError) as exc:
            down = (kept.get(i) or {}).get("down")
            row.update(health="down", why=down or f"{type(exc).__name__}: {str(exc)[:200]}")
        shards.append(row)
    return {
        "namespace": namespace,
        "store": info.get("store"),
        "dim": info.get("dim"),
        "coordinator": "up",
        "shards": shards,
    }


def _durable_row(durable: dict[str, Any] | None) -> dict[str, Any] | None:
    if durable is None:
        return None
    schedule = durable.get("schedule") or {}
    created = durable.get("checkpoint_created")
    return {
        "uri": durable["uri"],
        "log_head": durable["head"],
        "local_seq": durable["local_seq"],
        "behind_log": durable["head"] - durable["local_seq"],
        "checkpoint_seq": durable["checkpoint_seq"],
        "checkpoint_age_s": None if created is None else round(time.time() - created, 1),
        "entries_after_checkpoint": durable["entries_after_checkpoint"],
        "checkpoint_error": schedule.get("last_error"),
        "writer": durable.get("writer"),
        "deposed": durable.get("deposed"),
        "repaired_entries": durable.get("repaired_entries") or [],
    }


def status_table(status: dict[str, Any]) -> str:
    """The status as a text table, one row per shard."""
    head = f"{'shard':<6}{'health':<8}{'address':<16}{'node':<14}{'traj':>9}  {'checkpoint':<22}{'log after':>10}{'behind':>8}"
    lines = [f"deployment {status['namespace']!r}, store {status['store']}"]
    if status.get("coordinator", "up") != "up":
        lines.append(f"coordinator: {status['coordinator']}; shards still running hold what was acknowledged")
        if status.get("recover"):
            lines.append(f"to serve it again (the live shards are adopted): {status['recover']}")
    lines.append(head)
    for s in status["shards"]:
        d = s.get("durable") or {}
        checkpoint = (
            "no durable_uri"
            if not d
            else "none yet"
            if d["checkpoint_seq"] is None
            else f"#{d['checkpoint_seq']} {d['checkpoint_age_s']:.0f} s ago"
        )
        lines.append(
            f"{s['index']:<6}{s['health']:<8}{s['address']!s:<16}{str(s['node_id'])[:12]:<14}"
            f"{s.get('trajectories', '-')!s:>9}  {checkpoint:<22}{d.get('entries_after_checkpoint', '-')!s:>10}"
            f"{d.get('behind_log', '-')!s:>8}"
        )
        if s["health"] in ("down", "deposed"):
            lines.append(f"      {s['health']}: {s['why']}")
        if d.get("repaired_entries"):
            lines.append(f"      damaged log entries {d['repaired_entries']} replaced by a checkpoint of this copy")
    return "\n".join(lines)
