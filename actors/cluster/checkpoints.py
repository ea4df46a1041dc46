"""Scheduled checkpoints of a shard to its durable address (``cluster.snapshot_every_s``,
``cluster.snapshots_kept``): a thread of the shard actor. A checkpoint is a fresh-page copy of
the store as of one read transaction (writes go on meanwhile), uploaded beside the shard's
shared log, after which the log entries it covers and the checkpoints beyond the last N are
removed, so a rebuild replays at most ``snapshot_every_s`` worth of transactions."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import lmdb

from lifemem_ray.core.errors import LifeMemError

__all__ = ["CheckpointSchedule", "deployment_address", "shard_log_uri"]

log = logging.getLogger(__name__)


def deployment_address(durable_uri: str, namespace: str) -> str:
    """Where the deployment in ``namespace`` keeps its shards' logs and checkpoints (and its
    ownership record: :mod:`lifemem_ray.actors.cluster.durable_owner`).

    >>> deployment_address("s3://bucket/lifemem/", "exp 1")
    's3://bucket/lifemem/exp%201'
    """
    return f"{durable_uri.rstrip('/')}/{quote(namespace, safe='-_.')}"


def shard_log_uri(durable_uri: str, namespace: str, index: int) -> str:
    """Where shard ``index`` of the deployment in ``namespace`` keeps its log and checkpoints.

    >>> shard_log_uri("s3://bucket/lifemem/", "exp 1", 3)
    's3://bucket/lifemem/exp%201/shard-03'
    """
    return f"{deployment_address(durable_uri, namespace)}/shard-{index:02d}"


class CheckpointSchedule:
    """Calls ``checkpoint()`` every ``every_s`` seconds on a daemon thread until stopped; keeps
    the last outcome for ``status()``. A failed checkpoint is logged and tried again at the next
    tick: the log keeps every entry until one succeeds, so nothing is lost meanwhile."""

    def __init__(self, checkpoint: Callable[[], dict[str, Any]], every_s: float, name: str) -> None:
        self.checkpoint = checkpoint  # takes one checkpoint, returns what it did
        self.every_s = every_s  # seconds between checkpoints
        self.last: dict[str, Any] | None = None  # the last successful checkpoint (with its time)
        self.last_error: str | None = None  # the last failure's message, cleared by a success
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.run_once()

    def run_once(self) -> dict[str, Any] | None:
        try:
            done = self.checkpoint()
        except (LifeMemError, OSError, lmdb.Error) as exc:  # storage unreachable: the next tick tries again
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.warning("scheduled checkpoint failed: %s", self.last_error)
            return None
        self.last = {**done, "at": time.time()}
        self.last_error = None
        return self.last

    def status(self) -> dict[str, Any]:
        return {"every_s": self.every_s, "last": self.last, "last_error": self.last_error}

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
