"""The coordinator, started anew when it died: a watch in every shard actor.

The coordinator lives on the node that served the deployment (its routing table is there),
the head as a rule. When that node is lost, the shards on the worker nodes live on (with
Ray's GCS fault tolerance), and the coordinator must come back on the head once it is started
again. Ray could restart the same actor there, but a driver that held a handle to it before
the loss (a rollout worker's ``MemoryClient``) keeps calling its old address
(``ActorUnavailableError`` for minutes, measured on the multi-host harness). So the
coordinator is not restarted by Ray (``max_restarts=0`` with the watch on): each shard looks
every ``cluster.health_check_s`` whether a coordinator of its deployment exists, and when its
name is free (the actor died for good), starts a new one from the deployment's
:class:`CoordinatorSpec`; the name decides which shard's start wins. Clients that find the
coordinator by name (:class:`~.coordinator_ref.CoordinatorRef`) then reach the new actor, and
it rebuilds its routes from the shards. A watch only acts once it has seen its coordinator:
a restore, which starts the coordinator after the shards have absorbed, is never pre-empted.

>>> spec = CoordinatorSpec("/srv/store", None, ["lifemem-shard-0"], [], 384, "node:__internal_head__", object)
>>> spec.home
'node:__internal_head__'
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import ray

__all__ = ["COORDINATOR", "CoordinatorSpec", "CoordinatorWatch", "start_coordinator_actor"]

log = logging.getLogger(__name__)

COORDINATOR = "lifemem-coordinator"


@dataclass(frozen=True)
class CoordinatorSpec:
    """Everything a coordinator of one deployment is started with."""

    store: str  # the deployment's store folder (its routing table: <store>/coordinator, on the home node)
    config: Any  # the deployment's DeploymentConfig
    shard_names: list[str]
    embedder_names: list[str]
    dim: int
    home: str  # the resource that places it on its node, also after that node was restarted
    actor_class: type  # the coordinator's class (given by the layer that defines it: this module is below it)


def start_coordinator_actor(spec: CoordinatorSpec) -> Any:
    """The named, detached coordinator actor of ``spec`` (not waited for).

    Raises:
        ValueError: the name is taken (a coordinator of the namespace exists).
    """
    options = spec.actor_class.ray_options(spec.config)  # type: ignore[attr-defined]
    options["resources"] = {**options.get("resources", {}), spec.home: 0.001}
    namespace = spec.config.cluster.namespace
    ray.remote(spec.actor_class).options(name=COORDINATOR, namespace=namespace, lifetime="detached", **options).remote(
        spec.store, spec.config, spec.shard_names, spec.embedder_names, spec.dim
    )
    return ray.get_actor(COORDINATOR, namespace=namespace)


class CoordinatorWatch:
    """A daemon thread of a shard actor that starts a new coordinator when the deployment's
    died for good (see the module docstring)."""

    def __init__(self, spec: CoordinatorSpec, every_s: float, name: str) -> None:
        self.spec = spec  # what a new coordinator is started with
        self.every_s = every_s  # seconds between looks
        self.seen = False  # whether a coordinator of this deployment was seen (before, nothing is started)
        self.started = 0  # coordinators this watch started
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.look()
            except Exception:
                log.debug("coordinator watch: look failed", exc_info=True)

    def look(self) -> bool:
        """One look; returns whether it started a coordinator."""
        namespace = self.spec.config.cluster.namespace
        try:
            ray.get_actor(COORDINATOR, namespace=namespace)  # alive, pending or restarting: nothing to do
            self.seen = True
            return False
        except ValueError:  # the name is free: the coordinator died for good
            if not self.seen:
                return False
        try:
            start_coordinator_actor(self.spec)
        except ValueError:  # another shard's watch was first
            return False
        self.started += 1
        log.warning("coordinator of %r was gone; this shard started a new one", namespace)
        return True

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
