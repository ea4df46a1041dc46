"""The LMDB environment of one memory store: at most one writer process (a lock file), the
schema check, write transactions that grow the map when it is full and run again (a change
is applied entirely or not at all, fsynced at commit), the redo log to a shared address, and
meta entries. :class:`~lifemem_ray.engine.store.storage.MemoryStore` builds the memory's tables
on it."""

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
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self, TypeAlias, TypeVar

import lmdb

from lifemem_ray.core.errors import StoreError, StoreLockedError
from lifemem_ray.core.ids import MAX_NAMESPACE
from lifemem_ray.engine.store import codec
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

__all__ = ["LATER_TABLES", "SCHEMA_VERSION", "TABLES", "LmdbEnvironment", "is_disk_error"]

SCHEMA_VERSION = 1
TABLES = ("meta", "traj", "tid", "vec", "brief", "vclu", "members", "clusters", "envs", "log", "todo", "logvid")
LATER_TABLES = ("logvid",)  # tables older stores lack until a writable open adds them
T = TypeVar("T")
if TYPE_CHECKING:
    # py-lmdb's stubs type a bare Transaction's reads as ``bytes | memoryview``; every transaction
    # here is opened with buffers=False (py-lmdb's default), so what it reads is bytes.
    Txn: TypeAlias = lmdb.Transaction[bytes]
_log = logging.getLogger(__name__)
_packb, _unpackb = codec.pack, codec.unpack


def is_disk_error(exc: lmdb.Error) -> bool:
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


class LmdbEnvironment:
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
            raise StoreError(f"must be within [0, {MAX_NAMESPACE}], got {namespace}", where="namespace")
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
        (:data:`LATER_TABLES`): only writes use them."""
        existing = (self.path / "data.mdb").stat().st_size if (self.path / "data.mdb").exists() else 0
        self.env = lmdb.open(
            str(self.path),
            map_size=max(map_size, existing),
            max_dbs=len(TABLES) + 2,
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
            for name in TABLES:
                try:
                    self.db[name] = self.env.open_db(name.encode(), create=not self.read_only)
                except lmdb.NotFoundError:
                    if name not in LATER_TABLES:
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
                    if is_disk_error(exc):
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
                    if is_disk_error(exc):
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
