"""Per-environment FAISS vector index: a rebuildable cache of the stored vectors.

LMDB is the source of truth; this index only answers nearest-neighbour queries
and can always be rebuilt from it. Every vector belongs to exactly one
environment and each environment has its own sub-index, so an env-restricted
search is exact in count (it never filters a global result down) and only
touches that environment's vectors. A global search merges the per-env top-k.

Each sub-index is exact (``IndexIDMap2(IndexFlatIP)``) while it holds at most
``config.exact_max`` vectors and becomes an ``IndexIVFFlat`` (inner product,
spherical k-means without the lists no vector falls in, hash-table direct map) above
that, with nprobe and a per-query scan cap calibrated together on stored vectors to
reach ``config.target_recall``. Both keep the raw
vectors, support ``remove_ids`` with arbitrary 63-bit ids and let us read the
vectors back, so the index grows on its own: it is retrained (more lists)
when an environment has grown ``config.retrain_growth`` times since its last
training, amortised O(1) per add; with ``config.background_retrain`` on a thread
while the old index keeps serving.

Scores are inner products (cosine for the L2-normalised vectors callers store).
Missing results are padded with score ``-inf`` and id ``-1``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import sys
import threading
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import faiss
import numpy as np
from faiss.contrib.ivf_tools import add_preassigned

from lifemem_ray.engine.memory_config import IndexConfig
from lifemem_ray.core.errors import IndexBuildError, IndexSaveError, VectorIndexError

__all__ = ["PAD_ID", "PAD_SCORE", "VectorIndex", "VectorIndexError", "set_faiss_threads"]

log = logging.getLogger(__name__)

PAD_SCORE = float("-inf")  # score of a padding slot (fewer than k results exist)
PAD_ID = -1  # id of a padding slot

_MIN_PER_CENTROID = 39  # nlist <= n / 39: k-means gets enough points per centroid
_TRAIN_PER_CENTROID = 40  # training sample: at most this many points per centroid
_KMEANS_ITERS = 10  # few iterations: training must stay fast on 2 cores
# Above this many vectors, half as many: a build's k-means grows as n^1.5 and big retrains
# run beside ingest (58k vectors: 8.1 -> 5.3 CPU-s, recall@4 0.986 -> 0.980, nprobe calibrated).
_KMEANS_FEWER_ITERS_FROM = 20_000
_CAL_QUERIES = 200  # stored vectors used as queries when calibrating nprobe
_SEED = 20240611  # sampling and k-means are seeded: rebuilds are reproducible
_SCORE_BLOCK = 1 << 22  # at most this many query-vector scores in memory at once (16 MiB)
_GPU_MAX_K = 2048  # FAISS GPU k-selection and nprobe limit
_MANIFEST = "manifest.json"
_FORMAT = 1
_MAX_ID = np.iinfo(np.int64).max


# FAISS 1.15 computes inner products without BLAS while queries * dim < distance_compute_blas_threshold
# (default 128,000: fewer than 333 queries at dim 384). That default suits many OpenMP threads; with
# one thread per actor, as here, the sequential path is ~4x slower than BLAS for the IVF coarse
# quantizer on the few hundred queries per environment a batch brings (facebookresearch/faiss#5109
# measures the one-thread crossover at queries * dim ~ 800). Older FAISS compares the query count
# alone with a default of 20, so only the newer semantics (a default in the thousands) is retuned.
_BLAS_WORK_PER_THREAD = 800
_BLAS_THRESHOLD_IS_WORK = faiss.cvar.distance_compute_blas_threshold >= 1000


_faiss_threads: int | None = None  # set_faiss_threads' count, applied in every thread that calls FAISS
_thread_state = threading.local()


def set_faiss_threads(threads: int | None = None) -> None:
    """Set FAISS's OpenMP threads (None: keep them) and the BLAS switch-over that suits them.

    OpenMP keeps the count per thread: a thread started later (a Ray actor's call threads,
    a background retrain) would use every core. VectorIndex applies it in each thread
    that calls FAISS (:func:`_apply_faiss_threads`)."""
    global _faiss_threads
    if threads is not None:
        _faiss_threads = max(1, int(threads))
        faiss.omp_set_num_threads(_faiss_threads)
        _thread_state.threads = _faiss_threads
    if _BLAS_THRESHOLD_IS_WORK:
        faiss.cvar.distance_compute_blas_threshold = _BLAS_WORK_PER_THREAD * faiss.omp_get_max_threads()


def _apply_faiss_threads() -> None:
    """This thread's OpenMP count as set_faiss_threads set it (once per thread and setting)."""
    if _faiss_threads is not None and getattr(_thread_state, "threads", None) != _faiss_threads:
        faiss.omp_set_num_threads(_faiss_threads)
        _thread_state.threads = _faiss_threads


# At import: FAISS's BLAS switch-over for the OpenMP thread count the process starts with (a
# process-wide setting; the thread count itself is left as FAISS found it until a caller sets it).
set_faiss_threads()


@dataclass
class _Env:
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


class VectorIndex:
    """Nearest-neighbour search over int64-identified vectors, one sub-index per environment.

    Thread-safe: every public method takes one re-entrant lock, because Ray actors
    may call from several threads. FAISS's OpenMP thread count and BLAS switch-over are the
    process's, set by :func:`set_faiss_threads` (and applied again in each calling thread).
    """

    def __init__(self, dim: int, config: IndexConfig | None = None) -> None:
        if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim <= 0:
            raise VectorIndexError(f"dim must be a positive integer, got {dim!r}")
        self.dim: int = int(dim)
        self.config: IndexConfig = config if config is not None else IndexConfig()
        self.config.validate()
        self._lock = threading.RLock()
        self._envs: dict[str, _Env] = {}
        self._where: dict[int, str] = {}  # id -> env: env_of/contains/remove without asking every env
        self._gpu_res: Any = None
        self._replicas: dict[str, Any] = {}  # env -> GPU copy of the CPU master, for search only
        self._dirty: set[str] = set()  # envs whose GPU copy is stale
        # Background retrains (config.background_retrain): env -> (thread, ids added, ids removed since the export).
        self._retraining: dict[str, tuple[threading.Thread, list[tuple[np.ndarray, np.ndarray]], set[int]]] = {}
        self._retrain_error: BaseException | None = None
        # Finished background builds, adopted (the adds since applied, under the lock) by the
        # next add, search or wait_retrains: never by the low-priority thread that built them.
        self._ready: dict[str, _Env] = {}
        if _want_gpu(self.config.use_gpu):
            self._gpu_res = faiss.StandardGpuResources()

    # ------------------------------------------------------------------ mutation

    def add(self, env: str, ids: np.ndarray, vectors: np.ndarray) -> None:
        """Add vectors of one environment; ids must be new (the index never overwrites)."""
        _check_env(env)
        ids = _as_ids(ids, "ids")
        vectors = _as_matrix(vectors, self.dim, "vectors")
        if len(ids) != len(vectors):
            raise VectorIndexError(f"ids and vectors differ in length: {len(ids)} ids, {len(vectors)} vectors")
        if len(ids) == 0:
            return
        uniq, counts = np.unique(ids, return_counts=True)
        if len(uniq) != len(ids):
            raise VectorIndexError(f"ids: id {int(uniq[counts > 1][0])} appears more than once in the batch")
        _apply_faiss_threads()
        with self._lock:
            self._adopt_ready()
            for i in ids.tolist():
                if i in self._where:
                    raise VectorIndexError(f"ids: id {i} is already in the index (environment {self._where[i]!r})")
            e = self._envs.get(env)
            total = (e.ntotal if e is not None else 0) + len(ids)
            retrain = e is not None and e.kind == "ivf" and total > _retrain_at(env, e, self.config.retrain_growth)
            if e is None:
                self._envs[env] = self._build(ids, vectors)
                self._dirty.add(env)
            elif (e.kind == "flat" and total > self.config.exact_max) or (retrain and not self.config.background_retrain):
                old_ids, old_vecs = _export(e)
                self._envs[env] = self._build(np.concatenate([old_ids, ids]), np.concatenate([old_vecs, vectors]))
                self._dirty.add(env)
            else:
                e.index.add_with_ids(vectors, ids)
                self._add_to_replica(env, ids, vectors)
                if env in self._retraining:
                    self._retraining[env][1].append((ids.copy(), vectors.copy()))
                elif retrain:
                    # Keep serving (and growing) the current index while a bigger one trains.
                    self._start_retrain(env, e)
            self._where.update(dict.fromkeys(ids.tolist(), env))

    def _start_retrain(self, env: str, e: _Env) -> None:
        """Build the bigger index from a copy on a thread; :meth:`_finish_retrain` swaps it in."""
        ids, vecs = _export(e)
        added: list[tuple[np.ndarray, np.ndarray]] = []
        removed: set[int] = set()

        def build() -> None:
            _apply_faiss_threads()
            _lower_thread_priority(self.config.retrain_nice)
            try:
                fresh = self._build(ids, vecs)
            except BaseException as exc:  # noqa: BLE001 - reported by wait_retrains / the next add
                log.exception("index: background retrain of %r failed", env)
                with self._lock:
                    self._retrain_error = exc
                    self._retraining.pop(env, None)
                return
            # No lock here: at low priority this thread could hold it for long (a dict
            # assignment is atomic under the GIL; _adopt_ready pops under the lock).
            self._ready[env] = fresh

        thread = threading.Thread(target=build, name=f"lifemem-retrain-{env}", daemon=True)
        self._retraining[env] = (thread, added, removed)
        thread.start()

    def _adopt_ready(self) -> None:
        """Swap in the background builds that have finished (caller holds the lock)."""
        while self._ready:
            env = next(iter(self._ready))
            self._finish_retrain(env, self._ready.pop(env))

    def _finish_retrain(self, env: str, fresh: _Env) -> None:
        with self._lock:
            entry = self._retraining.pop(env, None)
            current = self._envs.get(env)
            if entry is None or current is None or current.kind != "ivf":
                return  # the env was emptied or shrunk back to flat meanwhile: drop the build
            _, added, removed = entry
            for ids, vecs in added:
                keep = np.asarray([i not in removed for i in ids.tolist()], dtype=bool)
                if keep.any():
                    fresh.index.add_with_ids(vecs[keep], ids[keep])
            gone = np.asarray(sorted(removed), dtype=np.int64)
            if len(gone):
                fresh.index.remove_ids(faiss.IDSelectorArray(len(gone), faiss.swig_ptr(gone)))
            if fresh.ntotal != current.ntotal:  # cannot happen: keep the index that is complete
                log.warning("index: retrain of %r holds %d vectors, the live index %d; keeping the live one", env, fresh.ntotal, current.ntotal)
                return
            self._envs[env] = fresh
            self._dirty.add(env)

    def wait_retrains(self, timeout_s: float | None = None) -> None:
        """Wait for background retrains (tests, save points); re-raise a failed one."""
        while True:
            with self._lock:
                self._adopt_ready()
                threads = [t for t, _, _ in self._retraining.values()]
                error, self._retrain_error = self._retrain_error, None
            if error is not None:
                raise VectorIndexError(f"a background retrain failed: {error}") from error
            if not threads:
                return
            for t in threads:
                t.join(timeout_s)

    def remove(self, ids: np.ndarray) -> int:
        """Remove ids wherever they are; unknown ids are ignored. Returns how many were removed."""
        ids = _as_ids(ids, "ids", allow_negative=True)
        removed = 0
        with self._lock:
            by_env: dict[str, list[int]] = {}
            for i in np.unique(ids).tolist():
                env = self._where.get(i)
                if env is not None:
                    by_env.setdefault(env, []).append(i)
            for env, members in by_env.items():
                e = self._envs[env]
                arr = np.asarray(members, dtype=np.int64)
                if e.kind == "ivf":
                    # A hash-table direct map removes only through an IDSelectorArray (older FAISS).
                    n = e.index.remove_ids(faiss.IDSelectorArray(len(arr), faiss.swig_ptr(arr)))
                else:
                    n = e.index.remove_ids(arr)
                if n != len(arr):  # cannot happen unless the index was changed behind our back
                    log.warning("index: env %r removed %d of %d ids", env, n, len(arr))
                removed += int(n)
                if env in self._retraining:
                    self._retraining[env][2].update(members)
                for i in members:
                    del self._where[i]
                self._dirty.add(env)
                if e.ntotal == 0:
                    del self._envs[env]
                    self._replicas.pop(env, None)
                    self._dirty.discard(env)
                elif e.kind == "ivf" and e.ntotal <= self.config.exact_max // 2:
                    # Shrunk well below the threshold: back to exact search (hysteresis avoids flapping).
                    self._envs[env] = self._build(*_export(e))
        return removed

    # ------------------------------------------------------------------ search

    def search(self, queries: np.ndarray, k: int, env: str | None = None, *, among: Callable[[str], bool] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Top-k by inner product: within ``env`` if given, else across the envs ``among`` accepts (default: all).

        Returns ``(scores float32 (q, k), ids int64 (q, k))``, best first. Restricted to
        an env, each row holds exactly ``min(k, count(env))`` real results; the rest
        (and everything for an unknown env) is padding (``-inf``, ``-1``).
        """
        queries = _as_matrix(queries, self.dim, "queries")
        k = _as_k(k)
        if env is not None:
            _check_env(env)
        _apply_faiss_threads()
        with self._lock:
            self._adopt_ready()
            if env is not None:
                e = self._envs.get(env)
                if e is None or len(queries) == 0:
                    return _padding(len(queries), k)
                return self._search_env(env, e, queries, k)
            parts = [self._search_env(name, e, queries, k) for name, e in self._envs.items() if (among is None or among(name)) and len(queries)]
            if not parts:
                return _padding(len(queries), k)
        return _merge(parts, k)

    def search_envs(
        self, queries: np.ndarray, k: int, envs: Sequence[str], *, nprobe_fraction: float = 1.0, max_codes: int = 0
    ) -> tuple[np.ndarray, np.ndarray]:
        """Like :meth:`search`, but query ``i`` is restricted to ``envs[i]``; queries are batched per env.

        For callers that need the neighbourhood, not exact neighbours (faster, approximate):
        ``nprobe_fraction`` < 1 probes that share of an IVF environment's calibrated lists;
        ``max_codes`` > 0 stops scanning after that many vectors per query (near-duplicate
        trajectories pile up in a few huge lists, which would otherwise be scanned whole)."""
        queries = _as_matrix(queries, self.dim, "queries")
        k = _as_k(k)
        if isinstance(envs, str):
            raise VectorIndexError("envs must be a sequence of environment names, one per query, not a string")
        envs = list(envs)
        if len(envs) != len(queries):
            raise VectorIndexError(f"envs has {len(envs)} names for {len(queries)} queries")
        for name in envs:
            _check_env(name)
        scores, ids = _padding(len(queries), k)
        if not envs:
            return scores, ids
        names, inverse = np.unique(np.asarray(envs, dtype=object), return_inverse=True)
        _apply_faiss_threads()
        with self._lock:
            self._adopt_ready()
            for g, name in enumerate(names.tolist()):
                e = self._envs.get(name)
                if e is None:
                    continue
                rows = np.flatnonzero(inverse == g)
                scores[rows], ids[rows] = self._search_env(name, e, queries[rows], k, nprobe_fraction, max_codes)
        return scores, ids

    def _search_env(
        self, name: str, e: _Env, queries: np.ndarray, k: int, nprobe_fraction: float = 1.0, max_codes: int = 0
    ) -> tuple[np.ndarray, np.ndarray]:
        """One env's top-k; IVF rows that came back short are searched again with more lists."""
        want = min(k, e.ntotal)
        searcher = self._searcher(name, e, want)
        nprobe = e.nprobe
        # Both the caller's cap and the env's calibrated one (grown with the lists since the
        # last retrain) are upper bounds: the smaller applies. FAISS: 0 scans every probed list whole.
        caps = [max_codes] if max_codes > 0 else []
        if e.max_codes:
            caps.append(math.ceil(e.max_codes * max(1.0, e.ntotal / max(1, e.trained_size))))
        codes = max(min(caps), want) if caps else 0
        if searcher is e.index and e.kind == "flat":
            scores, ids = _flat_search(e, queries, want)
        elif searcher is e.index and e.kind == "ivf" and (nprobe_fraction < 1.0 or codes):
            nprobe = max(1, int(round(e.nprobe * nprobe_fraction)))
            scores, ids = searcher.search(queries, want, params=faiss.SearchParametersIVF(nprobe=nprobe, max_codes=codes))
        else:
            scores, ids = searcher.search(queries, want)
        if e.kind == "ivf":
            # The probed lists held fewer than `want` vectors (near-duplicate data leaves many
            # lists empty): probe 4x as many lists for those rows, up to all of them (exact).
            short = np.flatnonzero((ids < 0).any(axis=1))
            while len(short) and nprobe < e.nlist:
                nprobe = min(e.nlist, nprobe * 4)
                params = faiss.SearchParametersIVF(nprobe=nprobe, max_codes=codes)
                scores[short], ids[short] = e.index.search(queries[short], want, params=params)
                short = short[(ids[short] < 0).any(axis=1)]
        scores = np.where(ids < 0, np.float32(PAD_SCORE), scores).astype(np.float32, copy=False)
        if want < k:
            pad_s, pad_i = _padding(len(queries), k - want)
            scores, ids = np.hstack([scores, pad_s]), np.hstack([ids, pad_i])
        return scores, ids.astype(np.int64, copy=False)

    # ------------------------------------------------------------------ lookups

    def env_of(self, id: int) -> str | None:
        """The environment holding ``id``, or None."""
        with self._lock:
            return self._where.get(int(id))

    def contains(self, id: int) -> bool:
        """Whether ``id`` is indexed: a cheap check of the cache against the store."""
        with self._lock:
            return int(id) in self._where

    def count(self, env: str | None = None) -> int:
        """Vectors stored in ``env`` (0 if unknown), or in all environments."""
        with self._lock:
            if env is None:
                return len(self._where)
            e = self._envs.get(env)
            return e.ntotal if e is not None else 0

    def __len__(self) -> int:
        return self.count()

    def ids(self) -> dict[str, np.ndarray]:
        """Per environment, the ids its FAISS sub-index holds (read back from FAISS, not from
        the id cache: what a search can return; O(n), for audits)."""
        with self._lock:
            return {env: _export_ids(e) for env, e in self._envs.items()}

    def envs(self) -> list[str]:
        """Environments holding at least one vector, sorted."""
        with self._lock:
            return sorted(self._envs)

    def stats(self) -> dict[str, Any]:
        """How each env is indexed (kind, ntotal, nlist, nprobe, ...) and whether search runs on a GPU."""
        with self._lock:
            return {
                "gpu": self._gpu_res is not None,
                "dim": self.dim,
                "ntotal": len(self._where),
                "envs": {
                    name: {
                        "kind": e.kind,
                        "ntotal": e.ntotal,
                        "nlist": e.nlist,
                        "nprobe": e.nprobe,
                        "trained_size": e.trained_size,
                        "calibrated_recall": e.recall,
                        "max_codes": e.max_codes,
                    }
                    for name, e in sorted(self._envs.items())
                },
            }

    # ------------------------------------------------------------------ persistence

    def save(self, directory: str | Path, stamp: int, identity: str = "") -> None:
        """Write the index atomically: env files first, then the manifest, which commits them.

        Env files carry a fresh token in their name, so a crash at any point leaves
        the previous manifest and the files it names intact. ``stamp`` (e.g. the LMDB
        generation) comes back from :meth:`load` so the caller can tell a stale cache;
        ``identity`` (the store's id and a digest of what it indexes) makes :meth:`load`
        refuse a cache written for another store. A failed save (a full disk) removes what
        it wrote and raises :class:`IndexSaveError` saying where and why.
        Not safe against two processes saving into the same directory at once.
        """
        _save_index(self, directory, stamp, identity)

    @classmethod
    def load(
        cls, directory: str | Path, dim: int, config: IndexConfig | None = None, *, identity: str | None = None
    ) -> tuple["VectorIndex", int] | None:
        """``(index, stamp)`` from a directory written by :meth:`save`, or None.

        None (with a logged warning) when the cache is missing, unreadable, corrupt, of
        another dimension, or (``identity`` given) written for another store or other
        contents: it is only a cache, the caller rebuilds it from LMDB.
        """
        return _load_index(cls, directory, dim, config, identity)

    def _build(self, ids: np.ndarray, vectors: np.ndarray) -> _Env:
        """A fresh sub-index for these vectors: exact up to exact_max, IVF above."""
        n = len(ids)
        if n <= self.config.exact_max:
            index = faiss.IndexIDMap2(faiss.IndexFlatIP(self.dim))
            index.add_with_ids(vectors, ids)
            return _Env(index=index, kind="flat", flat=faiss.downcast_index(index.index))
        rng = np.random.default_rng(_SEED)
        ivf, lists = _trained_ivf(self.dim, vectors, self.config.nlist, rng)
        nlist = ivf.nlist
        vectors, ids = np.ascontiguousarray(vectors, dtype=np.float32), np.ascontiguousarray(ids, dtype=np.int64)
        add_preassigned(ivf, vectors, lists, ids)  # the assignment is already known: not searched twice
        e = _Env(index=ivf, kind="ivf", nlist=nlist, nprobe=min(self.config.nprobe, nlist) if self.config.nprobe else nlist, trained_size=n)
        if self.config.nprobe:
            ivf.nprobe = e.nprobe
        else:
            _calibrate_env(self.config, e, ids, vectors, rng)
        log.debug("index: built IVF nlist=%d nprobe=%d max_codes=%d over %d vectors", nlist, e.nprobe, e.max_codes, n)
        return e

    # ------------------------------------------------------------------ GPU

    def _searcher(self, name: str, e: _Env, k: int) -> Any:
        """The index to search: the GPU replica (re-copied if stale) when usable, else the CPU master."""
        if self._gpu_res is None or k > _GPU_MAX_K or e.nprobe > _GPU_MAX_K:
            return e.index
        if name in self._dirty or name not in self._replicas:
            self._replicas[name] = faiss.index_cpu_to_gpu(self._gpu_res, 0, e.index)
            self._dirty.discard(name)
        return self._replicas[name]

    def _add_to_replica(self, name: str, ids: np.ndarray, vectors: np.ndarray) -> None:
        """Keep a fresh GPU replica fresh on plain adds instead of re-copying the whole env."""
        replica = self._replicas.get(name)
        if replica is None or name in self._dirty:
            return
        try:
            replica.add_with_ids(vectors, ids)
        except Exception as exc:  # noqa: BLE001 - fall back to a full re-copy at the next search
            log.warning("index: GPU replica add failed (%s); it will be re-copied", exc)
            self._dirty.add(name)


# ---------------------------------------------------------------------- helpers


def _calibration_settings(config: IndexConfig) -> dict[str, Any]:
    """What an IVF env's nprobe and scan cap are calibrated for (a saved cache records it)."""
    return {"k": config.calibration_k, "target_recall": config.target_recall, "search_max_codes": config.search_max_codes, "nprobe": config.nprobe}


def _calibrate_env(config: IndexConfig, e: _Env, ids: np.ndarray | None = None, vectors: np.ndarray | None = None,
                   rng: np.random.Generator | None = None) -> None:
    """Set an IVF env's nprobe and scan cap to the cheapest reaching target_recall.

    Caps are tried from 1/16 of ``search_max_codes`` up to all of it (a smaller cap
    scans less, whatever the nprobe), each with nprobe calibrated under it; where none
    reaches the target (many near neighbours in one huge list), the env is
    calibrated and searched without a cap."""
    if ids is None or vectors is None:
        ids, vectors = _export(e)
    rng = rng if rng is not None else np.random.default_rng(_SEED)
    top = config.search_max_codes
    k = config.calibration_k
    caps = sorted({max(k + 1, top >> shift) for shift in range(5)}) + [0] if top else [0]
    e.nprobe, e.recall, cap = _calibrate(e.index, ids, vectors, e.nlist, config.target_recall, rng, caps, k)
    # Stored relative to trained_size: searches scale it by the growth since (a loaded env
    # may be calibrated after it has grown).
    e.max_codes = max(k + 1, math.ceil(cap * e.trained_size / max(e.trained_size, e.ntotal))) if cap else 0
    e.index.nprobe = e.nprobe


def _save_index(index: "VectorIndex", directory: str | Path, stamp: int, identity: str) -> None:
    """:meth:`VectorIndex.save`."""
    if isinstance(stamp, bool) or not isinstance(stamp, (int, np.integer)):
        raise VectorIndexError(f"stamp must be an integer, got {stamp!r}")
    directory = Path(directory)
    written: list[Path] = []
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with index._lock:
            _write_files(index, directory, int(stamp), identity, written)
    except OSError as exc:
        for path in written:
            with contextlib.suppress(OSError):
                path.unlink()
        why = "no space left on the device" if exc.errno == errno.ENOSPC else (exc.strerror or str(exc))
        raise IndexSaveError(f"{directory}: could not save the index cache: {why}; the store is intact "
                             "(the cache is rebuilt from it when needed); free space and close the store again") from exc


def _write_files(index: "VectorIndex", directory: Path, stamp: int, identity: str, written: list[Path]) -> None:
    token = uuid.uuid4().hex[:12]
    entries = []
    for i, (name, e) in enumerate(sorted(index._envs.items())):
        fname = f"env-{i:05d}-{token}.faiss"
        tmp = directory / (fname + ".tmp")
        written.append(tmp)
        faiss.write_index(e.index, str(tmp))
        crc, size = _fsync_crc(tmp)
        os.replace(tmp, directory / fname)
        written.append(directory / fname)
        entries.append({"name": name, "file": fname, "count": e.ntotal, "kind": e.kind, "nlist": e.nlist, "nprobe": e.nprobe,
                        "trained_size": e.trained_size, "recall": e.recall, "max_codes": e.max_codes, "bytes": size, "crc32": crc})
    manifest = {
        "format": _FORMAT,
        "dim": index.dim,
        "stamp": stamp,
        "identity": identity,
        "count": len(index._where),
        "calibration": _calibration_settings(index.config),  # what the IVF envs' nprobe and scan caps are calibrated for
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


def _load_index(cls: type["VectorIndex"], directory: str | Path, dim: int, config: IndexConfig | None, identity: str | None) -> tuple["VectorIndex", int] | None:
    """:meth:`VectorIndex.load`."""
    index = cls(dim, config)  # a bad config or use_gpu="yes" without a GPU still raises
    directory = Path(directory)
    manifest_path = directory / _MANIFEST
    if not manifest_path.is_file():
        log.info("index: no saved index in %s", directory)
        return None
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        if manifest.get("format") != _FORMAT:
            raise ValueError(f"unknown format {manifest.get('format')!r}")
        if manifest.get("dim") != index.dim:
            raise ValueError(f"saved dim {manifest.get('dim')!r} != expected {index.dim}")
        stamp = manifest["stamp"]
        if isinstance(stamp, bool) or not isinstance(stamp, int):
            raise ValueError(f"stamp {stamp!r} is not an integer")
        if identity is not None and manifest.get("identity", "") != identity:
            raise ValueError(f"written for another store or other contents ({manifest.get('identity', '')!r}, this store: {identity!r})")
        for entry in manifest["envs"]:
            name = entry["name"]
            _check_env(name)
            if name in index._envs:
                raise ValueError(f"environment {name!r} listed twice")
            path = directory / entry["file"]
            if Path(entry["file"]).name != entry["file"] or not path.is_file():
                raise ValueError(f"file {entry['file']!r} of environment {name!r} is missing")
            crc, size = _crc(path)
            if size != entry["bytes"] or crc != entry["crc32"]:
                raise ValueError(f"file {entry['file']!r} is truncated or damaged")
            e = _Env(
                index=faiss.read_index(str(path)),
                kind=entry["kind"],
                nlist=int(entry["nlist"]),
                nprobe=int(entry["nprobe"]),
                trained_size=int(entry["trained_size"]),
                recall=entry.get("recall"),
                max_codes=int(entry.get("max_codes", 0)),
            )
            _check_loaded(e, index.dim)
            if e.ntotal != entry["count"] or e.ntotal == 0:
                raise ValueError(f"environment {name!r} holds {e.ntotal} vectors, manifest says {entry['count']}")
            if e.kind == "ivf" and index.config.nprobe:
                e.nprobe = e.index.nprobe = min(index.config.nprobe, e.nlist)
                e.max_codes = 0
            elif e.kind == "ivf" and manifest.get("calibration") != _calibration_settings(index.config):
                log.info("index: %s was calibrated for %s; calibrating for %s", name, manifest.get("calibration"), _calibration_settings(index.config))
                _calibrate_env(index.config, e)
            ids = _export_ids(e)
            before = len(index._where)
            index._where.update(dict.fromkeys(ids.tolist(), name))
            if len(index._where) != before + len(ids):
                raise ValueError(f"environment {name!r} repeats ids of another environment")
            index._envs[name] = e
            index._dirty.add(name)
        if len(index._where) != manifest["count"]:
            raise ValueError(f"{len(index._where)} vectors loaded, manifest says {manifest['count']}")
    except Exception as exc:  # noqa: BLE001 - a broken cache must never stop the engine
        log.warning("index: ignoring unusable saved index in %s: %s", directory, exc)
        return None
    return index, stamp

# ------------------------------------------------------------------ building


def _retrain_at(env: str, e: _Env, growth: float) -> float:
    """Size at which an IVF environment is retrained: ``growth`` times its trained size, plus
    up to half of that growth, fixed per environment. Environments that grow together
    (one stream feeds them all) would otherwise all retrain in the same few seconds."""
    spread = (zlib.crc32(env.encode("utf-8")) % 1024) / 1024 * 0.5
    return e.trained_size * (growth + (growth - 1.0) * spread)


def _lower_thread_priority(nice: int) -> None:
    """Raise the calling thread's niceness to ``nice`` (Linux keeps one per thread; OpenMP
    workers this thread starts inherit it). Elsewhere, or where refused, it stays as it is."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), nice))
    except OSError as exc:
        log.debug("index: could not lower the retrain thread's priority: %s", exc)


def _want_gpu(mode: str) -> bool:
    """Whether to keep GPU replicas; use_gpu="yes" without a usable GPU is an error."""
    if mode == "no":
        return False
    ngpu = faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0
    if ngpu > 0 and hasattr(faiss, "StandardGpuResources"):
        return True
    if mode == "yes":
        raise VectorIndexError(
            "index.use_gpu = 'yes' but FAISS sees no GPU (faiss-cpu build or no CUDA device); "
            "install faiss-gpu or set index.use_gpu to 'auto' or 'no'"
        )
    return False


def _check_env(env: Any) -> None:
    if not isinstance(env, str) or not env:
        raise VectorIndexError(f"env must be a non-empty string, got {env!r}")


def _as_ids(ids: Any, name: str, *, allow_negative: bool = False) -> np.ndarray:
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


def _as_matrix(x: Any, dim: int, name: str) -> np.ndarray:
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


def _as_k(k: Any) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise VectorIndexError(f"k must be a positive integer, got {k!r}")
    return int(k)


def _padding(q: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    return np.full((q, k), PAD_SCORE, dtype=np.float32), np.full((q, k), PAD_ID, dtype=np.int64)


def _merge(parts: list[tuple[np.ndarray, np.ndarray]], k: int) -> tuple[np.ndarray, np.ndarray]:
    """Global top-k from per-env top-k results, vectorised over queries."""
    if len(parts) == 1:
        return parts[0]
    scores = np.concatenate([s for s, _ in parts], axis=1)
    ids = np.concatenate([i for _, i in parts], axis=1)
    top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    scores, ids = np.take_along_axis(scores, top, 1), np.take_along_axis(ids, top, 1)
    order = np.argsort(-scores, axis=1, kind="stable")
    return np.take_along_axis(scores, order, 1), np.take_along_axis(ids, order, 1)


def _flat_search(e: _Env, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
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


def _export_ids(e: _Env) -> np.ndarray:
    """The ids a sub-index holds (for IVF, read from its inverted lists without their codes)."""
    if e.kind == "flat":
        return faiss.vector_to_array(e.index.id_map).astype(np.int64, copy=False)
    invlists = e.index.invlists
    parts = [faiss.rev_swig_ptr(invlists.get_ids(lst), invlists.list_size(lst)).copy()
             for lst in range(invlists.nlist) if invlists.list_size(lst)]
    return np.concatenate(parts).astype(np.int64, copy=False) if parts else np.empty(0, dtype=np.int64)


def _export(e: _Env) -> tuple[np.ndarray, np.ndarray]:
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


def _trained_ivf(dim: int, vectors: np.ndarray, nlist_setting: int, rng: np.random.Generator) -> tuple[Any, np.ndarray]:
    """An empty IVF trained on (a sample of) ``vectors``, without lists none of them falls in,
    and each vector's list in it. ``nlist_setting`` (0: 4 sqrt(n)) is an upper bound while the
    env is too small to train that many lists well."""
    n = len(vectors)
    nlist = nlist_setting or int(round(4 * math.sqrt(n)))
    nlist = max(1, min(nlist, n // _MIN_PER_CENTROID))
    ivf = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, nlist, faiss.METRIC_INNER_PRODUCT)
    ivf.cp.niter = _KMEANS_ITERS if n < _KMEANS_FEWER_ITERS_FROM else _KMEANS_ITERS // 2
    ivf.cp.seed = _SEED
    ivf.cp.spherical = True  # unit-norm centroids suit inner product on normalised vectors
    ivf.cp.min_points_per_centroid = 1  # we size the sample ourselves; no FAISS warnings
    ivf.cp.max_points_per_centroid = _TRAIN_PER_CENTROID
    sample_size = min(n, _TRAIN_PER_CENTROID * nlist)
    sample = vectors if sample_size == n else vectors[np.sort(rng.choice(n, sample_size, replace=False))]
    ivf.train(np.ascontiguousarray(sample))
    ivf, lists = _without_empty_lists(ivf, vectors)
    ivf.set_direct_map_type(faiss.DirectMap.Hashtable)  # reconstruct + remove_ids with arbitrary ids
    return ivf, lists


def _without_empty_lists(ivf: Any, vectors: np.ndarray) -> tuple[Any, np.ndarray]:
    """The trained IVF, or an equivalent one without the lists none of ``vectors`` falls
    in, and each vector's list in it.

    Near-duplicate trajectories leave most k-means centroids without a single point (the
    copies cannot be split). A query near such a centroid probes empty lists, comes back
    short and has to be searched again with more lists. Dropping those centroids changes
    no stored vector's list (each sits in its nearest centroid's, which is kept)."""
    _, assign = ivf.quantizer.search(vectors, 1)
    assign = np.ascontiguousarray(assign[:, 0], dtype=np.int64)
    used = np.unique(assign)
    if len(used) == ivf.nlist or len(used) == 0 or used[0] < 0:
        return ivf, assign
    quantizer = faiss.IndexFlatIP(ivf.d)
    quantizer.add(ivf.quantizer.reconstruct_n(0, ivf.nlist)[used])
    compact = faiss.IndexIVFFlat(quantizer, ivf.d, len(used), faiss.METRIC_INNER_PRODUCT)
    if not compact.is_trained:  # FAISS marks it trained when the quantizer holds nlist centroids
        raise IndexBuildError("IVF without empty lists: the compacted quantizer was not accepted as trained")
    renumber = np.full(ivf.nlist, -1, dtype=np.int64)
    renumber[used] = np.arange(len(used))
    return compact, renumber[assign]


def _calibrate(
    ivf: Any, ids: np.ndarray, vectors: np.ndarray, nlist: int, target: float, rng: np.random.Generator,
    caps: Sequence[int] = (0,), k: int = 4,
) -> tuple[int, float, int]:
    """``(nprobe, recall, cap)``: the smallest nprobe in 1, 2, 4, ..., nlist reaching ``target``
    recall@k on stored vectors as queries, scanning at most ``cap`` vectors per query (0: no
    limit), for the first cap in ``caps`` that reaches it (else the last cap, all lists).

    Recall is counted by score: a returned neighbour is correct when it is at least as
    similar as the exact k-th neighbour. With exact duplicates (common in real logs) an
    id-based count would punish the index for picking a different one of equal vectors.
    """
    n = len(ids)
    k = min(k, n - 1)
    if k < 1:
        return nlist, 1.0, 0
    sample = np.sort(rng.choice(n, min(_CAL_QUERIES, n), replace=False))
    queries, self_ids = vectors[sample], ids[sample]
    exact_scores, _ = faiss.knn(queries, vectors, k + 1, metric=faiss.METRIC_INNER_PRODUCT)  # best first
    threshold = exact_scores[:, k] - 1e-5  # k-th best after the query itself
    ladder = [1 << p for p in range(max(1, nlist).bit_length()) if (1 << p) < nlist] + [nlist]
    recall = 1.0
    for cap in caps:
        for nprobe in ladder:
            params = faiss.SearchParametersIVF(nprobe=nprobe, max_codes=max(cap, k + 1) if cap else 0)
            scores, got = ivf.search(queries, k + 1, params=params)
            # Drop the query itself (or, if it was not returned, the weakest result).
            drop = np.where((got == self_ids[:, None]).any(axis=1), np.argmax(got == self_ids[:, None], axis=1), k)
            keep = np.ones_like(got, dtype=bool)
            keep[np.arange(len(got)), drop] = False
            hits = ((scores >= threshold[:, None]) & (got >= 0) & keep).sum(axis=1)
            recall = float((hits / k).mean())
            if recall >= target:
                return nprobe, recall, cap
            if cap and nprobe * n >= 4 * cap * nlist:
                break  # the probed lists hold 4x the cap: more lists would not be reached
    return nlist, recall, caps[-1]


def _check_loaded(e: _Env, dim: int) -> None:
    """Refuse a loaded FAISS object that is not what :meth:`VectorIndex.save` writes."""
    index = e.index
    if index.d != dim:
        raise ValueError(f"index dimension {index.d} != {dim}")
    if e.kind == "flat":
        if not isinstance(index, faiss.IndexIDMap2):
            raise ValueError(f"flat environment is a {type(index).__name__}")
        e.flat = faiss.downcast_index(index.index)
        if not isinstance(e.flat, faiss.IndexFlatIP) or e.flat.ntotal != index.ntotal:
            raise ValueError(f"flat environment wraps a {type(e.flat).__name__}")
    elif e.kind == "ivf":
        if not isinstance(index, faiss.IndexIVFFlat) or index.metric_type != faiss.METRIC_INNER_PRODUCT:
            raise ValueError(f"ivf environment is a {type(index).__name__}")
        if index.nlist != e.nlist or not 1 <= e.nprobe <= e.nlist:
            raise ValueError(f"ivf nlist/nprobe {index.nlist}/{e.nprobe} disagree with the manifest")
        if index.direct_map.type != faiss.DirectMap.Hashtable:
            index.set_direct_map_type(faiss.DirectMap.Hashtable)
        index.nprobe = e.nprobe
    else:
        raise ValueError(f"unknown kind {e.kind!r}")


def _crc(path: Path) -> tuple[int, int]:
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return crc, size


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
