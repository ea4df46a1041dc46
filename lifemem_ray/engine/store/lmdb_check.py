"""A look at an LMDB data file before it is mapped: is it whole?

LMDB maps ``data.mdb`` into memory; a page beyond the end of a truncated file is not an
error it can report but a ``SIGBUS`` that kills the process. So a store's file is checked
first: its two meta pages (page 0 and page 1) say the page size and the last page in use;
the file must be at least that long.

Layout read (LMDB 0.9, 64-bit): a 16-byte page header, then ``MDB_meta``: magic
``0xBEEFC0DE`` (offset 16), version (20), map address (24), map size (32), the two
database records (40, 48 bytes each; the page size is kept in the first one's ``md_pad``),
the last page number (136) and the transaction id (144).

>>> problem_of_data_file("/nonexistent/data.mdb") is None  # a new store: nothing to check
True
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

__all__ = ["problem_of_data_file"]

_MAGIC = 0xBEEFC0DE
_META = struct.Struct("<IIQQI")  # magic, version, address, mapsize, dbs[0].md_pad (the page size)
_TAIL = struct.Struct("<QQ")  # mm_last_pg, mm_txnid
_META_AT = 16
_TAIL_AT = 136


def _meta(head: bytes, offset: int) -> tuple[int, int, int] | None:
    """(page size, last page, txn id) of the meta page at ``offset``, or None if it is not one."""
    if len(head) < offset + _TAIL_AT + _TAIL.size:
        return None
    magic, _version, _address, _mapsize, psize = _META.unpack_from(head, offset + _META_AT)
    if magic != _MAGIC or psize < 512 or psize & (psize - 1):
        return None
    last_pg, txnid = _TAIL.unpack_from(head, offset + _TAIL_AT)
    return psize, last_pg, txnid


def problem_of_data_file(path: str | os.PathLike[str]) -> str | None:
    """Why the LMDB data file at ``path`` cannot be opened safely (empty, not LMDB, shorter
    than its meta pages say), or None when it looks whole or does not exist."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(65536 + 4096)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot read {path}: {exc.strerror or exc}"
    if size == 0:
        return f"{path} is empty (0 bytes)"
    first = _meta(head, 0)
    if first is None:
        return f"{path} is not an LMDB data file, or its first page is damaged ({size:,} bytes)"
    psize = first[0]
    metas = [m for m in (first, _meta(head, psize)) if m is not None]
    if size < 2 * psize:
        return f"{path} is truncated: {size:,} bytes, shorter than its two {psize}-byte meta pages"
    _, last_pg, _ = max(metas, key=lambda m: m[2])  # the newer meta page is the current one
    need = (last_pg + 1) * psize
    if size < need:
        return f"{path} is truncated: {size:,} bytes, but its pages reach {need:,} bytes"
    return None
