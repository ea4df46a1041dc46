"""What can go wrong with a store's shared log (:mod:`lifemem_ray.engine.store.shared_log`),
one class per kind, each carrying where it happened as data (``uri``, the entry's ``seq``)
so that a caller can act on it without reading the message.

>>> error = LogDamagedError("/mnt/shared/ns/shard-01", 12, "checksum mismatch")
>>> (error.uri, error.seq, isinstance(error, SharedLogError))
('/mnt/shared/ns/shard-01', 12, True)
"""

from __future__ import annotations

from lifemem_ray.core.errors import StoreError

__all__ = [
    "CheckpointDamagedError",
    "DurableAddressOwnedError",
    "EntryTakenError",
    "LogDamagedError",
    "LogForkedError",
    "SharedLogError",
    "WriterDeposedError",
]


class SharedLogError(StoreError):
    """The shared log cannot be read or written (storage unreachable, an entry damaged)."""


class LogForkedError(SharedLogError):
    """Another writer appended to this log (the store was taken over elsewhere), or the log
    belongs to another store or another deployment."""


class EntryTakenError(LogForkedError):
    """The entry this writer was appending is held by another writer of no higher epoch (two
    openings of one store racing for the same place in its log)."""

    def __init__(self, uri: str, seq: int, other: tuple[str, int]) -> None:
        self.uri = uri  # the shared log's address
        self.seq = seq  # the entry the other writer holds
        self.other = other  # (owner, epoch) of that writer
        super().__init__(
            f"shared log {uri}: entry {seq} was written by another writer (epoch {other[1]}); this store has been "
            "taken over (or two deployments share one durable address): stop this one"
        )


class WriterDeposedError(LogForkedError):
    """This writer was taken over: a later opening of the same store (a shard rebuilt on
    another node, or reopened) wrote the next entry with a higher epoch. Nothing this writer
    acknowledged is lost (its entries are in the log, and the new writer replayed them); it
    must stop writing."""

    def __init__(self, uri: str, seq: int, mine: tuple[str, int], by: tuple[str, int]) -> None:
        self.uri = uri  # the shared log's address
        self.seq = seq  # the entry the new writer holds
        self.mine = mine  # (owner, epoch) of the deposed writer
        self.by = by  # (owner, epoch) of the writer that took over
        owner = f"deployment {by[0]}" if by[0] else "another opening of this store"
        super().__init__(
            f"shared log {uri}: entry {seq} was written by {owner} (epoch {by[1]}), which took this store over from "
            f"this writer (epoch {mine[1]}); this writer refuses every further write (what it acknowledged is in the "
            "log): stop it, the new writer serves the store"
        )


class LogDamagedError(SharedLogError):
    """An entry of the log cannot be read back as written (checksum, framing, or the wrong
    sequence number inside). Every visible entry was acknowledged (entries are written whole
    and then linked or PUT into place), so a damaged entry is never dropped: a store that
    lacks it is refused rather than served without it."""

    def __init__(self, uri: str, seq: int, problem: str, remedy: str = "") -> None:
        self.uri = uri  # the shared log's address
        self.seq = seq  # the damaged entry
        self.problem = problem  # what is wrong with it
        super().__init__(f"shared log {uri}: entry {seq} is damaged ({problem})" + (f"; {remedy}" if remedy else ""))


class CheckpointDamagedError(SharedLogError):
    """No checkpoint the store can start from is whole (each failed its checksum or could not
    be read) and the log does not reach back to its start; ``problems`` maps each
    checkpoint's sequence number to what is wrong with it."""

    def __init__(self, uri: str, problems: dict[int, str], first_entry: int) -> None:
        self.uri = uri  # the shared log's address
        self.problems = problems  # checkpoint seq -> what is wrong with it
        self.first_entry = first_entry  # the oldest entry the log still holds (0: none)
        listed = "; ".join(f"checkpoint {seq}: {why}" for seq, why in sorted(problems.items(), reverse=True))
        super().__init__(
            f"shared log {uri}: no whole checkpoint to start from ({listed}) and the log begins at entry {first_entry}, "
            "not 1: nothing was served. Recover the store from its node's local copy (open the shard there: it "
            "writes a new checkpoint), or restore a snapshot (`lifemem-ray restore SNAPSHOT NEW_STORE`)"
        )


class DurableAddressOwnedError(SharedLogError):
    """A deployment's durable address (``<cluster.durable_uri>/<namespace>``) belongs to another
    deployment; ``owner`` is that deployment's ownership record."""

    def __init__(self, uri: str, owner: dict[str, object]) -> None:
        self.uri = uri  # the durable address
        self.owner = owner  # the record of the deployment it belongs to
        super().__init__(
            f"durable address {uri} belongs to deployment {owner.get('deployment_id')} (store {owner.get('store')!s} "
            f"on {owner.get('host')!s}, claimed {owner.get('claimed_at')!s}); two deployments cannot share one: serve "
            "that store folder to continue it, or give this deployment another cluster.namespace or "
            "cluster.durable_uri (to continue from its data elsewhere: `lifemem-ray restore ADDRESS NEW_STORE`)"
        )
