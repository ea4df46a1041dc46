"""A store's side of its shared log (:mod:`lifemem_ray.engine.store.shared_log`): every write
transaction recorded and appended before it commits, the local copy brought up to the log
when it opens, checkpoints.

The rules, all applied when the store opens for writing with a shared log:

* **No local copy** (a shard rebuilt on another node): the newest checkpoint is fetched, then
  the entries after it are replayed. With no checkpoint the log starts at entry 1 (the store's
  creation), and replaying it all gives the store back.
* **A local copy behind the log** (its node came back after the shard moved away and back, or
  a local commit failed after its entry was appended): the entries it lacks are replayed; if
  the log no longer reaches back that far (a checkpoint retired them), the local copy is moved
  aside (``data.mdb.behind-<time>``, never deleted) and the newest checkpoint replaces it.
* **A local copy ahead of a log that has entries** is an error (another log, or one rolled
  back): nothing is changed, the operator decides.
* **A store with content and an empty log** (durability turned on for an existing store): a
  checkpoint is written first, so the log can rebuild it.

``redo_seq`` in the store's meta table is the last entry the local copy holds; it is written
in the same transaction as the changes it numbers, and is itself part of the entry.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import lmdb

from lifemem_ray.core.errors import StoreError
from lifemem_ray.engine.store import codec
from lifemem_ray.engine.store.lmdb_rewrite import write_fresh_copy
from lifemem_ray.engine.store.shared_log import LogForkedError, Op, SharedLog, SharedLogError

__all__ = ["REDO_SEQ", "RecordingTxn", "RedoLogger"]

log = logging.getLogger(__name__)

REDO_SEQ = b"redo_seq"  # meta key: the last shared-log entry this store holds
CHECKPOINT_STAGING = "checkpointing"  # folder inside the store where a checkpoint's copy is written
REPLAY_TXN_ENTRIES = 256  # log entries applied per local write transaction while catching up


class RecordingTxn:
    """An LMDB write transaction that notes every put and delete it makes (:data:`Op`s). The
    store's changes use ``put(key, value, db=...)`` and ``delete(key, db=...)`` only; any
    other writing call is refused, so no change can escape the log."""

    __slots__ = ("_names", "_txn", "ops")

    def __init__(self, txn: lmdb.Transaction, names: dict[int, str]) -> None:
        self._txn = txn  # the real transaction: reads pass through
        self._names = names  # id(table handle) -> table name, the names entries use
        self.ops: list[Op] = []  # what this transaction changed, in order

    def put(self, key: bytes, value: bytes, *, db: Any = None, **flags: Any) -> bool:
        if flags:
            raise StoreError(f"a logged transaction refuses put flags {sorted(flags)}: replay could not repeat them")
        self.ops.append((self._name(db), bytes(key), bytes(value)))
        return bool(self._txn.put(key, value, db=db))

    def delete(self, key: bytes, value: bytes = b"", *, db: Any = None) -> bool:
        if value:
            raise StoreError("a logged transaction refuses deleting one duplicate value")
        done = bool(self._txn.delete(key, db=db))
        if done:
            self.ops.append((self._name(db), bytes(key), None))
        return done

    def _name(self, db: Any) -> str:
        name = self._names.get(id(db))
        if name is None:
            raise StoreError("a logged transaction wrote to a table the store did not open")
        return name

    def __getattr__(self, name: str) -> Any:
        if name in ("replace", "pop", "drop"):
            raise StoreError(f"a logged transaction refuses {name}(): use put and delete")
        return getattr(self._txn, name)


def apply_ops(txn: lmdb.Transaction, tables: dict[str, Any], ops: Iterable[Op], where: str) -> None:
    """Repeat logged changes in ``txn``."""
    for table, key, value in ops:
        db = tables.get(table)
        if db is None:
            raise SharedLogError(f"{where}: a log entry names table {table!r}, which this store does not have")
        if value is None:
            txn.delete(key, db=db)
        else:
            txn.put(key, value, db=db)


def local_seq(txn: lmdb.Transaction, meta: Any) -> int:
    """The last shared-log entry the store holds (0: none)."""
    raw = txn.get(REDO_SEQ, db=meta)
    return int(codec.unpack(bytes(raw))) if raw else 0


class RedoLogger:
    """What a store does with its shared log (see the module docstring for the rules)."""

    def __init__(self, shared: SharedLog, path: Path) -> None:
        self.shared = shared  # where the entries and checkpoints go
        self.path = path  # the store's folder on this node
        self.seq = 0  # the last entry the local copy holds (committed here)
        self.appended = 0  # the last entry appended by this process (> seq after a failed local commit)

    # -- opening ---------------------------------------------------------------------------
    def prepare_folder(self) -> bool:
        """Before LMDB opens: an absent local copy becomes the newest checkpoint (if any).
        Returns whether one was fetched."""
        if (self.path / "data.mdb").exists():
            return False
        self.shared.drop_torn_tail()
        found = self.shared.checkpoints()
        if not found:
            return False
        self.shared.fetch_checkpoint(found[-1], self.path)
        log.info("%s: fetched checkpoint %d from %s", self.path, found[-1].seq, self.shared.uri)
        return True

    def behind_reach(self, txn: lmdb.Transaction, meta: Any) -> bool:
        """Whether the local copy is older than anything the log can bring up to date."""
        seq = local_seq(txn, meta)
        seqs = self.shared.sequence_numbers()
        found = self.shared.checkpoints()
        return bool(found) and found[-1].seq > seq and (not seqs or seqs[0] > seq + 1)

    def set_aside(self) -> Path:
        """Move the local data file aside (kept, never deleted) so a checkpoint can replace it."""
        aside = self.path / f"data.mdb.behind-{int(time.time())}"
        (self.path / "data.mdb").rename(aside)
        (self.path / "lock.mdb").unlink(missing_ok=True)
        log.warning("%s: the local copy is older than the shared log reaches; moved aside to %s", self.path, aside)
        return aside

    def recover(self, env: lmdb.Environment, tables: dict[str, Any], grow: Any) -> int:
        """Bring the local copy up to the log's head; returns how many entries were replayed."""
        self.shared.drop_torn_tail()
        with env.begin() as txn:
            self.seq = local_seq(txn, tables["meta"])
            raw_id = txn.get(b"store_id", db=tables["meta"])
        store_id = codec.unpack(bytes(raw_id)) if raw_id else None
        owner = self.shared.owner()
        if store_id and owner and owner != store_id:
            raise LogForkedError(
                f"{self.path}: the shared log at {self.shared.uri} belongs to store {owner}, not to this store "
                f"({store_id}); give each store (each deployment's namespace) its own durable address; nothing was changed"
            )
        head = self.shared.head()
        if head < self.seq and head > 0:
            raise LogForkedError(
                f"{self.path}: the local store holds shared-log entry {self.seq}, but the log at {self.shared.uri} ends at "
                f"{head}: it is another store's log or was rolled back; nothing was changed"
            )
        replayed = self._replay(env, tables, grow, head) if head > self.seq else 0
        self.appended = self.seq
        return replayed

    def catch_up(self, env: lmdb.Environment, tables: dict[str, Any], grow: Any) -> None:
        """Before a write: replay the entries appended here whose local commit failed."""
        if self.appended > self.seq:
            self._replay(env, tables, grow, self.appended)

    def _replay(self, env: lmdb.Environment, tables: dict[str, Any], grow: Any, upto: int) -> int:
        started, pending = self.seq, list[tuple[int, list[Op]]]()
        entries = self.shared.entries(after=self.seq, upto=upto)
        for seq, ops in entries:
            pending.append((seq, ops))
            if len(pending) >= REPLAY_TXN_ENTRIES:
                self._apply(env, tables, grow, pending)
                pending = []
        if pending:
            self._apply(env, tables, grow, pending)
        if self.seq != upto:
            raise SharedLogError(f"{self.path}: the shared log {self.shared.uri} ended at {self.seq}, expected {upto}")
        log.info("%s: replayed shared-log entries %d..%d", self.path, started + 1, upto)
        return upto - started

    def _apply(
        self, env: lmdb.Environment, tables: dict[str, Any], grow: Any, entries: list[tuple[int, list[Op]]]
    ) -> None:
        while True:
            try:
                with env.begin(write=True) as txn:
                    for seq, ops in entries:
                        apply_ops(txn, tables, ops, f"{self.shared.uri} entry {seq}")
                    txn.put(REDO_SEQ, codec.pack(entries[-1][0]), db=tables["meta"])
                break
            except lmdb.MapFullError:
                grow()
        self.seq = entries[-1][0]

    def bind(self, store_id: str, env: lmdb.Environment, meta: Any, holds_content: bool) -> None:
        """After the schema check: the log belongs to this store; an existing store whose log is
        empty is checkpointed first, so the log can rebuild it."""
        self.shared.claim(store_id)
        if holds_content and self.shared.head() == 0 and not self.shared.checkpoints():
            done = self.checkpoint(env, meta, keep=1)
            log.info("%s: first checkpoint to %s (%d bytes)", self.path, self.shared.uri, done["bytes"])

    # -- writing ---------------------------------------------------------------------------
    def append(self, txn: RecordingTxn, meta: Any) -> None:
        """Number the transaction's changes and append them, before the local commit."""
        if not txn.ops:
            return
        seq = self.seq + 1
        txn.put(REDO_SEQ, codec.pack(seq), db=meta)
        self.shared.append(seq, txn.ops)
        self.appended = seq

    def committed(self) -> None:
        self.seq = self.appended

    # -- checkpoints -----------------------------------------------------------------------
    def checkpoint(self, env: lmdb.Environment, meta: Any, keep: int) -> dict[str, Any]:
        """A fresh-page copy of the store as of one read transaction, uploaded as a checkpoint;
        then the checkpoints beyond the last ``keep`` and the entries it covers are removed."""
        staging = self.path / CHECKPOINT_STAGING
        shutil.rmtree(staging, ignore_errors=True)
        started = time.monotonic()
        try:
            with env.begin() as txn:
                seq = local_seq(txn, meta)
                found = self.shared.checkpoints()
                if found and found[-1].seq == seq:  # nothing new: only the pruning
                    return {"seq": seq, "bytes": found[-1].bytes, "skipped": True, "pruned": self.shared.prune(keep)}
                copy = write_fresh_copy(env, txn, staging)
            made = self.shared.put_checkpoint(seq, copy.data_file)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        pruned = self.shared.prune(keep)
        return {
            "seq": made.seq,
            "bytes": made.bytes,
            "seconds": round(time.monotonic() - started, 3),
            "skipped": False,
            "pruned": pruned,
        }
