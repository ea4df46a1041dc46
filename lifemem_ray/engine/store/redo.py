"""A store's side of its shared log (:mod:`lifemem_ray.engine.store.shared_log`): every write
transaction recorded and appended before it commits, the local copy brought up to the log
when it opens, the log taken over with a new epoch, checkpoints.

The rules, all applied when the store opens for writing with a shared log:

* **No local copy** (a shard rebuilt on another node): the newest whole checkpoint is
  fetched (its sha256 checked; a damaged one falls back to the one before it, whose log
  entries are kept), then the entries after it are replayed. With no checkpoint the log
  starts at entry 1 (the store's creation), and replaying it all gives the store back.
* **A local copy behind the log** (its node came back after the shard moved away and back, or
  a local commit failed after its entry was appended): the entries it lacks are replayed; if
  the log no longer reaches back that far (a checkpoint retired them), the local copy is moved
  aside (``data.mdb.behind-<time>``, never deleted) and the newest checkpoint replaces it.
* **A local copy ahead of a log that has entries** is an error (another log, or one rolled
  back): nothing is changed, the operator decides.
* **A damaged entry is never removed.** A copy that must replay it is refused
  (:class:`~lifemem_ray.engine.store.log_errors.LogDamagedError`, naming the entry and the
  ways out); a copy that already holds it opens, and writes a checkpoint at once, so that the
  log can rebuild the store again without that entry.
* **Another deployment's log** (its last writer's owner is not this one's) is refused
  before anything is fetched or changed.
* **Taking over:** the opening takes an epoch above every writer's so far and appends a
  fence entry with it; a writer of a lower epoch still running is deposed at its next append.
* **A store with content and an empty log** (durability turned on for an existing store): a
  checkpoint is written first, so the log can rebuild it.

``redo_seq`` in the store's meta table is the last entry the local copy holds, ``writer`` the
latest fence; both are written in the same transaction as what they describe, and are part of
the entry.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import lmdb

from lifemem_ray.core.errors import StoreError
from lifemem_ray.engine.store import codec
from lifemem_ray.engine.store.lmdb_rewrite import write_fresh_copy
from lifemem_ray.engine.store.log_errors import (
    CheckpointDamagedError,
    EntryTakenError,
    LogDamagedError,
    LogForkedError,
    SharedLogError,
)
from lifemem_ray.engine.store.shared_log import Entry, Op, SharedLog, Writer

__all__ = ["REDO_SEQ", "WRITER", "RecordingTxn", "RedoLogger"]

log = logging.getLogger(__name__)

REDO_SEQ = b"redo_seq"  # meta key: the last shared-log entry this store holds
WRITER = b"writer"  # meta key: [owner, epoch, time] of the latest opening for writing (its fence entry)
CHECKPOINT_STAGING = "checkpointing"  # folder inside the store where a checkpoint's copy is written
REPLAY_TXN_ENTRIES = 256  # log entries applied per local write transaction while catching up
TAKEOVER_ATTEMPTS = 8  # fences tried while another writer keeps appending, before giving up

Grow = Callable[[], None]


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
            raise SharedLogError(f"a log entry names table {table!r}, which this store does not have", where=where)
        if value is None:
            txn.delete(key, db=db)
        else:
            txn.put(key, value, db=db)


def local_seq(txn: lmdb.Transaction, meta: Any) -> int:
    """The last shared-log entry the store holds (0: none)."""
    raw = txn.get(REDO_SEQ, db=meta)
    return int(codec.unpack(bytes(raw))) if raw else 0


def local_writer(txn: lmdb.Transaction, meta: Any) -> Writer:
    """The latest opening for writing the store holds (epoch 0: none)."""
    raw = txn.get(WRITER, db=meta)
    if not raw:
        return Writer()
    owner, epoch, _ = codec.unpack(bytes(raw))
    return Writer(str(owner), int(epoch))


class RedoLogger:
    """What a store does with its shared log (see the module docstring for the rules)."""

    def __init__(self, shared: SharedLog, path: Path, *, stop_before: int | None = None) -> None:
        self.shared = shared  # where the entries and checkpoints go
        self.path = path  # the store's folder on this node
        self.stop_before = stop_before  # replay only entries before this one (a loss the operator accepted)
        self.seq = 0  # the last entry the local copy holds (committed here)
        self.appended = 0  # the last entry appended by this process (> seq after a failed local commit)
        self.writer: Writer | None = None  # this opening's (owner, epoch), once it took the log over
        self.deposed: LogForkedError | None = None  # set when another writer took over: every write refused
        self.repairs: dict[int, str] = {}  # damaged entries this copy held: a checkpoint replaces them
        self.repaired: list[int] = []  # damaged entries a checkpoint of this copy replaced (reported)

    # -- opening ---------------------------------------------------------------------------
    def prepare_folder(self) -> bool:
        """Before LMDB opens: an absent local copy becomes the newest whole checkpoint (if any).
        Returns whether one was fetched.

        Raises:
            LogForkedError: the log was last written by another deployment.
            CheckpointDamagedError: no checkpoint is whole and the log does not reach back to entry 1.
        """
        if (self.path / "data.mdb").exists():
            return False
        self._refuse_other_owner(self.shared.last_writer())
        found = self.shared.checkpoints()
        seqs = self.shared.sequence_numbers()
        problems: dict[int, str] = {}
        for checkpoint in reversed(found):
            later = [s for s in seqs if s > checkpoint.seq]
            if later and later[0] != checkpoint.seq + 1:
                problems[checkpoint.seq] = f"the log no longer holds entry {checkpoint.seq + 1}, the one after it"
                continue
            problem = self.shared.fetch_checkpoint(checkpoint, self.path)
            if problem is None:
                if problems:
                    log.error(
                        "%s: checkpoints %s of %s are damaged (%s); started from checkpoint %d and the log after it",
                        self.path,
                        sorted(problems),
                        self.shared.uri,
                        problems,
                        checkpoint.seq,
                    )
                log.info("%s: fetched checkpoint %d from %s", self.path, checkpoint.seq, self.shared.uri)
                return True
            problems[checkpoint.seq] = problem
        if problems and seqs and seqs[0] != 1:
            raise CheckpointDamagedError(self.shared.uri, problems, seqs[0])
        return False

    def _refuse_other_owner(self, last: Writer | None) -> None:
        owner = self.shared.owner
        if owner and last is not None and last.owner and last.owner != owner:
            raise LogForkedError(
                f"{self.path}: the shared log at {self.shared.uri} was last written by deployment {last.owner} "
                f"(epoch {last.epoch}), not by this deployment ({owner}); two deployments cannot write one store's "
                "log: give this deployment its own cluster.namespace or cluster.durable_uri; nothing was changed"
            )

    def covered(self, seq: int) -> bool:
        """Whether a checkpoint at or after entry ``seq`` exists (a copy that cannot replay
        ``seq`` can start from it instead)."""
        found = self.shared.checkpoints()
        return bool(found) and found[-1].seq >= seq

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

    def recover(self, env: lmdb.Environment, tables: dict[str, Any], grow: Grow) -> int:
        """Bring the local copy up to the log's head (or to the entry before ``stop_before``),
        then look at the entries it held already (a scrub). Returns how many entries were
        replayed.

        Raises:
            LogForkedError: the log is another store's or another deployment's, or was rolled back.
            LogDamagedError: an entry this copy lacks cannot be read (nothing was changed by it).
        """
        with env.begin() as txn:
            self.seq = local_seq(txn, tables["meta"])
            raw_id = txn.get(b"store_id", db=tables["meta"])
            held_writer = local_writer(txn, tables["meta"])
        store_id = codec.unpack(bytes(raw_id)) if raw_id else None
        belongs = self.shared.identity()
        if store_id and belongs and belongs != store_id:
            raise LogForkedError(
                f"{self.path}: the shared log at {self.shared.uri} belongs to store {belongs}, not to this store "
                f"({store_id}); give each store (each deployment's namespace) its own durable address; nothing was changed"
            )
        self._refuse_other_owner(self.shared.last_writer() or held_writer)
        head = self.shared.head()
        if head < self.seq and head > 0:
            raise LogForkedError(
                f"{self.path}: the local store holds shared-log entry {self.seq}, but the log at {self.shared.uri} ends at "
                f"{head}: it is another store's log or was rolled back; nothing was changed"
            )
        if store_id and not self.shared.read_only and self.shared.is_empty():
            self.shared.claim(store_id)  # durability turned on for an existing store: the log starts from it
            done = self.checkpoint(env, tables["meta"], keep=1)
            log.info("%s: first checkpoint to %s (%d bytes)", self.path, self.shared.uri, done["bytes"])
        if self.stop_before is not None:
            head = min(head, self.stop_before - 1)
        held = self.seq
        replayed = self._replay(env, tables, grow, head) if head > self.seq else 0
        self.appended = self.seq
        if not self.shared.read_only:
            self._scrub(held)
        return replayed

    def _scrub(self, held: int) -> None:
        """Entries this copy held when it opened (so did not replay) but the log cannot give back:
        noted in :attr:`repairs`, for a checkpoint to replace them."""
        found = self.shared.checkpoints()
        self.repairs = self.shared.damaged(found[-1].seq if found else 0, held)
        if self.repairs:
            log.error(
                "%s: shared-log entries %s of %s are damaged (%s); this copy holds them, so a checkpoint is written to "
                "replace them",
                self.path,
                sorted(self.repairs),
                self.shared.uri,
                self.repairs,
            )

    def take_over(self, env: lmdb.Environment, tables: dict[str, Any], grow: Grow) -> Writer:
        """This opening's epoch (above every writer's so far), written as a fence entry: a writer
        of a lower epoch still running is deposed at its next append.

        Raises:
            SharedLogError: another writer kept appending through every attempt.
        """
        names = {id(db): name for name, db in tables.items()}
        for _ in range(TAKEOVER_ATTEMPTS):
            with env.begin() as txn:
                held = local_writer(txn, tables["meta"])
            last = self.shared.last_writer() or Writer()
            writer = Writer(self.shared.owner, max(held.epoch, last.epoch) + 1)
            try:
                with env.begin(write=True) as raw:
                    fence = RecordingTxn(raw, names)
                    fence.put(WRITER, codec.pack([writer.owner, writer.epoch, time.time()]), db=tables["meta"])
                    self._append_as(fence, tables["meta"], writer)
                self.committed()
            except EntryTakenError:  # another writer appended meanwhile: catch up and try above it
                self._replay(env, tables, grow, self.shared.head())
                continue
            self.writer = writer
            return writer
        raise SharedLogError(
            f"{self.path}: could not take the shared log at {self.shared.uri} over: another writer appended before "
            f"each of {TAKEOVER_ATTEMPTS} attempts; stop the other writer of this store"
        )

    def catch_up(self, env: lmdb.Environment, tables: dict[str, Any], grow: Grow) -> None:
        """Before a write: refuse if deposed; replay the entries appended here whose local commit failed."""
        if self.deposed is not None:
            raise self._deposed_error()
        if self.appended > self.seq:
            self._replay(env, tables, grow, self.appended)

    def _replay(self, env: lmdb.Environment, tables: dict[str, Any], grow: Grow, upto: int) -> int:
        started, pending = self.seq, list[Entry]()
        try:
            for entry in self.shared.entries(after=self.seq, upto=upto):
                pending.append(entry)
                if len(pending) >= REPLAY_TXN_ENTRIES:
                    self._apply(env, tables, grow, pending)
                    pending = []
        except LogDamagedError as exc:
            if pending:
                self._apply(env, tables, grow, pending)
            raise LogDamagedError(exc.uri, exc.seq, exc.problem, self._damage_remedy(exc.seq, upto)) from None
        if pending:
            self._apply(env, tables, grow, pending)
        if self.seq != upto:
            raise SharedLogError(f"{self.path}: the shared log {self.shared.uri} ended at {self.seq}, expected {upto}")
        log.info("%s: replayed shared-log entries %d..%d", self.path, started + 1, upto)
        return upto - started

    def _damage_remedy(self, seq: int, head: int) -> str:
        folder = self.shared.uri.rstrip("/").rsplit("/", 1)[-1]
        return (
            f"it was acknowledged, so a store rebuilt without it would lack acknowledged writes: nothing was served "
            f"from {self.path}. Ways out: (1) open the store where a local copy holds entry {seq} (the shard's old "
            "node or disk): it opens, and writes a checkpoint that makes the log whole again; (2) restore from a "
            f"snapshot taken after entry {seq}; (3) accept the loss of entries {seq}..{head} explicitly: "
            f"`lifemem-ray restore <durable address> NEW_STORE --accept-loss {folder}:{seq}` makes a new deployment "
            f"of what the entries before {seq} hold"
        )

    def _apply(self, env: lmdb.Environment, tables: dict[str, Any], grow: Grow, entries: list[Entry]) -> None:
        while True:
            try:
                with env.begin(write=True) as txn:
                    for entry in entries:
                        apply_ops(txn, tables, entry.ops, f"{self.shared.uri} entry {entry.seq}")
                    txn.put(REDO_SEQ, codec.pack(entries[-1].seq), db=tables["meta"])
                break
            except lmdb.MapFullError:
                grow()
        self.seq = entries[-1].seq

    def bind(self, store_id: str, env: lmdb.Environment, meta: Any) -> None:
        """After the schema check: the log belongs to this store; damaged entries this copy held
        are replaced by a checkpoint (not pruning: the older checkpoints stay)."""
        self.shared.claim(store_id)
        if self.repairs and not self.shared.read_only:
            damaged = sorted(self.repairs)
            done = self.checkpoint(env, meta, keep=0)
            self.repaired = sorted(set(self.repaired) | set(damaged))
            log.warning(
                "%s: checkpoint %d written to %s replaces damaged entries %s",
                self.path,
                done["seq"],
                self.shared.uri,
                damaged,
            )

    # -- writing ---------------------------------------------------------------------------
    def append(self, txn: RecordingTxn, meta: Any) -> None:
        """Number the transaction's changes and append them, before the local commit.

        Raises:
            LogForkedError: this writer was taken over (then and at every later write).
        """
        if not txn.ops:
            return
        if self.deposed is not None:
            raise self._deposed_error()
        try:
            self._append_as(txn, meta, self.writer or Writer(self.shared.owner, 0))
        except LogForkedError as exc:
            self.deposed = exc
            raise

    def _deposed_error(self) -> LogForkedError:
        """Why this writer refuses writes (it was taken over)."""
        assert self.deposed is not None
        return self.deposed

    def _append_as(self, txn: RecordingTxn, meta: Any, writer: Writer) -> None:
        seq = self.seq + 1
        txn.put(REDO_SEQ, codec.pack(seq), db=meta)
        self.shared.append(seq, txn.ops, writer)
        self.appended = seq

    def committed(self) -> None:
        self.seq = self.appended

    def status(self) -> dict[str, Any]:
        """The log's status, what this copy holds, this writer, and whether it was deposed (a
        later writer's entry or checkpoint found now counts: no write is needed to know)."""
        last = self.shared.last_writer()
        if self.deposed is None and self.writer is not None and last is not None and last.epoch > self.writer.epoch:
            self.deposed = LogForkedError(
                f"shared log {self.shared.uri}: taken over by {last.owner or 'another opening of this store'} "
                f"(epoch {last.epoch}); this writer (epoch {self.writer.epoch}) refuses every further write"
            )
        return {
            **self.shared.status(),
            "local_seq": self.seq,
            "writer": None if self.writer is None else {"owner": self.writer.owner, "epoch": self.writer.epoch},
            "deposed": None if self.deposed is None else str(self.deposed),
            "repaired_entries": self.repaired,  # replaced by a checkpoint of this copy
            "damaged_entries": sorted(self.repairs),  # found, a checkpoint not written yet
        }

    # -- checkpoints -----------------------------------------------------------------------
    def checkpoint(self, env: lmdb.Environment, meta: Any, keep: int) -> dict[str, Any]:
        """A fresh-page copy of the store as of one read transaction, uploaded as a checkpoint;
        then (``keep`` > 0) the checkpoints beyond the last ``keep`` and the entries before the
        oldest kept are removed."""
        if self.deposed is not None:
            raise self._deposed_error()
        staging = self.path / CHECKPOINT_STAGING
        shutil.rmtree(staging, ignore_errors=True)
        started = time.monotonic()
        try:
            with env.begin() as txn:
                seq = local_seq(txn, meta)
                found = self.shared.checkpoints()
                if found and found[-1].seq == seq:  # nothing new: only the pruning
                    pruned = self.shared.prune(keep) if keep > 0 else {}
                    return {"seq": seq, "bytes": found[-1].bytes, "skipped": True, "pruned": pruned}
                copy = write_fresh_copy(env, txn, staging)
            made = self.shared.put_checkpoint(seq, copy.data_file, self.writer or Writer(self.shared.owner, 0))
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        self.repairs = {s: why for s, why in self.repairs.items() if s > made.seq}
        return {
            "seq": made.seq,
            "bytes": made.bytes,
            "seconds": round(time.monotonic() - started, 3),
            "skipped": False,
            "pruned": self.shared.prune(keep) if keep > 0 else {},
        }
