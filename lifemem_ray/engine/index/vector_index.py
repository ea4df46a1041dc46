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

import logging
import math
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import faiss
import numpy as np
from faiss.contrib.ivf_tools import add_preassigned

from lifemem_ray.core.errors import VectorIndexError
from lifemem_ray.engine.index.env_index import (
    PAD_ID,
    PAD_SCORE,
    EnvIndex,
    apply_faiss_threads,
    as_ids,
    as_k,
    as_matrix,
    check_env,
    export,
    export_ids,
    flat_search,
    ivf_params,
    merge,
    padding,
    set_faiss_threads,
)
from lifemem_ray.engine.index.index_cache import read_cache, write_cache
from lifemem_ray.engine.index.ivf import (
    SEED,
    calibrate_env,
    calibration_settings,
    lower_thread_priority,
    retrain_at,
    trained_ivf,
)
from lifemem_ray.engine.memory_config import IndexConfig

__all__ = ["PAD_ID", "PAD_SCORE", "VectorIndex", "VectorIndexError", "set_faiss_threads"]


log = logging.getLogger(__name__)


_GPU_MAX_K = 2048  # FAISS GPU k-selection and nprobe limit


# At import: FAISS's BLAS switch-over for the OpenMP thread count the process starts with (a
# process-wide setting; the thread count itself is left as FAISS found it until a caller sets it).
set_faiss_threads()


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
        self.config.checked()
        self._lock = threading.RLock()
        self._envs: dict[str, EnvIndex] = {}
        self._where: dict[int, str] = {}  # id -> env: env_of/contains/remove without asking every env
        self._gpu_res: Any = None
        self._replicas: dict[str, Any] = {}  # env -> GPU copy of the CPU master, for search only
        self._dirty: set[str] = set()  # envs whose GPU copy is stale
        # Background retrains (config.background_retrain): env -> (thread, ids added, ids removed since the export).
        self._retraining: dict[str, tuple[threading.Thread, list[tuple[np.ndarray, np.ndarray]], set[int]]] = {}
        self._retrain_error: BaseException | None = None
        # Finished background builds, adopted (the adds since applied, under the lock) by the
        # next add, search or wait_retrains: never by the low-priority thread that built them.
        self._ready: dict[str, EnvIndex] = {}
        if _want_gpu(self.config.use_gpu):
            self._gpu_res = faiss.StandardGpuResources()

    # ------------------------------------------------------------------ mutation

    def add(self, env: str, ids: np.ndarray, vectors: np.ndarray) -> None:
        """Add vectors of one environment; ids must be new (the index never overwrites)."""
        check_env(env)
        ids = as_ids(ids, "ids")
        vectors = as_matrix(vectors, self.dim, "vectors")
        if len(ids) != len(vectors):
            raise VectorIndexError(f"ids and vectors differ in length: {len(ids)} ids, {len(vectors)} vectors")
        if len(ids) == 0:
            return
        uniq, counts = np.unique(ids, return_counts=True)
        if len(uniq) != len(ids):
            raise VectorIndexError(f"id {int(uniq[counts > 1][0])} appears more than once in the batch", where="ids")
        apply_faiss_threads()
        with self._lock:
            self._adopt_ready()
            for i in ids.tolist():
                if i in self._where:
                    raise VectorIndexError(
                        f"id {i} is already in the index (environment {self._where[i]!r})", where="ids"
                    )
            e = self._envs.get(env)
            total = (e.ntotal if e is not None else 0) + len(ids)
            retrain = e is not None and e.kind == "ivf" and total > retrain_at(env, e, self.config.retrain_growth)
            if e is None:
                self._envs[env] = self._build(ids, vectors)
                self._dirty.add(env)
            elif (e.kind == "flat" and total > self.config.exact_max) or (
                retrain and not self.config.background_retrain
            ):
                old_ids, old_vecs = export(e)
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

    def _start_retrain(self, env: str, e: EnvIndex) -> None:
        """Build the bigger index from a copy on a thread; :meth:`_finish_retrain` swaps it in."""
        ids, vecs = export(e)
        added: list[tuple[np.ndarray, np.ndarray]] = []
        removed: set[int] = set()

        def build() -> None:
            apply_faiss_threads()
            lower_thread_priority(self.config.retrain_nice)
            try:
                fresh = self._build(ids, vecs)
            except BaseException as exc:
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

    def _finish_retrain(self, env: str, fresh: EnvIndex) -> None:
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
                log.warning(
                    "index: retrain of %r holds %d vectors, the live index %d; keeping the live one",
                    env,
                    fresh.ntotal,
                    current.ntotal,
                )
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
        ids = as_ids(ids, "ids", allow_negative=True)
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
                    self._envs[env] = self._build(*export(e))
        return removed

    # ------------------------------------------------------------------ search

    def search(
        self, queries: np.ndarray, k: int, env: str | None = None, *, among: Callable[[str], bool] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Top-k by inner product: within ``env`` if given, else across the envs ``among`` accepts (default: all).

        Returns ``(scores float32 (q, k), ids int64 (q, k))``, best first. Restricted to
        an env, each row holds exactly ``min(k, count(env))`` real results; the rest
        (and everything for an unknown env) is padding (``-inf``, ``-1``).
        """
        queries = as_matrix(queries, self.dim, "queries")
        k = as_k(k)
        if env is not None:
            check_env(env)
        apply_faiss_threads()
        with self._lock:
            self._adopt_ready()
            if env is not None:
                e = self._envs.get(env)
                if e is None or len(queries) == 0:
                    return padding(len(queries), k)
                return self._search_env(env, e, queries, k)
            parts = [
                self._search_env(name, e, queries, k)
                for name, e in self._envs.items()
                if (among is None or among(name)) and len(queries)
            ]
            if not parts:
                return padding(len(queries), k)
        return merge(parts, k)

    def search_envs(
        self, queries: np.ndarray, k: int, envs: Sequence[str], *, nprobe_fraction: float = 1.0, max_codes: int = 0
    ) -> tuple[np.ndarray, np.ndarray]:
        """Like :meth:`search`, but query ``i`` is restricted to ``envs[i]``; queries are batched per env.

        For callers that need the neighbourhood, not exact neighbours (faster, approximate):
        ``nprobe_fraction`` < 1 probes that share of an IVF environment's calibrated lists;
        ``max_codes`` > 0 stops scanning after that many vectors per query (near-duplicate
        trajectories pile up in a few huge lists, which would otherwise be scanned whole)."""
        queries = as_matrix(queries, self.dim, "queries")
        k = as_k(k)
        if isinstance(envs, str):
            raise VectorIndexError("envs must be a sequence of environment names, one per query, not a string")
        envs = list(envs)
        if len(envs) != len(queries):
            raise VectorIndexError(f"envs has {len(envs)} names for {len(queries)} queries")
        for name in envs:
            check_env(name)
        scores, ids = padding(len(queries), k)
        if not envs:
            return scores, ids
        names, inverse = np.unique(np.asarray(envs, dtype=object), return_inverse=True)
        apply_faiss_threads()
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
        self, name: str, e: EnvIndex, queries: np.ndarray, k: int, nprobe_fraction: float = 1.0, max_codes: int = 0
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
            scores, ids = flat_search(e, queries, want)
        elif searcher is e.index and e.kind == "ivf" and (nprobe_fraction < 1.0 or codes):
            nprobe = max(1, round(e.nprobe * nprobe_fraction))
            scores, ids = searcher.search(queries, want, params=ivf_params(nprobe, codes))
        else:
            scores, ids = searcher.search(queries, want)
        if e.kind == "ivf":
            # The probed lists held fewer than `want` vectors (near-duplicate data leaves many
            # lists empty): probe 4x as many lists for those rows, up to all of them (exact).
            short = np.flatnonzero((ids < 0).any(axis=1))
            while len(short) and nprobe < e.nlist:
                nprobe = min(e.nlist, nprobe * 4)
                params = ivf_params(nprobe, codes)
                scores[short], ids[short] = e.index.search(queries[short], want, params=params)
                short = short[(ids[short] < 0).any(axis=1)]
        scores = np.where(ids < 0, np.float32(PAD_SCORE), scores).astype(np.float32, copy=False)
        if want < k:
            pad_s, pad_i = padding(len(queries), k - want)
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
            return {env: export_ids(e) for env, e in self._envs.items()}

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

        EnvIndex files carry a fresh token in their name, so a crash at any point leaves
        the previous manifest and the files it names intact. ``stamp`` (e.g. the LMDB
        generation) comes back from :meth:`load` so the caller can tell a stale cache;
        ``identity`` (the store's id and a digest of what it indexes) makes :meth:`load`
        refuse a cache written for another store. A failed save (a full disk) removes what
        it wrote and raises :class:`IndexSaveError` saying where and why.
        Not safe against two processes saving into the same directory at once.
        """
        with self._lock:
            write_cache(
                self._envs,
                directory,
                dim=self.dim,
                count=len(self._where),
                stamp=stamp,
                identity=identity,
                calibration=calibration_settings(self.config),
            )

    @classmethod
    def load(
        cls, directory: str | Path, dim: int, config: IndexConfig | None = None, *, identity: str | None = None
    ) -> tuple[VectorIndex, int] | None:
        """``(index, stamp)`` from a directory written by :meth:`save`, or None.

        None (with a logged warning) when the cache is missing, unreadable, corrupt, of
        another dimension, or (``identity`` given) written for another store or other
        contents: it is only a cache, the caller rebuilds it from LMDB.
        """
        index = cls(dim, config)  # a bad config or use_gpu="yes" without a GPU still raises
        cached = read_cache(directory, index.dim, identity)
        if cached is None:
            return None
        for name, e in cached.envs.items():
            if e.kind == "ivf" and index.config.nprobe:
                e.nprobe = e.index.nprobe = min(index.config.nprobe, e.nlist)
                e.max_codes = 0
            elif e.kind == "ivf" and cached.calibration != calibration_settings(index.config):
                log.info(
                    "index: %s was calibrated for %s; calibrating for %s",
                    name,
                    cached.calibration,
                    calibration_settings(index.config),
                )
                calibrate_env(index.config, e)
            index._where.update(dict.fromkeys(cached.ids[name].tolist(), name))
            index._envs[name] = e
            index._dirty.add(name)
        return index, cached.stamp

    def _build(self, ids: np.ndarray, vectors: np.ndarray) -> EnvIndex:
        """A fresh sub-index for these vectors: exact up to exact_max, IVF above."""
        n = len(ids)
        if n <= self.config.exact_max:
            index = faiss.IndexIDMap2(faiss.IndexFlatIP(self.dim))
            index.add_with_ids(vectors, ids)
            return EnvIndex(index=index, kind="flat", flat=faiss.downcast_index(index.index))
        rng = np.random.default_rng(SEED)
        ivf, lists = trained_ivf(self.dim, vectors, self.config.nlist, rng)
        nlist = ivf.nlist
        vectors, ids = np.ascontiguousarray(vectors, dtype=np.float32), np.ascontiguousarray(ids, dtype=np.int64)
        add_preassigned(ivf, vectors, lists, ids)  # the assignment is already known: not searched twice
        e = EnvIndex(
            index=ivf,
            kind="ivf",
            nlist=nlist,
            nprobe=min(self.config.nprobe, nlist) if self.config.nprobe else nlist,
            trained_size=n,
        )
        if self.config.nprobe:
            ivf.nprobe = e.nprobe
        else:
            calibrate_env(self.config, e, ids, vectors, rng)
        log.debug("index: built IVF nlist=%d nprobe=%d max_codes=%d over %d vectors", nlist, e.nprobe, e.max_codes, n)
        return e

    # ------------------------------------------------------------------ GPU

    def _searcher(self, name: str, e: EnvIndex, k: int) -> Any:
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
