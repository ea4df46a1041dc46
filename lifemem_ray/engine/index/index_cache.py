"""The index cache's file format: one FAISS file per scope and a manifest that commits them.

A cache is written atomically (the scope files first, each under a fresh name, then the
manifest naming them), carries the store's identity and a stamp (the LMDB generation) and a
checksum per file, and is read back only when all of it checks out: a missing, damaged,
foreign or stale cache reads as None and the caller rebuilds the index from LMDB. This module
knows the files; :class:`~lifemem_ray.engine.index.vector_index.VectorIndex` knows the index.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import uuid
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from lifemem_ray.core.errors import IndexCacheError, IndexSaveError, VectorIndexError
from lifemem_ray.engine.index.env_index import DIRECT_MAP_HASHTABLE, EnvIndex, check_env, export_ids

__all__ = ["CachedIndex", "read_cache", "write_cache"]

log = logging.getLogger(__name__)

_MANIFEST = "manifest.json"
_FORMAT = 1


@dataclass
class CachedIndex:
    """What a cache holds: each scope's sub-index (checked), its ids, the stamp it was written
    at and what its IVF scopes were calibrated for."""

    envs: dict[str, EnvIndex]
    ids: dict[str, np.ndarray]
    stamp: int
    calibration: Any


def write_cache(
    envs: Mapping[str, EnvIndex],
    directory: str | Path,
    *,
    dim: int,
    count: int,
    stamp: int,
    identity: str,
    calibration: Any,
) -> None:
    """Write ``envs`` as the cache in ``directory`` (see the module). A failed write (a full
    disk) removes what it wrote and raises :class:`IndexSaveError` saying where and why."""
    if isinstance(stamp, bool) or not isinstance(stamp, (int, np.integer)):
        raise VectorIndexError(f"stamp must be an integer, got {stamp!r}")
    directory = Path(directory)
    written: list[Path] = []
    try:
        directory.mkdir(parents=True, exist_ok=True)
        _write_files(envs, directory, dim, count, int(stamp), identity, calibration, written)
    except OSError as exc:
        for path in written:
            with contextlib.suppress(OSError):
                path.unlink()
        why = "no space left on the device" if exc.errno == errno.ENOSPC else (exc.strerror or str(exc))
        raise IndexSaveError(
            f"{directory}: could not save the index cache: {why}; the store is intact "
            "(the cache is rebuilt from it when needed); free space and close the store again"
        ) from exc


def _write_files(
    envs: Mapping[str, EnvIndex],
    directory: Path,
    dim: int,
    count: int,
    stamp: int,
    identity: str,
    calibration: Any,
    written: list[Path],
) -> None:
    token = uuid.uuid4().hex[:12]
    entries = []
    for i, (name, e) in enumerate(sorted(envs.items())):
        fname = f"env-{i:05d}-{token}.faiss"
        tmp = directory / (fname + ".tmp")
        written.append(tmp)
        faiss.write_index(e.index, str(tmp))
        _crc, size = _fsync_crc(tmp)
        os.replace(tmp, directory / fname)
        written.append(directory / fname)
        entries.append(
            {
                "name": name,
                "file": fname,
                "count": e.ntotal,
                "kind": e.kind,
                "nlist": e.nlist,
                "nprobe": e.nprobe,
                "trained_size": e.trained_size,
                "recall": e.recall,
                "max_codes": e.max_codes,
                "bytes": size,
                "crc32": _crc,
            }
        )
    manifest = {
        "format": _FORMAT,
        "dim": dim,
        "stamp": stamp,
        "identity": identity,
        "count": count,
        "calibration": calibration,  # what the IVF envs' nprobe and scan caps are calibrated for
        "envs": entries,
    }
    tmp = directory / (_MANIFEST + ".tmp")
    written.append(tmp)
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / _MANIFEST)
    written.clear()  # committed: the new files are the cache now
    _fsync_dir(directory)
    keep = {entry["file"] for entry in entries}
    for path in directory.glob("env-*.faiss*"):
        if path.name not in keep:
            try:
                path.unlink()
            except OSError as exc:  # a leftover file costs disk, not correctness
                log.warning("index: could not delete old file %s: %s", path, exc)


def read_cache(directory: str | Path, dim: int, identity: str | None = None) -> CachedIndex | None:
    """The cache in ``directory``, every file checked; None (with a logged reason) when it is
    missing, unreadable, damaged, of another dimension, or (``identity`` given) written for
    another store or other contents."""
    directory = Path(directory)
    manifest_path = directory / _MANIFEST
    if not manifest_path.is_file():
        log.info("index: no saved index in %s", directory)
        return None
    try:
        return _read(directory, json.loads(manifest_path.read_text(encoding="utf-8")), dim, identity)
    except Exception as exc:  # noqa: BLE001 - a broken cache must never stop the engine
        log.warning("index: ignoring unusable saved index in %s: %s", directory, exc)
        return None


def _read(directory: Path, manifest: dict[str, Any], dim: int, identity: str | None) -> CachedIndex:
    if manifest.get("format") != _FORMAT:
        raise IndexCacheError(f"unknown format {manifest.get('format')!r}")
    if manifest.get("dim") != dim:
        raise IndexCacheError(f"saved dim {manifest.get('dim')!r} != expected {dim}")
    stamp = manifest["stamp"]
    if isinstance(stamp, bool) or not isinstance(stamp, int):
        raise IndexCacheError(f"stamp {stamp!r} is not an integer")
    if identity is not None and manifest.get("identity", "") != identity:
        raise IndexCacheError(
            f"written for another store or other contents ({manifest.get('identity', '')!r}, this store: {identity!r})"
        )
    envs: dict[str, EnvIndex] = {}
    ids: dict[str, np.ndarray] = {}
    seen: set[int] = set()
    for entry in manifest["envs"]:
        name = entry["name"]
        check_env(name)
        if name in envs:
            raise IndexCacheError(f"environment {name!r} listed twice")
        e = _read_env(directory, entry, dim)
        ids[name] = export_ids(e)
        before = len(seen)
        seen.update(ids[name].tolist())
        if len(seen) != before + len(ids[name]):
            raise IndexCacheError(f"environment {name!r} repeats ids of another environment")
        envs[name] = e
    if len(seen) != manifest["count"]:
        raise IndexCacheError(f"{len(seen)} vectors loaded, manifest says {manifest['count']}")
    return CachedIndex(envs, ids, stamp, manifest.get("calibration"))


def _read_env(directory: Path, entry: dict[str, Any], dim: int) -> EnvIndex:
    name = entry["name"]
    path = directory / entry["file"]
    if Path(entry["file"]).name != entry["file"] or not path.is_file():
        raise IndexCacheError(f"file {entry['file']!r} of environment {name!r} is missing")
    crc_now, size = _crc(path)
    if size != entry["bytes"] or crc_now != entry["crc32"]:
        raise IndexCacheError(f"file {entry['file']!r} is truncated or damaged")
    e = EnvIndex(
        index=faiss.read_index(str(path)),
        kind=entry["kind"],
        nlist=int(entry["nlist"]),
        nprobe=int(entry["nprobe"]),
        trained_size=int(entry["trained_size"]),
        recall=entry.get("recall"),
        max_codes=int(entry.get("max_codes", 0)),
    )
    _check_loaded(e, dim)
    if e.ntotal != entry["count"] or e.ntotal == 0:
        raise IndexCacheError(f"environment {name!r} holds {e.ntotal} vectors, manifest says {entry['count']}")
    return e


def _check_loaded(e: EnvIndex, dim: int) -> None:
    """Refuse a loaded FAISS object that is not what :meth:`VectorIndex.save` writes."""
    index = e.index
    if index.d != dim:
        raise IndexCacheError(f"index dimension {index.d} != {dim}")
    if e.kind == "flat":
        if not isinstance(index, faiss.IndexIDMap2):
            raise IndexCacheError(f"flat environment is a {type(index).__name__}")
        e.flat = faiss.downcast_index(index.index)
        if not isinstance(e.flat, faiss.IndexFlatIP) or e.flat.ntotal != index.ntotal:
            raise IndexCacheError(f"flat environment wraps a {type(e.flat).__name__}")
    elif e.kind == "ivf":
        if not isinstance(index, faiss.IndexIVFFlat) or index.metric_type != faiss.METRIC_INNER_PRODUCT:
            raise IndexCacheError(f"ivf environment is a {type(index).__name__}")
        if index.nlist != e.nlist or not 1 <= e.nprobe <= e.nlist:
            raise IndexCacheError(f"ivf nlist/nprobe {index.nlist}/{e.nprobe} disagree with the manifest")
        if index.direct_map.type != DIRECT_MAP_HASHTABLE:
            index.set_direct_map_type(DIRECT_MAP_HASHTABLE)
        index.nprobe = e.nprobe
    else:
        raise IndexCacheError(f"unknown kind {e.kind!r}")


def _crc(path: Path) -> tuple[int, int]:
    _crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            _crc = zlib.crc32(chunk, _crc)
            size += len(chunk)
    return _crc, size


def _fsync_crc(path: Path) -> tuple[int, int]:
    """Flush a file FAISS wrote to disk and checksum it, so load can detect damage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return _crc(path)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
