"""Versions of a memory, for reads pinned to one: what an on-policy training step needs.

A store gives each trajectory it commits the next number of its id sequence (the low bits of
the vector id, :data:`~lifemem_ray.core.ids.ID_SEQ_BITS`), so a store's *watermark*
(its ``next_vid``: the next number it will hand out) says which trajectories it had committed:
those whose number is below it (numbers are handed out inside the write transaction that
commits them, and LMDB has one writer at a time). A memory's version is one watermark per shard, read at one moment,
written as a token (``"v1:1200"`` for a store, ``"v1:1200.977"`` for a 2-shard deployment). A
retrieval ``as_of`` a token searches only the trajectories each shard had committed at its
watermark, however many writes came after: with exact search the same query as of the same
version gets the same trajectories, as long as none of them was deleted since (a deleted
trajectory is gone from every version); an environment on an IVF index may differ after the
index is trained again (its probes are approximate). Clusters and skills are not versioned: a pinned read returns the clusters and skills
of its hits as they are now.

A token is valid for the layout it was read from. A token of another shard count is refused,
and one above what a store has handed out (another memory's, or mistyped) too; but an absorb,
a restore or a reshard onto the same shard count keeps the absorbed trajectories' numbers, so
an old token is accepted and may show some of them: read a new version after those.

Example::

    >>> from lifemem_ray.engine.versions import format_version, parse_version
    >>> format_version([1200, 977])
    'v1:1200.977'
    >>> parse_version("v1:1200.977", shards=2)
    [1200, 977]
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import numpy as np

from lifemem_ray.core.errors import InvalidArgumentError
from lifemem_ray.core.ids import ID_SEQ_BITS

__all__ = ["MAX_OVERFETCH", "check_version", "format_version", "parse_version", "search_as_of", "visible"]

PREFIX = "v1:"
MAX_TOKEN_CHARS = 2048  # about 100 shards' watermarks
MAX_OVERFETCH = 65_536  # most candidates a pinned search looks at per query before it answers with fewer than k
_TOKEN = re.compile(r"v1:[0-9]{1,13}(\.[0-9]{1,13})*")  # ASCII digits only: \d and int() take any script's
_SEQ_MASK = (1 << ID_SEQ_BITS) - 1


def format_version(watermarks: Sequence[int]) -> str:
    """The token of one watermark per shard, in the deployment's shard order."""
    return PREFIX + ".".join(str(int(w)) for w in watermarks)


def check_version(token: object, where: str = "as_of") -> str:
    """``token`` if it has the form of a version token (of any number of shards).

    Only ASCII digits make a number: Python's ``\\d``, ``str.isdigit`` and ``int`` also take
    full-width digits (U+FF10..U+FF19) and other scripts' (Arabic-Indic U+0660..U+0669...), which no
    token ever holds.

    Args:
        token: what the caller gave as a version.
        where: the argument's name, for the error.

    Returns:
        ``token`` itself.

    Raises:
        InvalidArgumentError: not a string of the token's form, naming ``where``.
    """
    if not isinstance(token, str) or len(token) > MAX_TOKEN_CHARS or not _TOKEN.fullmatch(token):
        raise InvalidArgumentError(
            f"{str(token)[:80]!r} is not a memory version; give a token read from version() or stats() "
            "as it was given ('v1:' then one number per shard in ASCII digits, joined by dots: 'v1:1200.977')",
            where=where,
        )
    return token


def parse_version(token: object, shards: int, where: str = "as_of") -> list[int]:
    """The watermarks of ``token``, one per shard; a clear error naming ``where`` otherwise."""
    token = check_version(token, where)
    watermarks = [int(part) for part in token[len(PREFIX) :].split(".")]
    if len(watermarks) != shards:
        raise InvalidArgumentError(
            f"version {token!r} is of a memory with {len(watermarks)} shard(s), this one has {shards}; "
            "read a new version (after a reshard, an absorb or a restore the old ones no longer apply)",
            where=where,
        )
    return watermarks


def visible(ids: np.ndarray, watermark: int) -> np.ndarray:
    """Which of ``ids`` (vector ids, -1 for padding) a read as of ``watermark`` may see."""
    ids = np.asarray(ids, dtype=np.int64)
    return (ids >= 0) & ((ids & _SEQ_MASK) < watermark)


def search_as_of(
    search: Callable[[int], tuple[np.ndarray, np.ndarray]], k: int, watermark: int, available: int
) -> tuple[np.ndarray, np.ndarray]:
    """The top-``k`` of ``search(n) -> (scores, ids)`` (each row best first, padded with -inf / -1)
    among the ids visible at ``watermark``: asks for more candidates (4x each time) until every
    row has ``k`` visible ones or came back padded (its scope holds no more), the search has no
    more to give (``available``), or :data:`MAX_OVERFETCH`; rows with fewer are padded."""
    wanted = k
    while True:
        scores, ids = search(wanted)
        keep = visible(ids, watermark)
        done = (keep.sum(axis=1) >= k) | (ids < 0).any(axis=1)  # a padded row had all its scope had
        if wanted >= min(available, MAX_OVERFETCH) or bool(done.all()):
            break
        wanted = min(max(available, k), MAX_OVERFETCH, wanted * 4)
    out_scores = np.full((ids.shape[0], k), -np.inf, dtype=np.float32)
    out_ids = np.full((ids.shape[0], k), -1, dtype=np.int64)
    for row in range(ids.shape[0]):
        chosen = np.flatnonzero(keep[row])[:k]
        out_scores[row, : len(chosen)] = scores[row, chosen]
        out_ids[row, : len(chosen)] = ids[row, chosen]
    return out_scores, out_ids
