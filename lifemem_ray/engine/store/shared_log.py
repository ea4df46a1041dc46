"""A store's committed transactions on shared storage: the redo log and checkpoints that let a
store lost with its node be rebuilt on another node with nothing acknowledged missing.

Where: a folder every node sees (a shared filesystem path, ``/mnt/shared/lifemem/shard-00``) or
an S3-compatible bucket prefix (``s3://bucket/lifemem/shard-00``, through ``fsspec`` / ``s3fs``).
The layout under that address::

    identity.json                       {"store_id": ...}: the one store this log belongs to
    log/<seq, 20 digits>.txn            one committed write transaction (below)
    checkpoints/<seq>/data.mdb          a fresh-page copy of the store as of transaction <seq>
    checkpoints/<seq>/checkpoint.json   written last: the checkpoint is whole

A log entry is every put and delete of one LMDB write transaction (table, key, value), framed
(magic, crc32, msgpack). :meth:`SharedLog.append` returns only once the entry is durable there
(``fsync`` of the file and its folder on a filesystem; a completed PUT on object storage), and
it refuses a sequence number already written (exclusive create; ``If-None-Match`` on S3): a
second writer of the same log (a shard taken over elsewhere while the old one still runs)
fails instead of forking it. The store appends *before* it commits locally (write-ahead), so
whatever it acknowledges is in the log; an entry whose local commit then failed was never
acknowledged and is replayed harmlessly (the store catches up with its log before its next
write).

Replaying a checkpoint plus the entries after it gives back the store's exact tables: the
entries are physical (key-value), not decisions to make again, so splits, skills and deletions
come back as they were. A checkpoint lets the entries before it go (:meth:`SharedLog.prune`);
until then a deleted trajectory's bytes remain in the entry that stored it.

>>> import tempfile
>>> log = SharedLog(tempfile.mkdtemp())
>>> log.append(1, [("meta", b"k", b"v")])
>>> [(seq, ops) for seq, ops in log.entries(after=0)]
[(1, [('meta', b'k', b'v')])]
"""

from __future__ import annotations

import json
import logging
import os
import struct
import tempfile
import time
import uuid
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

import msgpack

from lifemem_ray.core.errors import StoreError

__all__ = ["Checkpoint", "LogForkedError", "Op", "SharedLog", "SharedLogError", "open_shared_log", "shard_logs"]

log = logging.getLogger(__name__)

Op: TypeAlias = tuple[str, bytes, bytes | None]  # (table, key, value); value None: the key was deleted
MAGIC = b"LMRL\x01"  # lifemem redo log, format 1
_FRAME = struct.Struct(">5sI")  # magic, crc32 of the payload
SEQ_DIGITS = 20
ENTRY_SUFFIX = ".txn"
CHECKPOINT_DONE = "checkpoint.json"


class SharedLogError(StoreError):
    """The shared log cannot be read or written (storage unreachable, an entry damaged)."""


class LogForkedError(SharedLogError):
    """Another writer appended to this log (the store was taken over elsewhere), or the log
    belongs to another store."""


@dataclass(frozen=True)
class Checkpoint:
    """A whole checkpoint in the log's storage: the store as of transaction ``seq``."""

    seq: int
    created: float
    bytes: int


def encode_entry(seq: int, ops: Sequence[Op]) -> bytes:
    payload = msgpack.packb([seq, [list(op) for op in ops]], use_bin_type=True)
    return _FRAME.pack(MAGIC, zlib.crc32(payload)) + payload


def decode_entry(data: bytes, where: str) -> tuple[int, list[Op]]:
    """The entry's sequence number and operations; SharedLogError when damaged (torn or altered)."""
    if len(data) < _FRAME.size:
        raise SharedLogError(f"{where}: log entry truncated ({len(data)} bytes)")
    magic, crc = _FRAME.unpack_from(data)
    payload = data[_FRAME.size :]
    if magic != MAGIC or zlib.crc32(payload) != crc:
        raise SharedLogError(f"{where}: log entry damaged (bad magic or checksum)")
    seq, ops = msgpack.unpackb(payload, raw=False)
    return int(seq), [(str(t), bytes(k), None if v is None else bytes(v)) for t, k, v in ops]


def _entry_name(seq: int) -> str:
    return f"{seq:0{SEQ_DIGITS}d}{ENTRY_SUFFIX}"


class SharedLog:
    """The redo log and checkpoints of one store at ``uri`` (a path or an fsspec URL).

    ``storage_options`` go to fsspec (for S3: ``endpoint_url``, ``key``, ``secret``...; s3fs
    also reads the usual ``AWS_*`` environment variables)."""

    def __init__(self, uri: str, *, read_only: bool = False, **storage_options: Any) -> None:
        import fsspec
        from fsspec.core import url_to_fs

        self.uri = str(uri).rstrip("/")
        self.read_only = read_only  # only read: a copy made from the log (restore) never writes to it
        try:
            self.fs, root = url_to_fs(self.uri, **storage_options)
        except (ImportError, ValueError) as exc:
            raise SharedLogError(
                f"shared log {self.uri!r}: no storage for this address ({exc}); for s3:// install s3fs "
                "(pip install 'lifemem-ray[s3]')"
            ) from None
        self.root = str(root).rstrip("/")
        self.local = isinstance(self.fs, fsspec.implementations.local.LocalFileSystem)
        self._made: set[str] = set()

    def __repr__(self) -> str:
        return f"SharedLog({self.uri!r})"

    # -- paths -----------------------------------------------------------------------------
    def _path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def _mkdirs(self, path: str) -> None:
        if path not in self._made:
            self.fs.makedirs(path, exist_ok=True)
            self._made.add(path)

    def _storage(self, what: str, exc: Exception) -> SharedLogError:
        return SharedLogError(
            f"shared log {self.uri}: {what} failed ({type(exc).__name__}: {exc}); check that the shared storage "
            "is reachable and writable from this node"
        )

    # -- writing ---------------------------------------------------------------------------
    def append(self, seq: int, ops: Sequence[Op]) -> None:
        """Entry ``seq`` made durable in the log; LogForkedError if ``seq`` is there already."""
        self._refuse_if_read_only(f"appending entry {seq}")
        data = encode_entry(seq, ops)
        path = self._path("log", _entry_name(seq))
        try:
            self._mkdirs(self._path("log"))
            if self.local:
                _create_durably(Path(path), data)
            else:
                self.fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            raise LogForkedError(
                f"shared log {self.uri}: entry {seq} was written by another writer; this store has been taken over "
                "(or two deployments share one durable address): stop this one"
            ) from None
        except SharedLogError:
            raise
        except Exception as exc:
            raise self._storage(f"appending entry {seq}", exc) from exc

    def _refuse_if_read_only(self, what: str) -> None:
        if self.read_only:
            raise SharedLogError(f"shared log {self.uri}: opened to read only, {what} refused")

    def claim(self, store_id: str) -> None:
        """Bind the log to ``store_id``: LogForkedError if it belongs to another store."""
        path = self._path("identity.json")
        try:
            if self.read_only or self.fs.exists(path):
                owner = json.loads(self.fs.cat_file(path)).get("store_id")
                if owner != store_id:
                    raise LogForkedError(
                        f"shared log {self.uri} belongs to store {owner}, not to this store ({store_id}); give each "
                        "deployment (namespace) its own durable address, or move the old log away"
                    )
                return
            self._mkdirs(self.root)
            self.fs.pipe_file(path, json.dumps({"store_id": store_id, "created": time.time()}).encode())
        except SharedLogError:
            raise
        except Exception as exc:
            raise self._storage("reading its identity", exc) from exc

    def owner(self) -> str | None:
        """The store id the log belongs to (None: a new, empty log)."""
        path = self._path("identity.json")
        try:
            return json.loads(self.fs.cat_file(path)).get("store_id") if self.fs.exists(path) else None
        except Exception as exc:
            raise self._storage("reading its identity", exc) from exc

    # -- reading ---------------------------------------------------------------------------
    def sequence_numbers(self) -> list[int]:
        """The entries in the log, in order."""
        try:
            names = self.fs.ls(self._path("log"), detail=False) if self.fs.exists(self._path("log")) else []
        except FileNotFoundError:
            return []
        except Exception as exc:
            raise self._storage("listing its entries", exc) from exc
        seqs = []
        for name in names:
            base = str(name).rsplit("/", 1)[-1]
            if base.endswith(ENTRY_SUFFIX) and base[: -len(ENTRY_SUFFIX)].isdigit():
                seqs.append(int(base[: -len(ENTRY_SUFFIX)]))
        return sorted(seqs)

    def head(self) -> int:
        """The last entry's sequence number (0: none)."""
        seqs = self.sequence_numbers()
        return seqs[-1] if seqs else 0

    def read_entry(self, seq: int) -> list[Op]:
        where = f"{self.uri}/log/{_entry_name(seq)}"
        try:
            data = self.fs.cat_file(self._path("log", _entry_name(seq)))
        except Exception as exc:
            raise self._storage(f"reading entry {seq}", exc) from exc
        got, ops = decode_entry(data, where)
        if got != seq:
            raise SharedLogError(f"{where}: holds entry {got}, not {seq}")
        return ops

    def entries(self, after: int, upto: int | None = None) -> Iterator[tuple[int, list[Op]]]:
        """Entries ``after`` < seq <= ``upto`` (default: all), in order, without gaps: a missing
        entry is an error (the log does not reach back that far, or was damaged)."""
        seqs = [s for s in self.sequence_numbers() if s > after and (upto is None or s <= upto)]
        expected = after + 1
        for seq in seqs:
            if seq != expected:
                raise SharedLogError(
                    f"shared log {self.uri}: entry {expected} is missing (next present: {seq}); the log cannot bring a "
                    f"store at transaction {after} up to date"
                )
            yield seq, self.read_entry(seq)
            expected += 1

    def drop_torn_tail(self) -> int | None:
        """Remove the last entry if it is damaged (a writer died while writing it: never
        committed, never acknowledged); returns its sequence number, or None."""
        seqs = self.sequence_numbers()
        if not seqs or self.read_only:
            return None
        try:
            self.read_entry(seqs[-1])
            return None
        except LogForkedError:
            raise
        except SharedLogError as exc:
            if "damaged" not in str(exc) and "truncated" not in str(exc):
                raise
        log.warning("shared log %s: entry %d is torn (its writer died writing it); removing it", self.uri, seqs[-1])
        self.fs.rm_file(self._path("log", _entry_name(seqs[-1])))
        return seqs[-1]

    # -- checkpoints -----------------------------------------------------------------------
    def checkpoints(self) -> list[Checkpoint]:
        """The whole checkpoints (their ``checkpoint.json`` written), oldest first."""
        base = self._path("checkpoints")
        try:
            if not self.fs.exists(base):
                return []
            found = []
            for name in self.fs.ls(base, detail=False):
                tail = str(name).rstrip("/").rsplit("/", 1)[-1]
                done = f"{base}/{tail}/{CHECKPOINT_DONE}"
                if tail.isdigit() and self.fs.exists(done):
                    info = json.loads(self.fs.cat_file(done))
                    found.append(Checkpoint(int(tail), float(info["created"]), int(info["bytes"])))
        except Exception as exc:
            raise self._storage("listing its checkpoints", exc) from exc
        return sorted(found, key=lambda c: c.seq)

    def put_checkpoint(self, seq: int, data_file: Path) -> Checkpoint:
        """Upload a store copy (``data_file``, a fresh-page ``data.mdb`` as of transaction ``seq``)."""
        self._refuse_if_read_only(f"writing checkpoint {seq}")
        folder = self._path("checkpoints", f"{seq:0{SEQ_DIGITS}d}")
        size = data_file.stat().st_size
        try:
            self._mkdirs(folder)
            self.fs.put_file(str(data_file), f"{folder}/data.mdb")
            if self.local:
                _fsync_file(Path(f"{folder}/data.mdb"))
            info = {"seq": seq, "created": time.time(), "bytes": size}
            self.fs.pipe_file(f"{folder}/{CHECKPOINT_DONE}", json.dumps(info).encode())
            if self.local:
                _fsync_file(Path(f"{folder}/{CHECKPOINT_DONE}"))
                _fsync_dir(Path(folder))
        except Exception as exc:
            raise self._storage(f"writing checkpoint {seq}", exc) from exc
        return Checkpoint(seq, info["created"], size)

    def fetch_checkpoint(self, checkpoint: Checkpoint, folder: Path) -> Path:
        """The checkpoint's ``data.mdb`` copied into ``folder``."""
        folder.mkdir(parents=True, exist_ok=True)
        target = folder / "data.mdb"
        try:
            self.fs.get_file(self._path("checkpoints", f"{checkpoint.seq:0{SEQ_DIGITS}d}", "data.mdb"), str(target))
        except Exception as exc:
            raise self._storage(f"fetching checkpoint {checkpoint.seq}", exc) from exc
        return target

    def prune(self, keep: int) -> dict[str, int]:
        """Keep the last ``keep`` checkpoints, and the log entries after the newest: what the
        newest checkpoint holds needs no entry to come back."""
        self._refuse_if_read_only("pruning")
        found = self.checkpoints()
        if not found:
            return {"checkpoints_removed": 0, "entries_removed": 0}
        old = found[: max(0, len(found) - max(1, keep))]
        try:
            for checkpoint in old:
                self.fs.rm(self._path("checkpoints", f"{checkpoint.seq:0{SEQ_DIGITS}d}"), recursive=True)
            covered = [s for s in self.sequence_numbers() if s <= found[-1].seq]
            if covered:
                self.fs.rm([self._path("log", _entry_name(s)) for s in covered])
        except Exception as exc:
            raise self._storage("pruning", exc) from exc
        return {"checkpoints_removed": len(old), "entries_removed": len(covered)}

    def is_empty(self) -> bool:
        """No entry and no checkpoint: a new log."""
        return self.head() == 0 and not self.checkpoints()

    def status(self) -> dict[str, Any]:
        """Head, the newest checkpoint, and how many entries lie after it (what a rebuild replays)."""
        seqs = self.sequence_numbers()
        found = self.checkpoints()
        newest = found[-1] if found else None
        head = seqs[-1] if seqs else (newest.seq if newest else 0)
        return {
            "uri": self.uri,
            "head": head,
            "checkpoint_seq": newest.seq if newest else None,
            "checkpoint_created": newest.created if newest else None,
            "entries_after_checkpoint": head - (newest.seq if newest else 0),
        }


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _create_durably(path: Path, data: bytes) -> None:
    """``path`` holding ``data``, created only if absent (FileExistsError otherwise), on disk
    before returning: written to a temporary file and fsynced, hard-linked in (atomic and
    exclusive), the folder fsynced."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=f".{uuid.uuid4().hex[:8]}", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.link(tmp, path)
    finally:
        os.unlink(tmp)
    _fsync_dir(path.parent)


def open_shared_log(uri: str, endpoint_url: str = "", *, read_only: bool = False) -> SharedLog | None:
    """The shared log at ``uri`` (None when ``uri`` is empty: durability off); ``endpoint_url``:
    an S3-compatible server's address for ``s3://`` addresses."""
    if not uri:
        return None
    options: dict[str, Any] = {}
    if endpoint_url and uri.startswith(("s3://", "s3a://")):
        options["endpoint_url"] = endpoint_url
    return SharedLog(uri, read_only=read_only, **options)


def shard_logs(uri: str, endpoint_url: str = "") -> list[str]:
    """The shared logs directly under ``uri`` (a deployment's ``<durable_uri>/<namespace>``:
    its ``shard-NN`` folders), sorted; each holds an ``identity.json``."""
    root = open_shared_log(uri, endpoint_url, read_only=True)
    if root is None:
        return []
    try:
        names = sorted(str(n).rstrip("/").rsplit("/", 1)[-1] for n in root.fs.ls(root.root, detail=False))
        found = [name for name in names if root.fs.exists(f"{root.root}/{name}/identity.json")]
    except FileNotFoundError:
        return []
    except Exception as exc:
        raise SharedLogError(f"{uri}: cannot list its shard logs ({type(exc).__name__}: {exc})") from exc
    return [f"{root.uri}/{name}" for name in found]
