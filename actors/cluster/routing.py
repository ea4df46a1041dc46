"""The coordinator's durable state: which shard owns each cluster, and the deployment.

A small LMDB environment of its own (``<store>/coordinator``). Updates are
idempotent puts, so replaying them after a crash is harmless. One process at a time
holds it open for writing (an exclusive lock on ``writer.lock`` beside it, released when
the process closes it or dies): a second deployment of the same store is refused before it
changes anything.
"""

from __future__ import annotations

import fcntl
import os
import struct
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import lmdb

from lifemem_ray.engine.store import codec
from lifemem_ray.engine.store.lmdb_rewrite import write_fresh_copy

__all__ = ["RoutingTable"]

_U64 = struct.Struct(">Q")  # cluster id -> shard index: the routing table's own two-column layout
_U32 = struct.Struct(">I")


class RoutingTable:
    def __init__(self, path: str | Path, map_size_mb: int = 64, *, lock_wait_s: float = 15.0) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock_fd = _take_writer_lock(self.path, lock_wait_s)
        try:
            self.env = lmdb.open(str(self.path), map_size=map_size_mb << 20, max_dbs=4, sync=True)
        except BaseException:
            os.close(self._lock_fd)
            raise
        self.routes = self.env.open_db(b"routes")
        self.meta = self.env.open_db(b"meta")
        self._lock = threading.Lock()
        self._cache: dict[int, int] = {}
        with self.env.begin() as txn:
            for key, value in txn.cursor(db=self.routes):
                self._cache[_U64.unpack(key)[0]] = _U32.unpack(value)[0]

    def shard_of(self, cluster_id: int) -> int | None:
        return self._cache.get(cluster_id)

    def set(self, routes: Iterable[tuple[int, int]]) -> None:
        routes = [(c, s) for c, s in routes if self._cache.get(c) != s]
        if not routes:
            return
        with self._lock:
            self._write(lambda txn: [txn.put(_U64.pack(c), _U32.pack(s), db=self.routes) for c, s in routes])
            self._cache.update(routes)

    def replace_all(self, routes: dict[int, int]) -> None:
        """The whole table at once (after a restore or a resync from the shards)."""
        with self._lock:

            def write(txn: lmdb.Transaction) -> None:
                txn.drop(self.routes, delete=False)
                for c, s in routes.items():
                    txn.put(_U64.pack(c), _U32.pack(s), db=self.routes)

            self._write(write)
            self._cache = dict(routes)

    def get_meta(self, key: str, default: Any = None) -> Any:
        with self.env.begin() as txn:
            raw = txn.get(key.encode(), db=self.meta)
        return default if raw is None else codec.unpack(raw)

    def put_meta(self, key: str, value: Any) -> None:
        with self._lock:
            self._write(lambda txn: txn.put(key.encode(), codec.pack(value), db=self.meta))

    def _write(self, fn: Any) -> None:
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    fn(txn)
                return
            except lmdb.MapFullError:
                self.env.set_mapsize(self.env.info()["map_size"] * 2)

    def __len__(self) -> int:
        return len(self._cache)

    def snapshot(self, target: str | Path) -> None:
        """A consistent copy of the table in ``target``, written record by record into fresh
        pages like a shard's (:func:`lifemem_ray.engine.store.lmdb_rewrite.write_fresh_copy`). The table holds
        cluster ids, shard numbers and the deployment's settings, never a trajectory's id or
        text; it is copied the same way so no snapshot file carries stale page bytes."""
        with self.env.begin() as txn:
            write_fresh_copy(self.env, txn, target)

    def close(self) -> None:
        self.env.close()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the writer lock
            self._lock_fd = -1


def _take_writer_lock(path: Path, wait_s: float) -> int:
    """An exclusive lock on ``path/writer.lock``, waiting up to ``wait_s`` (a coordinator
    killed a moment ago may still be exiting); DeploymentExistsError when a live process
    keeps holding it (the deployment serving this store)."""
    from lifemem_ray.core.errors import DeploymentExistsError

    fd = os.open(path / "writer.lock", os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() < deadline:
                time.sleep(0.2)
                continue
        os.close(fd)
        raise DeploymentExistsError(
            f"{path.parent}: this store is already served by a running lifemem-ray deployment "
            "(its coordinator holds the store); use that deployment, or stop it first "
            "(`lifemem-ray stop --namespace NS`)"
        ) from None
