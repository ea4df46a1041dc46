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

import errno
import fcntl
import logging
import os
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self, TypeAlias, TypeVar

import lmdb
import numpy as np

from lifemem_ray.core.errors import StoreError, StoreLockedError
from lifemem_ray.core.ids import ID_SEQ_BITS, MAX_NAMESPACE
from lifemem_ray.core.model import Trajectory
from lifemem_ray.engine.clustering.clusters import ClusterRecord
from lifemem_ray.engine.store import codec
from lifemem_ray.engine.store.codec import Brief, pack_u64, unpack_u64
from lifemem_ray.engine.store.codec import decode_trajectory as record_to_trajectory
from lifemem_ray.engine.store.lmdb_check import problem_of_data_file
from lifemem_ray.engine.store.lmdb_rewrite import (
    COMPACT_STAGING,
    Rewrite,
    remove_staging,
    replace_data_file,
    write_fresh_copy,
)
from lifemem_ray.engine.store.log_errors import LogDamagedError
from lifemem_ray.engine.store.redo import RecordingTxn, RedoLogger
from lifemem_ray.engine.store.shared_log import SharedLog

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

SCHEMA_VERSION = 1
_DBS = ("meta", "traj", "tid", "vec", "brief", "vclu", "members", "clusters", "envs", "log", "todo", "logvid")
_LATER_DBS = ("logvid",)  # tables older stores lack until a writable open adds them
T = TypeVar("T")
if TYPE_CHECKING:
    # py-lmdb's stubs type a bare Transaction's reads as ``bytes | memoryview``; every transaction
    # here is opened with buffers=False (py-lmdb's default), so what it reads is bytes.
    Txn: TypeAlias = lmdb.Transaction[bytes]
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


def _is_disk_error(exc: lmdb.Error) -> bool:
    """Whether an LMDB error is the device's (full, or failing writes): py-lmdb raises
    ``DiskError`` for ENOSPC and a plain ``Error`` naming the errno's text otherwise."""
    if isinstance(exc, getattr(lmdb, "DiskError", ())):
        return True
    text = str(exc)
    return any(why in text for why in (os.strerror(errno.ENOSPC), os.strerror(errno.EIO), os.strerror(errno.EDQUOT)))


class _ResizeGate:
    """Readers share the map; a resize waits until none is inside and admits none meanwhile."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._resizing = False

    @contextmanager
    def reading(self) -> Iterator[None]:
        with self._cond:
            while self._resizing:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextmanager
    def resizing(self) -> Iterator[None]:
        with self._cond:
            while self._resizing:
                self._cond.wait()
            self._resizing = True
            while self._readers:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._resizing = False
                self._cond.notify_all()


class _Environment:
    """The LMDB environment of one memory, opened by at most one writer process: locking,
    the schema check, transactions that grow the map when full, meta entries."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        dim: int | None = None,
        workflow_dim: int | None = None,
        embedder: str | None = None,
        read_only: bool = False,
        namespace: int = 0,
        map_size_mb: int = 64,
        max_map_size_gb: int = 4096,
        sync: bool = True,
        shared_log: SharedLog | None = None,
        replay_before: int | None = None,
    ) -> None:
        self.path = Path(path)
        # Writable with a shared log: every write transaction is appended there before it commits
        # (``replay_before``: only the entries before it are replayed, a loss the operator accepted).
        self._redo = (
            RedoLogger(shared_log, self.path, stop_before=replay_before)
            if shared_log is not None and not read_only
            else None
        )
        self.read_only = read_only
        self._max_map = max_map_size_gb << 30
        self._write_lock = threading.RLock()
        self._gate = _ResizeGate()
        self._lock_file: int | None = None
        if read_only:
            if not (self.path / "data.mdb").is_file():
                raise StoreError(f"{self.path}: no memory store here (data.mdb missing)")
        else:
            try:
                self.path.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StoreError(f"{self.path}: cannot create the store folder: {exc.strerror}") from None
            self._acquire_writer_lock()
        if self._redo is not None:
            try:
                self._redo.prepare_folder()  # a store rebuilt on this node starts from the newest checkpoint
            except BaseException:
                self._release_writer_lock()
                raise
        # A truncated data.mdb is mapped without complaint and kills the process (SIGBUS) at
        # the first page past its end: look at its meta pages before LMDB maps it.
        problem = problem_of_data_file(self.path / "data.mdb")
        if problem is not None:
            self._release_writer_lock()
            raise StoreError(
                f"{problem}: the store is damaged and cannot be opened; restore the folder from a snapshot "
                "(`lifemem-ray snapshot`) or a backup (`lifemem-ray export` cannot read a truncated store)"
            )
        self._sync = sync
        if not read_only:
            try:  # what a compaction a crash interrupted left; data.mdb is whole either way
                remove_staging(self.path)
            except OSError as exc:  # costs disk, not correctness; the next compaction tries again
                _log.warning("%s: could not remove the copy an interrupted compaction left: %s", self.path, exc)
        try:
            self._open_lmdb(map_size_mb << 20)
        except lmdb.Error as exc:
            self._release_writer_lock()
            if "already open in this process" in str(exc):
                raise StoreError(
                    f"{self.path}: the store is already open in this process; share that Memory instead"
                ) from None
            raise StoreError(f"{self.path}: cannot open the LMDB environment: {exc}") from None
        if not 0 <= namespace <= MAX_NAMESPACE:
            raise StoreError(f"namespace: must be within [0, {MAX_NAMESPACE}], got {namespace}")
        if self._redo is not None:
            self._recover_from_log()
        self._check_or_init_schema(dim, workflow_dim, embedder, namespace)
        if self._redo is not None:
            try:
                self._redo.bind(self.store_id, self.env, self.db["meta"])
            except BaseException:
                self.close()
                raise

    def _recover_from_log(self) -> None:
        """The local copy brought up to its shared log (see :mod:`lifemem_ray.engine.store.redo`)."""
        assert self._redo is not None
        try:
            with self.read() as txn:
                behind = self._redo.behind_reach(txn, self.db["meta"])
            if behind:
                self._start_from_checkpoint()
            try:
                replayed = self._redo.recover(self.env, self.db, self._grow)
            except LogDamagedError as exc:  # an entry it needs is damaged, but a newer checkpoint holds it
                if not self._redo.covered(exc.seq):
                    raise
                self._start_from_checkpoint()
                replayed = self._redo.recover(self.env, self.db, self._grow)
            if not self._redo.shared.read_only:
                self._redo.take_over(self.env, self.db, self._grow)
        except BaseException:
            self.close()
            raise
        if replayed:
            _log.info("%s: %d transactions replayed from %s", self.path, replayed, self._redo.shared.uri)

    def _start_from_checkpoint(self) -> None:
        """The local copy moved aside (kept) and replaced by the newest whole checkpoint."""
        assert self._redo is not None
        map_size = self.env.info()["map_size"]
        self.env.close()
        self._redo.set_aside()
        self._redo.prepare_folder()
        self._open_lmdb(map_size)

    def _open_lmdb(self, map_size: int) -> None:
        """Open the LMDB environment and its tables (at least ``map_size`` bytes mapped). A
        read-only open of a store written before a table existed goes without that table
        (:data:`_LATER_DBS`): only writes use them."""
        existing = (self.path / "data.mdb").stat().st_size if (self.path / "data.mdb").exists() else 0
        self.env = lmdb.open(
            str(self.path),
            map_size=max(map_size, existing),
            max_dbs=len(_DBS) + 2,
            subdir=True,
            readonly=self.read_only,
            lock=True,
            sync=self._sync,
            metasync=self._sync,
            readahead=False,
            max_readers=512,
        )
        self.db = {}
        self._table_names: dict[int, str] = {}
        try:
            for name in _DBS:
                try:
                    self.db[name] = self.env.open_db(name.encode(), create=not self.read_only)
                except lmdb.NotFoundError:
                    if name not in _LATER_DBS:
                        raise
            self._table_names = {id(handle): name for name, handle in self.db.items()}
        except BaseException:
            self.env.close()
            raise

    # -- locking ---------------------------------------------------------------------------
    def _acquire_writer_lock(self) -> None:
        lock_path = self.path / "writer.lock"
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = ""
            try:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
            except OSError:
                pass
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                who = f" (pid {holder}{', this process' if holder == str(os.getpid()) else ''})" if holder else ""
                raise StoreLockedError(
                    f"{self.path}: the store is open for writing by another process{who}; "
                    "open it read-only or stop that process"
                ) from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_file = fd

    def _release_writer_lock(self) -> None:
        if self._lock_file is not None:
            try:
                fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            finally:
                os.close(self._lock_file)
                self._lock_file = None

    # -- schema ----------------------------------------------------------------------------
    def _check_or_init_schema(
        self, dim: int | None, workflow_dim: int | None, embedder: str | None, namespace: int
    ) -> None:
        with self.read() as txn:
            schema = txn.get(b"schema", db=self.db["meta"])
            meta = {k.decode(): _unpackb(v) for k, v in txn.cursor(db=self.db["meta"])}
        if schema is None:
            if self.read_only:
                raise StoreError(f"{self.path}: the store has not been initialised")
            if dim is None or workflow_dim is None:
                raise StoreError(f"{self.path}: a new store needs the vector dimensions")
            now = time.time()

            def init(txn: Txn) -> None:
                for key, value in {
                    "schema": SCHEMA_VERSION,
                    "dim": dim,
                    "workflow_dim": workflow_dim,
                    "embedder": embedder or "",
                    "generation": 0,
                    "next_cluster": 1,
                    "next_vid": 1,
                    "namespace": namespace,
                    "next_log": 0,
                    "pending": [],
                    "initialised": False,
                    "created": now,
                    "llm_usage": {},
                    "counters": {},
                    "store_id": uuid.uuid4().hex,
                    "log_by_vid": True,
                }.items():
                    txn.put(key.encode(), _packb(value), db=self.db["meta"])

            self.write(init)
            with self.read() as txn:
                meta = {k.decode(): _unpackb(v) for k, v in txn.cursor(db=self.db["meta"])}
        elif meta.get("schema") != SCHEMA_VERSION:
            raise StoreError(
                f"{self.path}: schema version {meta.get('schema')} is not {SCHEMA_VERSION}, which this version reads"
            )
        if dim is not None and meta["dim"] != dim:
            raise StoreError(f"{self.path}: the store holds {meta['dim']}-dimensional vectors, not {dim}")
        if workflow_dim is not None and meta["workflow_dim"] != workflow_dim:
            raise StoreError(
                f"{self.path}: the store's workflow vectors have {meta['workflow_dim']} dimensions, not {workflow_dim}"
            )
        if embedder and meta["embedder"] and meta["embedder"] != embedder:
            raise StoreError(f"{self.path}: the store was built with embedder {meta['embedder']!r}, not {embedder!r}")
        self.dim = int(meta["dim"])
        self.workflow_dim = int(meta["workflow_dim"])
        self.namespace = int(meta["namespace"])
        if namespace and namespace != self.namespace:
            raise StoreError(f"{self.path}: the store's id namespace is {self.namespace}, not {namespace}")
        self.embedder = meta["embedder"]
        self.store_id = str(meta.get("store_id") or "")
        if not self.store_id and not self.read_only:  # a store from before ids: it gets one now
            new_id = uuid.uuid4().hex
            self.write(lambda txn: self.put_meta(txn, "store_id", new_id))
            self.store_id = new_id

    # -- transactions ----------------------------------------------------------------------
    @contextmanager
    def read(self) -> Iterator[Txn]:
        while True:
            with self._gate.reading():
                try:
                    txn = self.env.begin(buffers=False)
                except lmdb.MapResizedError:
                    txn = None
                if txn is not None:
                    try:
                        yield txn
                    finally:
                        txn.abort()
                    return
            # Another process grew the map: adopt its size, then read again.
            with self._gate.resizing():
                self.env.set_mapsize(0)

    def write(self, fn: Callable[[Txn], T], *, changed: Callable[[T], bool] | None = None) -> T:
        """Run ``fn`` in one write transaction and commit; grow the map and rerun when full.

        ``fn`` must only touch the transaction (no outside side effects), since it may run twice.
        The generation counter is bumped in the same transaction (read-only views reload when
        it moves), unless ``changed`` says of ``fn``'s result that it wrote nothing (a pass
        over a chunk that found nothing to do).
        """
        if self.read_only:
            raise StoreError(f"{self.path}: opened read-only")
        with self._write_lock:
            redo = self._redo
            if redo is not None:
                try:
                    redo.catch_up(self.env, self.db, self._grow)
                except lmdb.Error as exc:  # replaying what an earlier failed commit left: the same device
                    if _is_disk_error(exc):
                        raise self._disk_error(exc) from None
                    raise
            while True:
                try:
                    with self._gate.reading(), self.env.begin(write=True) as raw:
                        txn: Any = raw if redo is None else RecordingTxn(raw, self._table_names)
                        result = fn(txn)
                        if changed is None or changed(result):
                            gen = txn.get(b"generation", db=self.db["meta"])
                            txn.put(b"generation", _packb((_unpackb(gen) if gen else 0) + 1), db=self.db["meta"])
                        if redo is not None:
                            redo.append(txn, self.db["meta"])  # durable in the shared log before the commit
                    if redo is not None:
                        redo.committed()
                    return result
                except lmdb.MapFullError:
                    self._grow()
                except lmdb.Error as exc:
                    if _is_disk_error(exc):
                        raise self._disk_error(exc) from None
                    raise

    def _disk_error(self, exc: lmdb.Error) -> StoreError:
        return StoreError(
            f"no space left on the device (or a write error) in {self.path}: {exc}; nothing of this batch "
            "was stored; free space (or fix the device) and retry"
        )

    def _grow(self) -> None:
        current = self.env.info()["map_size"]
        if current >= self._max_map:
            raise StoreError(f"{self.path}: the store is full at store.max_map_size_gb = {self._max_map >> 30}")
        with self._gate.resizing():
            self.env.set_mapsize(min(current * 2, self._max_map))

    # -- meta ------------------------------------------------------------------------------
    def get_meta(self, key: str, txn: Txn | None = None, default: Any = None) -> Any:
        if txn is None:
            with self.read() as txn:
                return self.get_meta(key, txn, default)
        raw = txn.get(key.encode(), db=self.db["meta"])
        return default if raw is None else _unpackb(raw)

    def put_meta(self, txn: Txn, key: str, value: Any) -> None:
        txn.put(key.encode(), _packb(value), db=self.db["meta"])

    def generation(self) -> int:
        return int(self.get_meta("generation", default=0))

    def index_identity(self, txn: Txn | None = None) -> str:
        """``store id:digest`` of what the vector index holds: every stored (vid, vector record),
        folded order-independently (xor and sum of per-entry crc32s), with the count and the
        generation. An index cache saved with another identity belongs to another store or
        other contents and is not used. Reads the whole vectors table once: its time grows with the store."""
        if txn is None:
            with self.read() as txn:
                return self.index_identity(txn)
        x = total = n = 0
        for key, value in txn.cursor(db=self.db["vec"]):
            h = zlib.crc32(value, zlib.crc32(key))
            x ^= h
            total = (total + h * 0x9E3779B1) & 0xFFFFFFFFFFFFFFFF
            n += 1
        gen = int(self.get_meta("generation", txn, 0))
        return f"{self.store_id}:{n}-{gen}-{x:08x}{total:016x}"

    # -- lifecycle -------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        info = self.env.info()
        stat = self.env.stat()
        return {
            "path": str(self.path),
            "map_size": info["map_size"],
            "last_txnid": info["last_txnid"],
            "page_size": stat["psize"],
            "file_size": (self.path / "data.mdb").stat().st_size,
        }

    def copy_to(self, directory: str | os.PathLike[str]) -> Rewrite:
        """A consistent copy of the store (one read transaction) written record by record into
        fresh pages in ``directory`` (:mod:`lifemem_ray.engine.store.lmdb_rewrite`): it holds none of the
        bytes of deleted records that this store's free pages and page slack may still hold."""
        with self.read() as txn:
            return write_fresh_copy(self.env, txn, directory)

    def compact(self) -> dict[str, int]:
        """Rewrite the store into fresh pages and swap the copy in for its data file, so the
        bytes of deleted records that LMDB keeps in free pages and page slack until it reuses
        them are gone. Writers wait meanwhile; readers only during the swap (the environment is
        closed and reopened around it). A crash leaves the old file or the new one, whole; the
        staging folder is removed at the next writable open or compaction. Returns the data
        file's bytes before and after. StoreLockedError when another process has the store
        open (nothing is replaced then)."""
        if self.read_only:
            raise StoreError(f"{self.path}: opened read-only; open it for writing to compact it")
        with self._write_lock:
            remove_staging(self.path)
            before = (self.path / "data.mdb").stat().st_size
            with self.read() as txn:
                copy = write_fresh_copy(self.env, txn, self.path / COMPACT_STAGING)
            try:
                with self._gate.resizing():
                    map_size = self.env.info()["map_size"]
                    self.env.close()
                    try:
                        replace_data_file(self.path, copy.data_file)
                    finally:
                        self._open_lmdb(map_size)
            finally:
                remove_staging(self.path)
        return {"bytes_before": before, "bytes_after": copy.bytes, "records": copy.records}

    def checkpoint(self, keep: int = 3) -> dict[str, Any]:
        """A checkpoint of the store in its shared log (the last ``keep`` kept, the log entries
        before the oldest kept removed). StoreError without a shared log."""
        if self._redo is None:
            raise StoreError(f"{self.path}: this store has no shared log (store.shared_log_uri) to checkpoint to")
        return self._redo.checkpoint(self.env, self.db["meta"], keep)

    def shared_log_status(self) -> dict[str, Any] | None:
        """Where the shared log is, its head and newest checkpoint, and what this copy holds
        (None without a shared log)."""
        if self._redo is None:
            return None
        return self._redo.status()

    def close(self) -> None:
        if getattr(self, "env", None) is not None:
            self.env.close()
            self.env = None  # type: ignore[assignment]
        self._release_writer_lock()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MemoryStore(_Environment):
    """The tables of one memory (see the module docstring) over its LMDB environment."""

    def __init__(self, path: str | os.PathLike[str], **options: Any) -> None:
        """Open (or create) the store at ``path``; ``options``: :class:`_Environment`'s. A
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
