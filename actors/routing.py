"""The coordinator's durable state: which shard owns each cluster, and the deployment.

A small LMDB environment of its own (``<store>/coordinator``). Updates are
idempotent puts, so replaying them after a crash is harmless.
"""

from __future__ import annotations

import struct
import threading
from pathlib import Path
from typing import Any, Iterable

import lmdb
import msgpack

__all__ = ["RoutingTable"]

_U64 = struct.Struct(">Q")
_U32 = struct.Struct(">I")


class RoutingTable:
    def __init__(self, path: str | Path, map_size_mb: int = 64) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.env = lmdb.open(str(self.path), map_size=map_size_mb << 20, max_dbs=4, sync=True)
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
        return default if raw is None else msgpack.unpackb(raw, raw=False, strict_map_key=False)

    def put_meta(self, key: str, value: Any) -> None:
        with self._lock:
            self._write(lambda txn: txn.put(key.encode(), msgpack.packb(value, use_bin_type=True), db=self.meta))

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
        Path(target).mkdir(parents=True, exist_ok=True)
        self.env.copy(str(target), compact=True)

    def close(self) -> None:
        self.env.close()
