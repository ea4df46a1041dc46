"""Adds answered ``202 Accepted``: their state, pollable from any HTTP replica.

One small named, detached actor per deployment namespace keeps the operations in memory:
at most ``http.operations_max`` of them holding at most ``http.operations_max_items``
trajectory answers in all, each forgotten ``http.operations_ttl_s`` after it was created
(the oldest finished ones go first when full). An operation still pending past
its deadline (the replica waiting for it stopped) reads ``failed``: its ids may or may not
be stored, and sending the same trajectories again is safe (ids make adds idempotent).
The operations are bookkeeping, not data: losing this actor loses no trajectory.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from typing import Any

import ray

from lifemem_ray.actors.cluster.placement import home_node_resource
from lifemem_ray.core.errors import OverloadedError
from lifemem_ray.service.http_config import HttpConfig

__all__ = ["OPERATIONS_ACTOR", "Operations", "operations_actor"]

OPERATIONS_ACTOR = "lifemem-http-operations"
LOST = {
    "type": "unavailable",
    "message": "the replica waiting for this add stopped before the memory answered",
    "where": None,
    "what_to_do": "send the same trajectories again: ids make adds idempotent",
}


class Operations:
    """The operations table (an actor; plain methods, called one at a time)."""

    def __init__(self, max_kept: int, ttl_s: float, max_items: int) -> None:
        self.max_kept = max_kept  # operations kept
        self.max_items = max_items  # trajectory ids (and later their answers) kept over all operations
        self.ttl_s = ttl_s
        self._ops: OrderedDict[str, dict[str, Any]] = OrderedDict()  # in creation order
        self._items = 0  # the ids of the kept operations

    def create(self, tenant: str, ids: list[str], deadline_s: float, key_id: str = "") -> str:
        """A new pending operation of ``tenant``, created by the key named ``key_id``; its id.
        :class:`OverloadedError` when the table is full (operations or items) of pending operations."""
        now = time.time()
        self._expire(now)
        if len(ids) > self.max_items:
            raise OverloadedError(
                f"{len(ids):,} trajectories in one operation, at most {self.max_items:,} (http.operations_max_items)"
            )
        while len(self._ops) >= self.max_kept or self._items + len(ids) > self.max_items:
            done = next((k for k, v in self._ops.items() if v["status"] != "pending"), None)
            if done is None:
                what = "http.operations_max" if len(self._ops) >= self.max_kept else "http.operations_max_items"
                raise OverloadedError(
                    f"{len(self._ops)} operations of {self._items:,} trajectories are pending ({what}); wait for "
                    "some to finish, or send with wait=true"
                )
            self._drop(done)
        op = uuid.uuid4().hex
        self._ops[op] = {
            "operation": op,
            "tenant": tenant,
            "key": key_id,
            "status": "pending",
            "created": now,
            "finished": None,
            "deadline": now + deadline_s,
            "ids": list(ids),
            "items": None,
            "error": None,
        }
        self._items += len(ids)
        return op

    def _drop(self, op: str) -> None:
        self._items -= len(self._ops.pop(op)["ids"])

    def finish(self, op: str, items: list[dict[str, Any]]) -> None:
        self._settle(op, "done", items=items)

    def fail(self, op: str, error: dict[str, Any]) -> None:
        self._settle(op, "failed", error=error)

    def _settle(self, op: str, status: str, **fields: Any) -> None:
        slot = self._ops.get(op)
        if slot is not None and slot["status"] == "pending":
            slot.update(status=status, finished=time.time(), **fields)

    def get(self, op: str, tenant: str, key_id: str | None = None) -> dict[str, Any] | None:
        """The operation as the REST answer shows it; None when unknown, expired, another
        tenant's, or (with ``key_id``: a caller that may see only its own) another key's."""
        now = time.time()
        self._expire(now)
        slot = self._ops.get(op)
        if slot is None or slot["tenant"] != tenant or (key_id is not None and slot["key"] != key_id):
            return None
        if slot["status"] == "pending" and now > slot["deadline"]:
            slot.update(status="failed", finished=now, error=LOST)
        return {k: slot[k] for k in ("operation", "status", "created", "finished", "items", "error")}

    def count(self) -> int:
        return len(self._ops)

    def item_count(self) -> int:
        return self._items

    def _expire(self, now: float) -> None:
        while self._ops:
            op, slot = next(iter(self._ops.items()))
            if now - slot["created"] <= self.ttl_s:
                break
            self._drop(op)


def operations_actor(namespace: str, http: HttpConfig) -> Any:
    """The namespace's operations actor (created on first use with ``http``'s limits; every
    replica shares it). It runs on the node that creates it (serve's, where the replicas run):
    a worker node's loss does not take the front door's operations with it, and it comes back
    on that node after the node was restarted (:func:`~lifemem_ray.actors.cluster.placement.home_node_resource`)."""
    return (
        ray.remote(Operations)
        .options(
            name=OPERATIONS_ACTOR,
            namespace=namespace,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            resources={home_node_resource(): 0.001},
            max_concurrency=1,
            max_restarts=-1,
        )
        .remote(http.operations_max, http.operations_ttl_s, http.operations_max_items)
    )
