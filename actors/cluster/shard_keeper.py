"""Keeps a running deployment's shards served when nodes go, from inside the coordinator.

Every ``cluster.health_check_s`` the keeper looks at each shard actor (Ray's actor table) and
its node (Ray's node table), then applies :func:`next_step`, a pure policy:

* the shard is alive: nothing;
* its node is alive: Ray restarts a crashed actor there by itself; only one Ray gave up on
  (``DEAD``) is started again there;
* its node is gone, and a live node sees the shard's files (the node came back under a new
  id with its disk, or the store is on a shared filesystem): the shard starts there, and with
  a shared log its copy catches up with the log first;
* its node has been gone ``cluster.node_lost_after_s`` and the deployment has a durable
  address (``cluster.durable_uri``): the shard is rebuilt on the live shard node with the
  fewest shards, from its newest checkpoint and the log after it; the routing table's node
  list moves with it;
* otherwise it waits (without a durable address a lost node's shard comes back only with
  its disk, or from a snapshot: ``lifemem-ray restore``).

A shard Ray is creating on its live node, or restarting there for less than
``cluster.restart_wait_s``, is waited for (Ray retries the calls). While a shard is down,
:class:`~.ray_shards.RayShards` refuses calls to it at once
(``ShardUnavailableError``, HTTP 503 with ``Retry-After``), so no caller waits for a node.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.actors.cluster.coordinator_watch import CoordinatorSpec
from lifemem_ray.actors.cluster.placement import (
    alive_nodes,
    cluster_gpus,
    least_loaded_shard_node,
    nodes_seeing,
    shard_folder,
    start_embedder,
    start_shard,
)
from lifemem_ray.actors.cluster.ray_internals import named_actor_states
from lifemem_ray.actors.cluster.routing import RoutingTable

__all__ = ["ShardKeeper", "ShardSight", "next_step"]

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 10.0  # a node that does not answer the shard-file probe within this is passed over
PROBE_EVERY_S = 10.0  # while a shard's node is gone, how often the live nodes are asked for its files
NAME_FREE_WAIT_S = 30.0  # how long a killed shard's name may take to be free again
CREATING_STATES = ("PENDING_CREATION", "DEPENDENCIES_UNREADY")  # Ray's states of an actor not yet started


@dataclass(frozen=True)
class ShardSight:
    """What the keeper sees of one shard at one look."""

    index: int
    state: str  # Ray's actor state (ALIVE, RESTARTING, PENDING_CREATION, DEAD; MISSING: no such actor)
    node: str  # the node the shard is placed on
    node_alive: bool
    down_for_s: float  # how long it has been seen not alive (0 when alive)


def next_step(
    sight: ShardSight, *, seeing: list[str], durable: bool, lost_after_s: float, candidate: str | None
) -> tuple[str, str | None]:
    """``(action, node)``: ``ok``, ``wait``, ``restart`` (on ``node``: its own, or one that sees
    its files) or ``rebuild`` (on ``node``, from the shared log). ``seeing``: live nodes on which
    the shard's files exist; ``candidate``: the node a rebuild would use.

    >>> gone = ShardSight(1, "RESTARTING", "n1", node_alive=False, down_for_s=45.0)
    >>> next_step(gone, seeing=[], durable=True, lost_after_s=30.0, candidate="n2")
    ('rebuild', 'n2')
    >>> next_step(gone, seeing=["n3"], durable=True, lost_after_s=30.0, candidate="n2")
    ('restart', 'n3')
    """
    if sight.state == "ALIVE":
        return "ok", None
    if sight.node_alive:
        return ("restart", sight.node) if sight.state in ("DEAD", "MISSING") else ("wait", None)
    if seeing:
        return "restart", seeing[0]
    if durable and sight.down_for_s >= lost_after_s and candidate is not None:
        return "rebuild", candidate
    return "wait", None


@dataclass
class _ShardRecord:
    """The keeper's memory of one shard between looks."""

    down_since: float | None = None  # monotonic time it was first seen not alive
    probed_at: float = float("-inf")  # monotonic time its files were last looked for on the live nodes
    last_action: str | None = None  # what the keeper last did for it, and when (wall clock)
    history: list[dict[str, Any]] = field(default_factory=list)  # restarts and rebuilds (the last 20)


class ShardKeeper:
    """The I/O around :func:`next_step`: looks at Ray's tables, starts shards, moves routes.

    ``on_down(index, why)`` and ``on_up(index)`` tell the coordinator's shard set what to refuse
    and which handles to drop."""

    def __init__(
        self,
        names: list[str],
        store: Path,
        config: DeploymentConfig,
        dim: int,
        routing: RoutingTable,
        on_down: Callable[[int, str | None], None],
        coordinator: CoordinatorSpec | None = None,
    ) -> None:
        self.names = names
        self.coordinator = coordinator  # what a shard it starts watches over (its coordinator watch)
        self.store = store
        self.config = config
        self.dim = dim
        self.routing = routing  # holds the placement (meta "nodes"), moved with a rebuild
        self.on_down = on_down  # (shard, why) marks it down; (shard, None) up again
        self.records = [_ShardRecord() for _ in names]
        self.looks = 0  # how many looks so far (status)

    async def run(self) -> None:
        """Look every ``cluster.health_check_s`` until cancelled; a failed look is logged."""
        while True:
            try:
                await asyncio.to_thread(self.look)
                await asyncio.to_thread(self.replace_embedders)
            except Exception:  # the keeper must outlive any one failed look (logged)
                log.warning("shard keeper: a look at the shards failed", exc_info=True)
            await asyncio.sleep(self.config.cluster.health_check_s)

    def look(self) -> list[tuple[int, str, str | None]]:
        """One look at every shard; returns the actions taken."""
        self.looks += 1
        states = named_actor_states(self.config.cluster.namespace, self.names)
        nodes = alive_nodes()
        alive = {n["NodeID"] for n in nodes}
        placed: list[str] = list(self.routing.get_meta("nodes") or [])
        now = time.monotonic()
        taken: list[tuple[int, str, str | None]] = []
        for i, name in enumerate(self.names):
            state = states.get(name, "MISSING")
            record = self.records[i]
            if state == "ALIVE":
                if record.down_since is not None:
                    record.down_since = None
                    self.on_down(i, None)
                continue
            node = placed[i] if i < len(placed) else ""
            record.down_since = record.down_since if record.down_since is not None else now
            sight = ShardSight(i, state, node, node in alive, now - record.down_since)
            if self._waited_for(sight):
                continue
            self.on_down(i, self._why(sight))
            seeing: list[str] = []
            if not sight.node_alive and now - record.probed_at >= PROBE_EVERY_S:
                record.probed_at = now
                seeing = nodes_seeing(
                    sorted(alive), [self.store / shard_folder(i) / "data.mdb"], timeout_s=PROBE_TIMEOUT_S
                )[0]
            if seeing:  # where its files are, the best place first
                seeing = [least_loaded_shard_node(nodes, placed, among=seeing)]
            candidate = least_loaded_shard_node(nodes, placed) if nodes else None
            action, target = next_step(
                sight,
                seeing=seeing,
                durable=bool(self.config.cluster.durable_uri),
                lost_after_s=self.config.cluster.node_lost_after_s,
                candidate=candidate,
            )
            if action in ("restart", "rebuild") and target is not None:
                self._start(i, target, action, placed)
                taken.append((i, action, target))
        return taken

    def replace_embedders(self) -> list[str]:
        """The deployment's embedders that died for good, started anew (new actors: a driver
        connected before a head loss reaches a new actor, not a restarted one); only with
        ``cluster.replace_dead_actors``. Returns their names."""
        if self.coordinator is None or not self.config.cluster.replace_dead_actors:
            return []
        names = self.coordinator.embedder_names
        states = named_actor_states(self.config.cluster.namespace, names)
        gpus = cluster_gpus()
        started = []
        for i, name in enumerate(names):
            if states.get(name) not in ("MISSING", "DEAD"):
                continue
            try:
                start_embedder(name, self.config, gpu=i < gpus)
            except ValueError:  # started meanwhile
                continue
            started.append(name)
        if started:
            log.warning("embedders %s were gone; started anew", started)
        return started

    def _waited_for(self, sight: ShardSight) -> bool:
        """Whether calls wait for the shard instead of being refused: Ray is creating it on its
        live node (a deployment starting), or restarting it there for less than
        ``cluster.restart_wait_s`` (a crashed process is back in seconds; Ray retries the calls)."""
        if not sight.node_alive or sight.state in ("DEAD", "MISSING"):
            return False
        return sight.state in CREATING_STATES or sight.down_for_s < self.config.cluster.restart_wait_s

    def _why(self, sight: ShardSight) -> str:
        if sight.node_alive:
            return f"its actor is {sight.state.lower()} (down {sight.down_for_s:.0f} s); retry shortly"
        durable = bool(self.config.cluster.durable_uri)
        then = (
            f"it is rebuilt on another node after {self.config.cluster.node_lost_after_s:g} s (cluster.node_lost_after_s)"
            if durable
            else "it comes back with its node's disk (no cluster.durable_uri)"
        )
        return f"its node {sight.node[:12]} is gone (down {sight.down_for_s:.0f} s); {then}; retry shortly"

    def _start(self, index: int, node: str, action: str, placed: list[str]) -> None:
        name = self.names[index]
        try:  # whatever is left of it (restarting, pending on a dead node) ends first
            ray.kill(ray.get_actor(name, namespace=self.config.cluster.namespace), no_restart=True)
        except ValueError:
            pass
        deadline = time.monotonic() + NAME_FREE_WAIT_S
        while time.monotonic() < deadline:
            try:
                ray.get_actor(name, namespace=self.config.cluster.namespace)
                time.sleep(0.2)
            except ValueError:
                break
        log.warning("shard keeper: %s shard %d on node %s", action, index, node)
        started = time.monotonic()
        handle = start_shard(index, node, self.store, self.config, self.dim, self.coordinator)
        while len(placed) <= index:
            placed.append("")
        placed[index] = node
        self.routing.put_meta("nodes", placed)
        deployment = self.routing.get_meta("deployment") or {}
        if deployment:
            self.routing.put_meta("deployment", {**deployment, "nodes": placed})
        self.on_down(index, f"being started again on node {node[:12]} ({action}); retry shortly")
        # Waited for here (a rebuild replays the shard's log), so calls resume the moment it serves.
        ready, _ = ray.wait([handle.ping.remote()], timeout=self.config.cluster.start_timeout_s)
        record = self.records[index]
        took = round(time.monotonic() - started, 1)
        record.last_action = f"{action} on {node} at {time.time():.0f} ({took} s)"
        record.history = [*record.history[-19:], {"action": action, "node": node, "at": time.time(), "took_s": took}]
        if ready:
            record.down_since = None
            self.on_down(index, None)

    def status(self) -> list[dict[str, Any]]:
        """Per shard: down since when (seconds), the last action, the recent history."""
        now = time.monotonic()
        return [
            {
                "index": i,
                "down_for_s": None if r.down_since is None else round(now - r.down_since, 1),
                "last_action": r.last_action,
                "history": r.history,
            }
            for i, r in enumerate(self.records)
        ]
