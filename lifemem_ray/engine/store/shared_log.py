"""A store's committed transactions on shared storage: the redo log and checkpoints that let a
store lost with its node be rebuilt on another node with nothing acknowledged missing.

Where: a folder every node sees (a shared filesystem path, ``/mnt/shared/lifemem/shard-00``) or
an S3-compatible bucket prefix (``s3://bucket/lifemem/shard-00``, through ``fsspec`` / ``s3fs``).
The layout under that address::

    identity.json                       {"store_id": ...}: the one store this log belongs to
    log/<seq, 20 digits>.txn            one committed write transaction (below)
    checkpoints/<seq>/data.mdb          a fresh-page copy of the store as of transaction <seq>
    checkpoints/<seq>/checkpoint.json   written last: the checkpoint is whole (and its sha256)

A log entry is every put and delete of one LMDB write transaction (table, key, value) and the
writer that made it (its owner, a deployment's id, and its epoch), framed (magic, crc32,
msgpack). :meth:`SharedLog.append` returns only once the entry is durable there (written to a
temporary file, ``fsync``, linked into place, the folder fsynced on a filesystem; a completed
PUT on object storage), so a visible entry is whole and was acknowledged: a damaged one is
damage, never a torn write, and is never removed (:class:`LogDamagedError` names it).

Appends refuse a sequence number already written (exclusive create; ``If-None-Match`` on S3).
Each opening of a store for writing takes a higher *epoch* and first appends a fence entry
with it (:mod:`lifemem_ray.engine.store.redo`): a writer that was taken over (a shard rebuilt
on another node while the old one still runs) finds the fence at its next append and is
deposed (:class:`WriterDeposedError`) instead of forking the log. The same entry written twice
by one writer (an append retried after a lost answer) is recognised as its own.

The store appends *before* it commits locally (write-ahead), so whatever it acknowledges is in
the log; an entry whose local commit then failed was never acknowledged and is replayed
harmlessly (the store catches up with its log before its next write). Replaying a checkpoint
plus the entries after it gives back the store's exact tables: the entries are physical
(key-value), so splits, skills and deletions come back as they were. Checkpoints are checked
against their sha256 when fetched, and the log keeps the entries after the *oldest* kept
checkpoint, so a damaged newest checkpoint falls back to the one before it plus the log.

>>> import tempfile
>>> log = SharedLog(tempfile.mkdtemp())
>>> log.append(1, [("meta", b"k", b"v")], Writer("deployment-a", 1))
>>> [(e.seq, e.ops, e.writer.epoch) for e in log.entries(after=0)]
[(1, [('meta', b'k', b'v')], 1)]
"""

from __future__ import annotations

import hashlib
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

from lifemem_ray.engine.store.log_errors import (
    EntryTakenError,
    LogDamagedError,
    LogForkedError,
    SharedLogError,
    WriterDeposedError,
)

__all__ = [
    "Checkpoint",
    "Entry",
    "LogForkedError",
    "Op",
    "SharedLog",
    "SharedLogError",
    "Writer",
    "create_exclusive",
    "open_shared_log",
    "shard_logs",
]

log = logging.getLogger(__name__)

Op: TypeAlias = tuple[str, bytes, bytes | None]  # (table, key, value); value None: the key was deleted
MAGIC_V1 = b"LMRL\x01"  # lifemem redo log, format 1: [seq, ops]
MAGIC = b"LMRL\x02"  # format 2: [seq, ops, owner, epoch]
_FRAME = struct.Struct(">5sI")  # magic, crc32 of the payload
SEQ_DIGITS = 20
ENTRY_SUFFIX = ".txn"
CHECKPOINT_DONE = "checkpoint.json"
_HASH_CHUNK = 1 << 20


@dataclass(frozen=True)
class Writer:
    """Who appended an entry: ``owner`` (a deployment's id; empty for a store used on its own)
    and ``epoch`` (each opening of the store for writing takes a higher one; 0: an entry of
    format 1, written before epochs)."""

    owner: str = ""
    epoch: int = 0

    def as_tuple(self) -> tuple[str, int]:
        return (self.owner, self.epoch)


@dataclass(frozen=True)
class Entry:
    """One committed write transaction of the log."""

    seq: int
    ops: list[Op]
    writer: Writer


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint in the log's storage whose ``checkpoint.json`` was written: the store as of
    transaction ``seq``; ``sha256`` of its data file (empty: written before checksums)."""

    seq: int
    created: float
    bytes: int
    sha256: str = ""
    writer: Writer = Writer()


def encode_entry(seq: int, ops: Sequence[Op], writer: Writer = Writer()) -> bytes:
    """The framed bytes of entry ``seq``."""
    payload = msgpack.packb([seq, [list(op) for op in ops], writer.owner, writer.epoch], use_bin_type=True)
    return _FRAME.pack(MAGIC, zlib.crc32(payload)) + payload


def decode_entry(data: bytes, uri: str, seq: int) -> Entry:
    """Entry ``seq`` of the log at ``uri`` from its bytes.

    Raises:
        LogDamagedError: the bytes are not the entry as written (truncated, altered, or
            holding another sequence number).
    """
    if len(data) < _FRAME.size:
        raise LogDamagedError(uri, seq, f"{len(data)} bytes, shorter than its frame")
    magic, crc = _FRAME.unpack_from(data)
    payload = data[_FRAME.size :]
    if magic not in (MAGIC, MAGIC_V1):
        raise LogDamagedError(uri, seq, "bad magic")
    if zlib.crc32(payload) != crc:
        raise LogDamagedError(uri, seq, "checksum mismatch")
    try:
        fields = msgpack.unpackb(payload, raw=False)
        got, ops = int(fields[0]), [(str(t), bytes(k), None if v is None else bytes(v)) for t, k, v in fields[1]]
        writer = Writer(str(fields[2]), int(fields[3])) if magic == MAGIC else Writer()
    except (ValueError, TypeError, IndexError, msgpack.UnpackException) as exc:
        raise LogDamagedError(uri, seq, f"unreadable payload: {exc}") from None
    if got != seq:
        raise LogDamagedError(uri, seq, f"holds entry {got}")
    return Entry(got, ops, writer)


def _entry_name(seq: int) -> str:
    return f"{seq:0{SEQ_DIGITS}d}{ENTRY_SUFFIX}"


def _checkpoint_folder(seq: int) -> str:
    return f"{seq:0{SEQ_DIGITS}d}"


def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class SharedLog:
    """The redo log and checkpoints of one store at ``uri`` (a path or an fsspec URL).

    ``storage_options`` go to fsspec (for S3: ``endpoint_url``, ``key``, ``secret``...; s3fs
    also reads the usual ``AWS_*`` environment variables). ``owner`` names the writer's
    deployment: a log whose last writer is another deployment is not taken over."""

    def __init__(self, uri: str, *, read_only: bool = False, owner: str = "", **storage_options: Any) -> None:
        import fsspec
        from fsspec.core import url_to_fs

        self.uri = str(uri).rstrip("/")
        self.read_only = read_only  # only read: a copy made from the log (restore) never writes to it
        self.owner = owner  # the deployment that writes through this handle ("": a store on its own)
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

    def _refuse_if_read_only(self, what: str) -> None:
        if self.read_only:
            raise SharedLogError(f"shared log {self.uri}: opened to read only, {what} refused")

    # -- writing ---------------------------------------------------------------------------
    def append(self, seq: int, ops: Sequence[Op], writer: Writer) -> None:
        """Entry ``seq`` made durable in the log.

        Raises:
            WriterDeposedError: a writer of a higher epoch holds ``seq`` (this one was taken over).
            EntryTakenError: another writer of no higher epoch holds ``seq``.
            SharedLogError: the storage failed.
        """
        self._refuse_if_read_only(f"appending entry {seq}")
        data = encode_entry(seq, ops, writer)
        path = self._path("log", _entry_name(seq))
        try:
            self._mkdirs(self._path("log"))
            create_exclusive(self, path, data)
        except FileExistsError:
            self._already_there(seq, data, writer)
        except SharedLogError:
            raise
        except Exception as exc:
            raise self._storage(f"appending entry {seq}", exc) from exc

    def _already_there(self, seq: int, data: bytes, writer: Writer) -> None:
        """Entry ``seq`` exists: ours (an append retried after its answer was lost), or whose."""
        try:
            existing = self.fs.cat_file(self._path("log", _entry_name(seq)))
        except Exception as exc:
            raise self._storage(f"reading entry {seq} back", exc) from exc
        if existing == data:
            return  # this writer's own earlier attempt reached the storage
        try:
            other = decode_entry(existing, self.uri, seq).writer
        except LogDamagedError:
            other = Writer()
        if other.epoch > writer.epoch:
            raise WriterDeposedError(self.uri, seq, writer.as_tuple(), other.as_tuple())
        raise EntryTakenError(self.uri, seq, other.as_tuple())

    def claim(self, store_id: str) -> None:
        """Bind the log to ``store_id``: LogForkedError if it belongs to another store."""
        path = self._path("identity.json")
        try:
            if self.read_only or self.fs.exists(path):
                belongs = json.loads(self.fs.cat_file(path)).get("store_id")
                if belongs != store_id:
                    raise LogForkedError(
                        f"shared log {self.uri} belongs to store {belongs}, not to this store ({store_id}); give each "
                        "deployment (namespace) its own durable address, or move the old log away"
                    )
                return
            self._mkdirs(self.root)
            self.fs.pipe_file(path, json.dumps({"store_id": store_id, "created": time.time()}).encode())
        except SharedLogError:
            raise
        except Exception as exc:
            raise self._storage("reading its identity", exc) from exc

    def identity(self) -> str | None:
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
            number = base[: -len(ENTRY_SUFFIX)]
            if base.endswith(ENTRY_SUFFIX) and number.isascii() and number.isdigit():
                seqs.append(int(base[: -len(ENTRY_SUFFIX)]))
        return sorted(seqs)

    def head(self) -> int:
        """The last entry's sequence number (0: none)."""
        seqs = self.sequence_numbers()
        return seqs[-1] if seqs else 0

    def read_entry(self, seq: int) -> Entry:
        """Entry ``seq``. Raises LogDamagedError if it is not as written, SharedLogError if unreadable."""
        try:
            data = self.fs.cat_file(self._path("log", _entry_name(seq)))
        except Exception as exc:
            raise self._storage(f"reading entry {seq}", exc) from exc
        return decode_entry(data, self.uri, seq)

    def entries(self, after: int, upto: int | None = None) -> Iterator[Entry]:
        """Entries ``after`` < seq <= ``upto`` (default: all), in order, without gaps: a missing
        entry is an error (the log does not reach back that far), and so is a damaged one."""
        seqs = [s for s in self.sequence_numbers() if s > after and (upto is None or s <= upto)]
        expected = after + 1
        for seq in seqs:
            if seq != expected:
                raise SharedLogError(
                    f"shared log {self.uri}: entry {expected} is missing (next present: {seq}); the log cannot bring a "
                    f"store at transaction {after} up to date"
                )
            yield self.read_entry(seq)
            expected += 1

    def damaged(self, after: int, upto: int) -> dict[int, str]:
        """The entries ``after`` < seq <= ``upto`` present in the log that cannot be read back as
        written, each with its problem (a scrub: nothing is changed)."""
        found: dict[int, str] = {}
        for seq in self.sequence_numbers():
            if after < seq <= upto:
                try:
                    self.read_entry(seq)
                except LogDamagedError as exc:
                    found[seq] = exc.problem
        return found

    def last_writer(self) -> Writer | None:
        """The writer of the newest readable entry, else of the newest checkpoint (None: the log
        holds neither, or only entries written before epochs)."""
        for seq in reversed(self.sequence_numbers()[-8:]):
            try:
                return self.read_entry(seq).writer
            except LogDamagedError:
                continue
        found = self.checkpoints()
        return found[-1].writer if found else None

    # -- checkpoints -----------------------------------------------------------------------
    def checkpoints(self) -> list[Checkpoint]:
        """The checkpoints whose ``checkpoint.json`` was written, oldest first (their data files
        are checked when fetched: :meth:`fetch_checkpoint`)."""
        base = self._path("checkpoints")
        try:
            if not self.fs.exists(base):
                return []
            found = []
            for name in self.fs.ls(base, detail=False):
                tail = str(name).rstrip("/").rsplit("/", 1)[-1]
                done = f"{base}/{tail}/{CHECKPOINT_DONE}"
                if tail.isascii() and tail.isdigit() and self.fs.exists(done):
                    found.append(_checkpoint_of(int(tail), self.fs.cat_file(done)))
        except Exception as exc:
            raise self._storage("listing its checkpoints", exc) from exc
        return sorted(found, key=lambda c: c.seq)

    def put_checkpoint(self, seq: int, data_file: Path, writer: Writer = Writer()) -> Checkpoint:
        """Upload a store copy (``data_file``, a fresh-page ``data.mdb`` as of transaction ``seq``)
        with its sha256, ``checkpoint.json`` last."""
        self._refuse_if_read_only(f"writing checkpoint {seq}")
        folder = self._path("checkpoints", _checkpoint_folder(seq))
        made = Checkpoint(seq, time.time(), data_file.stat().st_size, file_sha256(data_file), writer)
        info = {
            "seq": seq,
            "created": made.created,
            "bytes": made.bytes,
            "sha256": made.sha256,
            "owner": writer.owner,
            "epoch": writer.epoch,
        }
        try:
            self._mkdirs(folder)
            self.fs.put_file(str(data_file), f"{folder}/data.mdb")
            if self.local:
                _fsync_file(Path(f"{folder}/data.mdb"))
            self.fs.pipe_file(f"{folder}/{CHECKPOINT_DONE}", json.dumps(info).encode())
            if self.local:
                _fsync_file(Path(f"{folder}/{CHECKPOINT_DONE}"))
                _fsync_dir(Path(folder))
        except Exception as exc:
            raise self._storage(f"writing checkpoint {seq}", exc) from exc
        return made

    def fetch_checkpoint(self, checkpoint: Checkpoint, folder: Path) -> str | None:
        """The checkpoint's ``data.mdb`` copied into ``folder`` and checked; returns None when it
        is whole, else what is wrong (the copy is then removed). SharedLogError if unreachable."""
        from lifemem_ray.engine.store.lmdb_check import problem_of_data_file

        folder.mkdir(parents=True, exist_ok=True)
        target = folder / "data.mdb"
        try:
            self.fs.get_file(self._path("checkpoints", _checkpoint_folder(checkpoint.seq), "data.mdb"), str(target))
        except FileNotFoundError:
            return "its data file is missing"
        except Exception as exc:
            raise self._storage(f"fetching checkpoint {checkpoint.seq}", exc) from exc
        if checkpoint.sha256 and file_sha256(target) != checkpoint.sha256:
            problem: str | None = "sha256 mismatch: its data file is not the one written"
        else:
            problem = problem_of_data_file(target)
        if problem is not None:
            target.unlink(missing_ok=True)
        return problem

    def prune(self, keep: int) -> dict[str, int]:
        """Keep the last ``keep`` checkpoints, and the log entries after the oldest of them (so
        that a damaged newer checkpoint can fall back to an older one plus the log)."""
        self._refuse_if_read_only("pruning")
        found = self.checkpoints()
        if not found:
            return {"checkpoints_removed": 0, "entries_removed": 0}
        kept = found[-max(1, keep) :]
        old = found[: len(found) - len(kept)]
        try:
            for checkpoint in old:
                self.fs.rm(self._path("checkpoints", _checkpoint_folder(checkpoint.seq)), recursive=True)
            covered = [s for s in self.sequence_numbers() if s <= kept[0].seq]
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
            "first_entry": seqs[0] if seqs else None,
            "checkpoints": len(found),
            "checkpoint_seq": newest.seq if newest else None,
            "checkpoint_created": newest.created if newest else None,
            "entries_after_checkpoint": head - (newest.seq if newest else 0),
        }


def _checkpoint_of(seq: int, raw: bytes) -> Checkpoint:
    info = json.loads(raw)
    writer = Writer(str(info.get("owner", "")), int(info.get("epoch", 0)))
    return Checkpoint(seq, float(info["created"]), int(info["bytes"]), str(info.get("sha256", "")), writer)


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


def create_exclusive(shared: SharedLog, path: str, data: bytes) -> None:
    """``path`` (under ``shared``'s storage) holding ``data``, created only if absent
    (FileExistsError otherwise), durable before returning. On a filesystem: written to a
    temporary file and fsynced, hard-linked in (atomic and exclusive), the folder fsynced; on
    object storage, one PUT with ``If-None-Match``."""
    if not shared.local:
        shared.fs.pipe_file(path, data, mode="create")
        return
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=f".{uuid.uuid4().hex[:8]}", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.link(tmp, target)
    finally:
        os.unlink(tmp)
    _fsync_dir(target.parent)


def open_shared_log(uri: str, endpoint_url: str = "", *, read_only: bool = False, owner: str = "") -> SharedLog | None:
    """The shared log at ``uri`` (None when ``uri`` is empty: durability off); ``endpoint_url``:
    an S3-compatible server's address for ``s3://`` addresses; ``owner``: the writing deployment."""
    if not uri:
        return None
    options: dict[str, Any] = {}
    if endpoint_url and uri.startswith(("s3://", "s3a://")):
        options["endpoint_url"] = endpoint_url
    return SharedLog(uri, read_only=read_only, owner=owner, **options)


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
