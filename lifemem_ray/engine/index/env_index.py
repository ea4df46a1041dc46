"""One scope's sub-index (:class:`EnvIndex`: an exact flat index or an IVF) and the pieces
every search over them shares: reading its ids and vectors back, the exact flat search with
numpy, padding and merging per-scope top-k, the checks of ids, vectors, k and scope names,
and FAISS's thread settings."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import faiss
import numpy as np

from lifemem_ray.core.errors import VectorIndexError

PAD_SCORE = float("-inf")  # score of a padding slot (fewer than k results exist)


PAD_ID = -1  # id of a padding slot


_SCORE_BLOCK = 1 << 22  # at most this many query-vector scores in memory at once (16 MiB)


_MAX_ID = np.iinfo(np.int64).max


# FAISS 1.15 computes inner products without BLAS while queries * dim < distance_compute_blas_threshold
# (default 128,000: fewer than 333 queries at dim 384). That default suits many OpenMP threads; with
# one thread per actor, as here, the sequential path is ~4x slower than BLAS for the IVF coarse
# quantizer on the few hundred queries per environment a batch brings (facebookresearch/faiss#5109
# measures the one-thread crossover at queries * dim ~ 800). Older FAISS compares the query count
# alone with a default of 20, so only the newer semantics (a default in the thousands) is retuned.
_BLAS_WORK_PER_THREAD = 800


_BLAS_THRESHOLD_IS_WORK = faiss.cvar.distance_compute_blas_threshold >= 1000

# An IVF index's id map that allows reconstruct and remove_ids with arbitrary ids. FAISS's own
# type stubs (faiss-cpu 1.15) leave out the DirectMap class that the library has.
DIRECT_MAP_HASHTABLE: int = faiss.DirectMap.Hashtable  # type: ignore[attr-defined]


def ivf_params(nprobe: int, max_codes: int) -> faiss.SearchParametersIVF:
    """Per-search IVF parameters: lists probed, and at most ``max_codes`` codes scanned (0: no cap)."""
    params = faiss.SearchParametersIVF()
    params.nprobe, params.max_codes = nprobe, max_codes
    return params


_faiss_threads: int | None = None  # set_faiss_threads' count, applied in every thread that calls FAISS


_thread_state = threading.local()


def set_faiss_threads(threads: int | None = None) -> None:
    """Set FAISS's OpenMP threads (None: keep them) and the BLAS switch-over that suits them.

    OpenMP keeps the count per thread: a thread started later (a Ray actor's call threads,
    a background retrain) would use every core. VectorIndex applies it in each thread
    that calls FAISS (:func:`apply_faiss_threads`)."""
    global _faiss_threads
    if threads is not None:
        _faiss_threads = max(1, int(threads))
        faiss.omp_set_num_threads(_faiss_threads)
        _thread_state.threads = _faiss_threads
    if _BLAS_THRESHOLD_IS_WORK:
        faiss.cvar.distance_compute_blas_threshold = _BLAS_WORK_PER_THREAD * faiss.omp_get_max_threads()


def apply_faiss_threads() -> None:
    """This thread's OpenMP count as set_faiss_threads set it (once per thread and setting)."""
    if _faiss_threads is not None and getattr(_thread_state, "threads", None) != _faiss_threads:
        faiss.omp_set_num_threads(_faiss_threads)
        _thread_state.threads = _faiss_threads


@dataclass
class EnvIndex:
    """One environment's sub-index and how it was built."""

    index: Any  # faiss.IndexIDMap2 (flat) or faiss.IndexIVFFlat (ivf): the CPU master
    kind: str  # "flat" | "ivf"
    nlist: int = 0
    nprobe: int = 0
    trained_size: int = 0  # vectors present at the last (re)training
    recall: float | None = None  # calibrated recall@calibration_k at nprobe (None: not calibrated)
    max_codes: int = 0  # per-query scan cap at trained_size vectors, grown in proportion since (0: no cap)
    flat: Any = None  # flat kind: the IndexFlatIP inside the IDMap2, whose storage we search with numpy

    @property
    def ntotal(self) -> int:
        return int(self.index.ntotal)


def check_env(env: Any) -> None:
    if not isinstance(env, str) or not env:
        raise VectorIndexError(f"env must be a non-empty string, got {env!r}")


def as_ids(ids: Any, name: str, *, allow_negative: bool = False) -> np.ndarray:
    """A contiguous int64 1-D array of ids; floats, bools and out-of-range values are refused."""
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise VectorIndexError(f"{name} must be a 1-D array, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype=np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise VectorIndexError(f"{name} must be integers, got dtype {arr.dtype}")
    if arr.dtype == np.uint64 and int(arr.max()) > _MAX_ID:
        raise VectorIndexError(f"{name}: id {int(arr.max())} does not fit in int64")
    arr = np.ascontiguousarray(arr, dtype=np.int64)
    if not allow_negative and int(arr.min()) < 0:
        raise VectorIndexError(f"{name} must be non-negative, got {int(arr.min())}")
    return arr


def as_matrix(x: Any, dim: int, name: str) -> np.ndarray:
    """A contiguous float32 (n, dim) array of finite values; other real dtypes and lists are converted."""
    try:
        raw = np.asarray(x)
    except ValueError as exc:  # ragged nested lists
        raise VectorIndexError(f"{name} must be a 2-D numeric array: {exc}") from None
    if raw.dtype.kind not in "fiu":
        if raw.size == 0 and raw.ndim == 2 and raw.shape[1] == dim:
            return np.empty((0, dim), dtype=np.float32)
        raise VectorIndexError(f"{name} must be a numeric array, got dtype {raw.dtype}")
    if raw.ndim != 2 or raw.shape[1] != dim:
        raise VectorIndexError(f"{name} must have shape (n, {dim}), got {raw.shape}")
    with np.errstate(over="ignore"):  # overflow to inf is reported below
        arr = np.ascontiguousarray(raw, dtype=np.float32)
    finite = np.isfinite(arr).all(axis=1)
    if not finite.all():
        row = int(np.flatnonzero(~finite)[0])
        raise VectorIndexError(f"{name}: row {row} contains NaN or infinite values (or overflows float32)")
    return arr


def as_k(k: Any) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise VectorIndexError(f"k must be a positive integer, got {k!r}")
    return int(k)


def padding(q: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    return np.full((q, k), PAD_SCORE, dtype=np.float32), np.full((q, k), PAD_ID, dtype=np.int64)


def merge(parts: list[tuple[np.ndarray, np.ndarray]], k: int) -> tuple[np.ndarray, np.ndarray]:
    """Global top-k from per-env top-k results, vectorised over queries."""
    if len(parts) == 1:
        return parts[0]
    scores = np.concatenate([s for s, _ in parts], axis=1)
    ids = np.concatenate([i for _, i in parts], axis=1)
    top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    scores, ids = np.take_along_axis(scores, top, 1), np.take_along_axis(ids, top, 1)
    order = np.argsort(-scores, axis=1, kind="stable")
    return np.take_along_axis(scores, order, 1), np.take_along_axis(ids, order, 1)


def flat_search(e: EnvIndex, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k of a flat env by numpy matmul on a zero-copy view of the FAISS storage.

    FAISS >= 1.13 only switches to BLAS when nq * d >= 128000, so a batch of 256
    queries at d=384 takes its per-pair SIMD path, about 4x slower than one sgemm
    on 2 cores; changing that threshold would be process-global. The views are
    only valid until the next mutation, which the caller's lock excludes.
    """
    n, d = e.index.ntotal, e.index.d
    base = faiss.rev_swig_ptr(e.flat.get_xb(), n * d).reshape(n, d)
    id_map = faiss.rev_swig_ptr(e.index.id_map.data(), n)
    q = len(queries)
    scores = np.empty((q, k), dtype=np.float32)
    rows = np.empty((q, k), dtype=np.int64)
    step = max(1, _SCORE_BLOCK // n)  # bound the (rows, n) score matrix
    for start in range(0, q, step):
        s = queries[start : start + step] @ base.T
        top = np.argpartition(s, n - k, axis=1)[:, n - k :] if k < n else np.broadcast_to(np.arange(n), s.shape)
        top_s = np.take_along_axis(s, top, 1)
        order = np.argsort(-top_s, axis=1, kind="stable")
        scores[start : start + step] = np.take_along_axis(top_s, order, 1)
        rows[start : start + step] = np.take_along_axis(top, order, 1)
    return scores, id_map[rows]


def export_ids(e: EnvIndex) -> np.ndarray:
    """The ids a sub-index holds (for IVF, read from its inverted lists without their codes)."""
    if e.kind == "flat":
        return faiss.vector_to_array(e.index.id_map).astype(np.int64, copy=False)
    invlists = e.index.invlists
    parts = [
        faiss.rev_swig_ptr(invlists.get_ids(lst), invlists.list_size(lst)).copy()
        for lst in range(invlists.nlist)
        if invlists.list_size(lst)
    ]
    return np.concatenate(parts).astype(np.int64, copy=False) if parts else np.empty(0, dtype=np.int64)


def export(e: EnvIndex) -> tuple[np.ndarray, np.ndarray]:
    """All (ids, vectors) of a sub-index, read back from FAISS for a rebuild (transient copy)."""
    index = e.index
    d = index.d
    if e.kind == "flat":
        ids = faiss.vector_to_array(index.id_map).astype(np.int64, copy=False)
        return ids, index.index.reconstruct_n(0, index.ntotal)
    invlists = index.invlists
    id_parts, vec_parts = [], []
    for lst in range(invlists.nlist):
        size = invlists.list_size(lst)
        if size == 0:
            continue
        id_parts.append(faiss.rev_swig_ptr(invlists.get_ids(lst), size).copy())
        codes = faiss.rev_swig_ptr(invlists.get_codes(lst), size * invlists.code_size)
        vec_parts.append(codes.view(np.float32).reshape(size, d).copy())  # IVFFlat codes are raw float32
    if not id_parts:
        return np.empty(0, dtype=np.int64), np.empty((0, d), dtype=np.float32)
    return np.concatenate(id_parts).astype(np.int64, copy=False), np.concatenate(vec_parts)
