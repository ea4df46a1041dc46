"""Durable state in LMDB: trajectories, vectors, clusters, the assignment log.

Transaction discipline (after py-lmdb's docs): every change the engine makes is
one write transaction built by a caller-supplied function; if the map is full
the transaction is aborted, the map doubles and the function runs again, so a
change is applied entirely or not at all. A commit is fsynced (``sync=True``),
so whatever :meth:`MemoryStore.write` returned for survives a crash.

Sub-databases (keys are big-endian u64 unless noted; the value layouts are
:mod:`lifemem_ray.engine.store.codec`'s, the only module that packs or unpacks them):

=========  ==========================  ==========================================
name       key                         value
=========  ==========================  ==========================================
meta       ascii name                  schema version, dims, store id, counters, usage
traj       vid                         the trajectory record
tid        id key (utf-8)              vid (the id, tenant-qualified for a tenant other than the default)
vec        vid                         u32 env code + f32 text vector + f16 workflow vector
brief      vid                         action tokens, success, scope, task head, id key (for maintenance)
vclu       vid                         cluster id (u64)
members    cluster id + vid            empty
clusters   cluster id                  cluster record (live or tombstone)
envs       scope (utf-8)               u32 code (the environment, tenant-qualified likewise)
log        sequence number             assignment log entry
todo       cluster id                  pending maintenance flags
logvid     vid + sequence number       empty: the log entries that name this trajectory's id
=========  ==========================  ==========================================

The log names a trajectory by vid and id while it is stored; ``logvid`` lets a removal blank
exactly its own entries' ids (:meth:`MemoryStore.delete_trajectory`) without reading the log.
A store written before ``logvid`` gets it at its first writable open (meta ``log_by_vid``),
and entries naming an id no longer stored under that vid are blanked then.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from lifemem_ray.core.errors import StoreError, StoreLockedError
from lifemem_ray.core.ids import ID_SEQ_BITS
from lifemem_ray.core.model import Trajectory
from lifemem_ray.engine.clustering.clusters import ClusterRecord
from lifemem_ray.engine.store import codec
from lifemem_ray.engine.store.codec import Brief, pack_u64, unpack_u64
from lifemem_ray.engine.store.codec import decode_trajectory as record_to_trajectory
from lifemem_ray.engine.store.environment import (
    SCHEMA_VERSION,
    LmdbEnvironment,
)

__all__ = [
    "SCHEMA_VERSION",
    "ClusterRecord",
    "MemoryStore",
    "RawItem",
    "StoreError",
    "StoreLockedError",
    "pack_u64",
    "unpack_u64",
]

T = TypeVar("T")
if TYPE_CHECKING:
    from lifemem_ray.engine.store.environment import Txn
_log = logging.getLogger(__name__)
LOG_INDEX_CHUNK = 50_000  # log entries per transaction when an older store's log is indexed
_packb, _unpackb = codec.pack, codec.unpack


@dataclass(frozen=True)
class RawItem:
    """One stored trajectory as its bytes and vectors, to copy into another store as is."""

    vid: int
    trajectory_id: str
    record: bytes
    env: str
    vec: np.ndarray
    wvec: np.ndarray
    brief: bytes | None


class MemoryStore(LmdbEnvironment):
    """The tables of one memory (see the module docstring) over its LMDB environment."""

    def __init__(self, path: str | os.PathLike[str], **options: Any) -> None:
        """Open (or create) the store at ``path``; ``options``: :class:`~lifemem_ray.engine.store.environment.LmdbEnvironment`'s. A
        writable open of a store written before the log index gets it first."""
        super().__init__(path, **options)
        if not self.read_only and not self.get_meta("log_by_vid", default=False):
            self._index_log_of_older_store()

    # -- environments ----------------------------------------------------------------------
    def env_codes(self, txn: Txn) -> dict[str, int]:
        return {k.decode(): codec.unpack_u32(v) for k, v in txn.cursor(db=self.db["envs"])}

    def forget_env_names(self, txn: Txn, tenant: str) -> int:
        """Replace the names of ``tenant``'s environments in the code table by placeholders
        (``SEP + "purged" + SEP + code``, which no scope can be), keeping their codes, so a
        purged tenant's environment names are gone and codes are never handed out twice (a
        new code is the table's size). Call only when the tenant holds no trajectory. Returns
        how many."""
        from lifemem_ray.core.tenancy import SEP, scope_tenant

        names = [
            (k, v)
            for k, v in txn.cursor(db=self.db["envs"])
            if not k.startswith(SEP.encode()) and scope_tenant(k.decode()) == tenant
        ]
        for key, value in names:
            txn.delete(key, db=self.db["envs"])
            txn.put(f"{SEP}purged{SEP}{codec.unpack_u32(value)}".encode(), value, db=self.db["envs"])
        return len(names)

    def env_code(self, txn: Txn, env: str) -> int:
        """The code of ``env``, allocated in this transaction when new."""
        key = env.encode()
        raw = txn.get(key, db=self.db["envs"])
        if raw is not None:
            return codec.unpack_u32(raw)
        code = txn.stat(self.db["envs"])["entries"]
        txn.put(key, codec.pack_u32(code), db=self.db["envs"])
        return code

    # -- trajectories ----------------------------------------------------------------------
    def lookup_id(self, txn: Txn, trajectory_id: str) -> int | None:
        raw = txn.get(trajectory_id.encode("utf-8"), db=self.db["tid"])
        return None if raw is None else unpack_u64(raw)

    def tenant_id_keys(self, txn: Txn, tenant: str, limit: int) -> list[str]:
        """Up to ``limit`` id keys of ``tenant``'s stored trajectories (:func:`lifemem_ray.core.tenancy.id_key`):
        those under the tenant's prefix, or for the default tenant those without one."""
        from lifemem_ray.core.tenancy import SEP, tenant_prefix

        prefix = tenant_prefix(tenant).encode("utf-8")
        sep = SEP.encode()
        out: list[str] = []
        cursor = txn.cursor(db=self.db["tid"])
        if not cursor.set_range(prefix):
            return out
        for key in cursor.iternext(keys=True, values=False):
            if prefix and not key.startswith(prefix):
                break
            if not prefix and sep in key:
                continue
            out.append(key.decode("utf-8"))
            if len(out) >= limit:
                break
        return out

    def fingerprint_of(self, txn: Txn, vid: int) -> str | None:
        raw = txn.get(pack_u64(vid), db=self.db["traj"])
        return None if raw is None else codec.record_fingerprint(raw)

    def allocate_vids(self, txn: Txn, n: int) -> list[int]:
        """Integer ids for ``n`` new trajectories: the store's namespace (high bits) and a
        sequence (low bits). Sequential keys append to the B-trees instead of dirtying a random
        page per insert; the namespace keeps ids of different shards apart."""
        return self._allocate(txn, "next_vid", n)

    def _allocate(self, txn: Txn, counter: str, n: int) -> list[int]:
        base = self.namespace << ID_SEQ_BITS
        seq = self.get_meta(counter, txn)
        if seq + n >= 1 << ID_SEQ_BITS:
            raise StoreError(f"{self.path}: the {counter} sequence is exhausted")
        self.put_meta(txn, counter, seq + n)
        return [base | (seq + i) for i in range(n)]

    def advance_sequences(self, txn: Txn, vid_seq: int, cluster_seq: int) -> None:
        """Never hand out a sequence number below these (after records were copied in)."""
        if self.get_meta("next_vid", txn) <= vid_seq:
            self.put_meta(txn, "next_vid", vid_seq + 1)
        if self.get_meta("next_cluster", txn) <= cluster_seq:
            self.put_meta(txn, "next_cluster", cluster_seq + 1)

    def put_item(self, txn: Txn, item: Any, env_code: int, cluster_id: int | None) -> None:
        """Store one batch item (see evolution.BatchItem): its record bytes as they are."""
        key = pack_u64(item.vid)
        txn.put(key, item.record, db=self.db["traj"])
        txn.put(item.id.encode("utf-8"), key, db=self.db["tid"])
        txn.put(key, self.pack_vectors(env_code, item.vec, item.wvec), db=self.db["vec"])
        txn.put(
            key,
            codec.encode_brief(Brief(item.tokens, item.success, item.env, item.query, item.id)),
            db=self.db["brief"],
        )
        if cluster_id is not None:
            self.set_cluster_of(txn, item.vid, cluster_id)

    def rewrite_workflow(self, txn: Txn, vid: int, workflow_vector: np.ndarray, tokens: list[str]) -> None:
        """Replace a stored trajectory's workflow vector and action tokens (the text vector, the
        environment and the rest of its brief stay): what a featurizer migration rewrites."""
        key = pack_u64(vid)
        raw_vec = txn.get(key, db=self.db["vec"])
        raw_brief = txn.get(key, db=self.db["brief"])
        if raw_vec is None or raw_brief is None:
            raise StoreError(f"{self.path}: trajectory {vid} has no stored vectors or brief; run `lifemem-ray check`")
        code, vec, _ = self.unpack_vectors(raw_vec)
        brief = codec.decode_brief(raw_brief)._replace(tokens=tokens)
        txn.put(key, self.pack_vectors(code, vec, workflow_vector), db=self.db["vec"])
        txn.put(key, codec.encode_brief(brief), db=self.db["brief"])

    def delete_trajectory(self, txn: Txn, vid: int, trajectory_id: str) -> None:
        """Remove trajectory ``vid`` from every table, and its id from the log's entries."""
        key = pack_u64(vid)
        txn.delete(key, db=self.db["traj"])
        txn.delete(trajectory_id.encode("utf-8"), db=self.db["tid"])
        txn.delete(key, db=self.db["vec"])
        txn.delete(key, db=self.db["brief"])
        cid = self.cluster_of(txn, vid)
        if cid is not None:
            txn.delete(key, db=self.db["vclu"])
            txn.delete(pack_u64(cid) + key, db=self.db["members"])
        self.forget_logged_id(txn, vid)

    def set_cluster_of(self, txn: Txn, vid: int, cluster_id: int, previous: int | None = None) -> None:
        key = pack_u64(vid)
        if previous is not None:
            txn.delete(pack_u64(previous) + key, db=self.db["members"])
        txn.put(key, pack_u64(cluster_id), db=self.db["vclu"])
        txn.put(pack_u64(cluster_id) + key, b"", db=self.db["members"])

    def cluster_of(self, txn: Txn, vid: int) -> int | None:
        raw = txn.get(pack_u64(vid), db=self.db["vclu"])
        return None if raw is None else unpack_u64(raw)

    def trajectory_bytes(self, txn: Txn, vid: int) -> bytes | None:
        """The stored record as is (:func:`record_to_trajectory` decodes it): cheap to ship."""
        return txn.get(pack_u64(vid), db=self.db["traj"])

    def trajectory(self, txn: Txn, vid: int) -> tuple[Trajectory, dict[str, Any]] | None:
        raw = txn.get(pack_u64(vid), db=self.db["traj"])
        return None if raw is None else record_to_trajectory(raw)

    def raw_item(self, txn: Txn, vid: int, env_names: dict[int, str] | None = None) -> RawItem | None:
        """Trajectory ``vid`` as it is stored (to copy into another store), or None.
        ``env_names``: code -> name of :meth:`env_codes`, when the caller reads many."""
        key = pack_u64(vid)
        record = txn.get(key, db=self.db["traj"])
        raw_vec = txn.get(key, db=self.db["vec"])
        if record is None or raw_vec is None:
            return None
        code, vec, wvec = self.unpack_vectors(raw_vec)
        names = env_names if env_names is not None else {c: name for name, c in self.env_codes(txn).items()}
        return RawItem(vid, codec.record_id(record), record, names[code], vec, wvec, txn.get(key, db=self.db["brief"]))

    def holds_vid(self, txn: Txn, vid: int) -> bool:
        return txn.get(pack_u64(vid), db=self.db["traj"]) is not None

    def put_raw_item(self, txn: Txn, item: RawItem, cluster_id: int | None) -> None:
        """Store a trajectory copied from another store under its own vid (see :meth:`raw_item`)."""
        key = pack_u64(item.vid)
        txn.put(key, item.record, db=self.db["traj"])
        txn.put(item.trajectory_id.encode("utf-8"), key, db=self.db["tid"])
        txn.put(key, self.pack_vectors(self.env_code(txn, item.env), item.vec, item.wvec), db=self.db["vec"])
        if item.brief is not None:
            txn.put(key, item.brief, db=self.db["brief"])
        if cluster_id is not None:
            self.set_cluster_of(txn, item.vid, cluster_id)

    def brief(self, txn: Txn, vid: int) -> Brief | None:
        """(action tokens, success, env, task head, id) without unpacking the whole trajectory."""
        raw = txn.get(pack_u64(vid), db=self.db["brief"])
        return None if raw is None else codec.decode_brief(raw)

    def pack_vectors(self, env_code: int, vector: np.ndarray, workflow_vector: np.ndarray) -> bytes:
        return codec.encode_vectors(env_code, vector, workflow_vector)

    def unpack_vectors(self, data: bytes) -> tuple[int, np.ndarray, np.ndarray]:
        return codec.decode_vectors(data, self.dim, self.workflow_dim)

    def vectors(self, txn: Txn, vid: int) -> tuple[int, np.ndarray, np.ndarray] | None:
        raw = txn.get(pack_u64(vid), db=self.db["vec"])
        return None if raw is None else self.unpack_vectors(raw)

    def iter_vectors(self, txn: Txn) -> Iterator[tuple[int, int, np.ndarray, np.ndarray]]:
        """(vid, env code, vector, workflow vector) for every stored trajectory, in vid order."""
        for key, value in txn.cursor(db=self.db["vec"]):
            code, vec, wvec = self.unpack_vectors(value)
            yield unpack_u64(key), code, vec, wvec

    def iter_trajectories(self, txn: Txn) -> Iterator[tuple[int, Trajectory, dict[str, Any]]]:
        for key, value in txn.cursor(db=self.db["traj"]):
            traj, extra = record_to_trajectory(value)
            yield unpack_u64(key), traj, extra

    def count_trajectories(self, txn: Txn) -> int:
        return txn.stat(self.db["traj"])["entries"]

    # -- clusters --------------------------------------------------------------------------
    def put_cluster(self, txn: Txn, record: ClusterRecord) -> None:
        txn.put(pack_u64(record.id), codec.encode_cluster(record), db=self.db["clusters"])

    def get_cluster(self, txn: Txn, cluster_id: int) -> ClusterRecord | None:
        raw = txn.get(pack_u64(cluster_id), db=self.db["clusters"])
        return None if raw is None else codec.decode_cluster(raw)

    def iter_clusters(self, txn: Txn, after: int = -1) -> Iterator[ClusterRecord]:
        """Every stored cluster record (live or not) in id order; with ``after``, those with a larger id."""
        cursor = txn.cursor(db=self.db["clusters"])
        if cursor.set_range(pack_u64(after + 1)):
            for _, value in cursor:
                yield codec.decode_cluster(value)

    def members(self, txn: Txn, cluster_id: int) -> list[int]:
        prefix = pack_u64(cluster_id)
        out: list[int] = []
        cursor = txn.cursor(db=self.db["members"])
        if cursor.set_range(prefix):
            for key in cursor.iternext(keys=True, values=False):
                if key[:8] != prefix:
                    break
                out.append(unpack_u64(key[8:]))
        return out

    def next_cluster_ids(self, txn: Txn, n: int) -> list[int]:
        return self._allocate(txn, "next_cluster", n)

    # -- log and maintenance queue ---------------------------------------------------------
    def append_log(self, txn: Txn, entries: list[dict[str, Any]]) -> None:
        """Append ``entries`` to the assignment log. One that names a trajectory (a ``vid`` and
        a non-empty ``id``) is indexed under its vid, so the trajectory's removal blanks it
        (:meth:`forget_logged_id`)."""
        seq = self.get_meta("next_log", txn)
        for entry in entries:
            key = pack_u64(seq)
            txn.put(key, _packb(entry), db=self.db["log"])
            if entry.get("id") and entry.get("vid") is not None:
                txn.put(pack_u64(entry["vid"]) + key, b"", db=self.db["logvid"])
            seq += 1
        self.put_meta(txn, "next_log", seq)

    def forget_logged_id(self, txn: Txn, vid: int) -> int:
        """Blank the id in every log entry that names trajectory ``vid`` (at its removal),
        keeping the entries' numbers and operations, and drop their index rows; returns how
        many entries. Reads only this trajectory's index rows and entries, never the whole log."""
        prefix = pack_u64(vid)
        rows = []
        cursor = txn.cursor(db=self.db["logvid"])
        if cursor.set_range(prefix):
            for key in cursor.iternext(keys=True, values=False):
                if key[:8] != prefix:
                    break
                rows.append(key)
        for row in rows:
            txn.delete(row, db=self.db["logvid"])
            raw = txn.get(row[8:], db=self.db["log"])
            entry = _unpackb(raw) if raw is not None else {}
            if entry.get("id"):
                entry["id"] = ""
                txn.put(row[8:], _packb(entry), db=self.db["log"])
        return len(rows)

    def _index_log_of_older_store(self) -> None:
        """Give a store written before ``logvid`` its index, once, at its first writable open:
        an entry naming an id still stored under the entry's vid is indexed; any other id in the
        log (of a trajectory an older version removed, which left it there) is blanked. In
        transactions of :data:`LOG_INDEX_CHUNK` entries from meta ``log_by_vid_from``, so an
        open a crash interrupts resumes where it stopped. The generation stays: no view reads
        the log."""
        start: int | None = int(self.get_meta("log_by_vid_from", default=0) or 0)
        totals = [0, 0]
        while start is not None:
            chunk = partial(self._index_log_chunk, start=start)  # bound now: write() may run it twice
            start, indexed, blanked = self.write(chunk, changed=lambda _: False)
            totals = [totals[0] + indexed, totals[1] + blanked]
        _log.info(
            "%s: the assignment log is indexed by trajectory (%d entries indexed, %d ids of removed trajectories blanked)",
            self.path,
            *totals,
        )

    def _index_log_chunk(self, txn: Txn, start: int) -> tuple[int | None, int, int]:
        """One transaction of :meth:`_index_log_of_older_store`: where the next starts (None:
        done), entries indexed, ids blanked."""
        cursor = txn.cursor(db=self.db["log"])
        seen, next_start, changed = 0, None, []
        if cursor.set_range(pack_u64(start)):
            for key, value in cursor:
                if seen >= LOG_INDEX_CHUNK:
                    next_start = unpack_u64(key)
                    break
                seen += 1
                entry = _unpackb(value)
                tid, vid = entry.get("id"), entry.get("vid")
                if not (isinstance(tid, str) and tid):
                    continue
                if vid is not None and self.lookup_id(txn, tid) == vid:
                    changed.append((pack_u64(vid) + key, b"", "logvid"))
                else:
                    entry["id"] = ""
                    changed.append((key, _packb(entry), "log"))
        for key, value, table in changed:  # after the cursor is done with the log
            txn.put(key, value, db=self.db[table])
        indexed = sum(1 for c in changed if c[2] == "logvid")
        if next_start is None:
            self.put_meta(txn, "log_by_vid", True)
            txn.delete(b"log_by_vid_from", db=self.db["meta"])
        else:
            self.put_meta(txn, "log_by_vid_from", next_start)
        return next_start, indexed, len(changed) - indexed

    def redact_log(self, txn: Txn, tenant: str, start: int = 0, limit: int | None = None) -> tuple[int, int | None]:
        """Blank the ``id`` of every log entry naming one of ``tenant``'s id keys (a purged
        tenant's), keeping the entry's numbers and operation, from sequence number ``start``
        on, at most ``limit`` entries read. Returns how many were blanked and where to go on
        (None: the end of the log was reached). The log is append-only, so a pass in chunks
        misses only what is appended after it."""
        from lifemem_ray.core.tenancy import scope_tenant

        changed = []
        cursor = txn.cursor(db=self.db["log"])
        seen, next_start = 0, None
        if cursor.set_range(pack_u64(start)):
            for key, value in cursor:
                if limit is not None and seen >= limit:
                    next_start = unpack_u64(key)
                    break
                seen += 1
                entry = _unpackb(value)
                tid = entry.get("id")
                if isinstance(tid, str) and tid and scope_tenant(tid) == tenant:
                    entry["id"] = ""
                    changed.append((key, _packb(entry)))
        for key, value in changed:
            txn.put(key, value, db=self.db["log"])
        return len(changed), next_start

    def iter_log(self, txn: Txn, start: int = 0) -> Iterator[tuple[int, dict[str, Any]]]:
        cursor = txn.cursor(db=self.db["log"])
        if cursor.set_range(pack_u64(start)):
            for key, value in cursor:
                yield unpack_u64(key), _unpackb(value)

    def add_todo(self, txn: Txn, cluster_id: int, **flags: bool) -> None:
        key = pack_u64(cluster_id)
        raw = txn.get(key, db=self.db["todo"])
        current = _unpackb(raw) if raw else {}
        for name, value in flags.items():
            if value:
                current[name] = True
        if current:
            txn.put(key, _packb(current), db=self.db["todo"])

    def clear_todo(self, txn: Txn, cluster_id: int, *names: str) -> None:
        key = pack_u64(cluster_id)
        raw = txn.get(key, db=self.db["todo"])
        if raw is None:
            return
        current = {k: v for k, v in _unpackb(raw).items() if k not in names} if names else {}
        if current:
            txn.put(key, _packb(current), db=self.db["todo"])
        else:
            txn.delete(key, db=self.db["todo"])

    def todos(self, txn: Txn) -> dict[int, dict[str, bool]]:
        return {unpack_u64(k): _unpackb(v) for k, v in txn.cursor(db=self.db["todo"])}
