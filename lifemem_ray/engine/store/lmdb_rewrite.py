"""Copies of an LMDB environment written record by record into fresh pages.

Why not LMDB's own compacting copy (``Environment.copy(compact=True)``, ``mdb_env_copy2``
with ``MDB_CP_COMPACT``): it walks the B-trees and writes every live page whole, and the
unused middle of a page (between its node pointers and its node data) still holds bytes of
records that were deleted from it or moved off it. A deleted trajectory's text then survives
in the copy outside every table, where ``grep -a`` finds it.

:func:`write_fresh_copy` instead creates a new environment and puts every key and value of
every named database of one read transaction into it (sorted keys, ``append``), so every page
of the copy is built from scratch:

* a page buffer LMDB allocates is zeroed before use (``malloc`` + ``memset``; py-lmdb's
  ``meminit=True``, the default, which this module passes explicitly, leaves
  ``MDB_NOMEMINIT`` off; a multi-page overflow buffer is zeroed in its last page, the value
  written fills the pages before it);
* a buffer the new environment reuses (one of its own freed dirty pages) only ever held pages
  of the copy, and the copy only ever receives live records (nothing is deleted or overwritten
  in it), so its page splits and copy-on-write copies move live bytes only;
* the file is written page by page (``writemap`` off); nothing else reaches it.

So the copy holds no byte of the source's free pages or page slack: a record deleted from the
source before the read transaction began is in no byte of it. :func:`replace_data_file` swaps
such a copy in for a store's own ``data.mdb`` (``lifemem-ray compact``).
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import lmdb

from lifemem_ray.core.errors import StoreError, StoreLockedError

__all__ = [
    "COMPACT_STAGING",
    "REWRITE_TXN_BYTES",
    "Rewrite",
    "fsync_dir",
    "remove_staging",
    "replace_data_file",
    "write_fresh_copy",
]

REWRITE_TXN_BYTES = 32 << 20  # key and value bytes per write transaction of a copy: bounded memory and transactions
COMPACT_STAGING = "compacting"  # the folder inside a store where `compact` writes the copy before swapping it in


@dataclass(frozen=True)
class Rewrite:
    """What :func:`write_fresh_copy` wrote: the data file, its size, and how many records."""

    data_file: Path
    bytes: int
    records: int


def write_fresh_copy(source: lmdb.Environment, txn: lmdb.Transaction[bytes], target: str | os.PathLike[str]) -> Rewrite:
    """Every record of every named database of ``source``, as ``txn`` (a read transaction on it)
    sees them, written into a new environment in the folder ``target`` (created if missing; it
    must hold no ``data.mdb``), committed in transactions of about :data:`REWRITE_TXN_BYTES`,
    flushed to disk at the end. The folder then holds ``data.mdb`` only (no lock file)."""
    target = Path(target)
    target.mkdir(parents=True, exist_ok=True)
    if (target / "data.mdb").exists():
        raise StoreError(f"{target}: already holds a data.mdb; a copy is written into a folder without one")
    names = source.dbs(txn)
    with txn.cursor() as main:
        plain = sum(1 for _ in main.iternext(keys=True, values=False)) - len(names)
    if plain:
        raise StoreError(
            f"{source.path()}: its main database holds {plain} records that are not named databases; "
            "a record-by-record copy would drop them (this is not a lifemem-ray store)"
        )
    env = lmdb.open(
        str(target),
        map_size=source.info()["map_size"],
        max_dbs=len(names) + 2,
        subdir=True,
        lock=False,
        sync=False,
        metasync=False,
        writemap=False,
        meminit=True,
        readahead=False,
    )
    records = 0
    try:
        for name in names:
            records += _copy_database(source.open_db(name, txn=txn, create=False), txn, env, name)
        env.sync(True)
    finally:
        env.close()
    fsync_dir(target)
    data_file = target / "data.mdb"
    return Rewrite(data_file, data_file.stat().st_size, records)


def _copy_database(source_db: lmdb._Database, txn: lmdb.Transaction[bytes], env: lmdb.Environment, name: bytes) -> int:
    """Copy one named database in chunks of about :data:`REWRITE_TXN_BYTES`; how many records."""
    with env.begin(write=True) as wtxn:  # created even when empty, so the copy has every table
        db = env.open_db(name, txn=wtxn, create=True)
    chunk: list[tuple[bytes, bytes]] = []
    size = records = 0
    for key, value in txn.cursor(db=source_db):
        chunk.append((key, value))
        size += len(key) + len(value)
        if size >= REWRITE_TXN_BYTES:
            records += _put_chunk(env, db, chunk)
            chunk, size = [], 0
    return records + _put_chunk(env, db, chunk)


def _put_chunk(env: lmdb.Environment, db: lmdb._Database, chunk: list[tuple[bytes, bytes]]) -> int:
    """Append ``chunk`` (sorted, after every key already there) in one transaction; a full map
    is doubled and the chunk written again (the aborted transaction left nothing)."""
    while chunk:
        try:
            with env.begin(write=True, db=db) as wtxn, wtxn.cursor() as cursor:
                _, added = cursor.putmulti(chunk, overwrite=False, append=True)
            if added != len(chunk):
                raise StoreError(
                    f"{env.path()}: the copy took {added} of {len(chunk)} records (keys out of order?); "
                    "remove the folder and copy again"
                )
            return added
        except lmdb.MapFullError:
            env.set_mapsize(env.info()["map_size"] * 2)
    return 0


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make a folder's entries (a file created, renamed or replaced in it) durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_staging(store_dir: str | os.PathLike[str]) -> bool:
    """Remove what a compaction a crash interrupted left in ``store_dir`` (its staging folder);
    whether there was any. The store's own data file is untouched either way: it is replaced
    only by a whole, flushed copy, atomically. Call only while holding the store's writer lock."""
    staging = Path(store_dir) / COMPACT_STAGING
    if not staging.exists():
        return False
    shutil.rmtree(staging)
    return True


def replace_data_file(store_dir: str | os.PathLike[str], copy: Path) -> None:
    """Swap ``copy`` in for ``store_dir/data.mdb`` atomically (``os.replace``, then the folder
    fsynced). The caller has closed its own environment on the store; StoreLockedError when
    another process has it open (a read-only view's lock-table entry would outlive the swap),
    and nothing is replaced then."""
    store_dir = Path(store_dir)
    with _no_other_opener(store_dir / "lock.mdb"):
        os.replace(copy, store_dir / "data.mdb")
        fsync_dir(store_dir)


@contextmanager
def _no_other_opener(lock_file: Path) -> Iterator[None]:
    """Hold LMDB's exclusive-open lock on ``lock_file``: every process that has the environment
    open holds a shared ``fcntl`` lock on its first byte (``mdb_env_excl_lock``), so getting the
    exclusive one proves none does, and one that opens meanwhile waits for it. Released (and the
    file closed) before the caller reopens the environment: closing any descriptor of the file
    would drop the locks this process's LMDB holds on it. The first opener after the swap
    re-initialises the lock table from the new file."""
    if not lock_file.exists():
        yield
        return
    fd = os.open(lock_file, os.O_RDWR)
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0)
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EAGAIN):
                raise StoreLockedError(
                    f"{lock_file.parent}: the store is open in another process (a read-only view, "
                    "`lifemem-ray retrieve`/`stats`, or a deployment's shard); close it and compact again"
                ) from None
            raise
        yield
    finally:
        os.close(fd)
