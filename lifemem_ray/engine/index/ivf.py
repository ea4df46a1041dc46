"""Training and calibrating a scope's IVF index: spherical k-means over a seeded sample (the
lists no vector falls in dropped), and nprobe with a per-query scan cap chosen together, the
cheapest that reaches ``index.target_recall`` on stored vectors used as queries. Also when an
environment is retrained (it grew ``index.retrain_growth`` times) and the niceness of the
background thread that does it."""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import zlib
from collections.abc import Sequence
from typing import Any

import faiss
import numpy as np

from lifemem_ray.core.errors import IndexBuildError
from lifemem_ray.engine.index.env_index import DIRECT_MAP_HASHTABLE, EnvIndex, export, ivf_params
from lifemem_ray.engine.memory_config import IndexConfig

log = logging.getLogger(__name__)

_MIN_PER_CENTROID = 39  # nlist <= n / 39: k-means gets enough points per centroid


_TRAIN_PER_CENTROID = 40  # training sample: at most this many points per centroid


_KMEANS_ITERS = 10  # few iterations: training must stay fast on 2 cores


# Above this many vectors, half as many: a build's k-means grows as n^1.5 and big retrains
# run beside ingest (58k vectors: 8.1 -> 5.3 CPU-s, recall@4 0.986 -> 0.980, nprobe calibrated).
_KMEANS_FEWER_ITERS_FROM = 20_000


CAL_QUERIES = 200  # stored vectors used as queries when calibrating nprobe


SEED = 20240611  # sampling and k-means are seeded: rebuilds are reproducible


def calibration_settings(config: IndexConfig) -> dict[str, Any]:
    """What an IVF env's nprobe and scan cap are calibrated for (a saved cache records it)."""
    return {
        "k": config.calibration_k,
        "target_recall": config.target_recall,
        "search_max_codes": config.search_max_codes,
        "nprobe": config.nprobe,
    }


def calibrate_env(
    config: IndexConfig,
    e: EnvIndex,
    ids: np.ndarray | None = None,
    vectors: np.ndarray | None = None,
    rng: np.random.Generator | None = None,
) -> None:
    """Set an IVF env's nprobe and scan cap to the cheapest reaching target_recall.

    Caps are tried from 1/16 of ``search_max_codes`` up to all of it (a smaller cap
    scans less, whatever the nprobe), each with nprobe calibrated under it; where none
    reaches the target (many near neighbours in one huge list), the env is
    calibrated and searched without a cap."""
    if ids is None or vectors is None:
        ids, vectors = export(e)
    rng = rng if rng is not None else np.random.default_rng(SEED)
    top = config.search_max_codes
    k = config.calibration_k
    caps = [*sorted({max(k + 1, top >> shift) for shift in range(5)}), 0] if top else [0]
    e.nprobe, e.recall, cap = calibrate(e.index, ids, vectors, e.nlist, config.target_recall, rng, caps, k)
    # Stored relative to trained_size: searches scale it by the growth since (a loaded env
    # may be calibrated after it has grown).
    e.max_codes = max(k + 1, math.ceil(cap * e.trained_size / max(e.trained_size, e.ntotal))) if cap else 0
    e.index.nprobe = e.nprobe


def retrain_at(env: str, e: EnvIndex, growth: float) -> float:
    """Size at which an IVF environment is retrained: ``growth`` times its trained size, plus
    up to half of that growth, fixed per environment. Environments that grow together
    (one stream feeds them all) would otherwise all retrain in the same few seconds."""
    spread = (zlib.crc32(env.encode("utf-8")) % 1024) / 1024 * 0.5
    return e.trained_size * (growth + (growth - 1.0) * spread)


def lower_thread_priority(nice: int) -> None:
    """Raise the calling thread's niceness to ``nice`` (Linux keeps one per thread; OpenMP
    workers this thread starts inherit it). Elsewhere, or where refused, it stays as it is."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), nice))
    except OSError as exc:
        log.debug("index: could not lower the retrain thread's priority: %s", exc)


def trained_ivf(dim: int, vectors: np.ndarray, nlist_setting: int, rng: np.random.Generator) -> tuple[Any, np.ndarray]:
    """An empty IVF trained on (a sample of) ``vectors``, without lists none of them falls in,
    and each vector's list in it. ``nlist_setting`` (0: 4 sqrt(n)) is an upper bound while the
    env is too small to train that many lists well."""
    n = len(vectors)
    nlist = nlist_setting or round(4 * math.sqrt(n))
    nlist = max(1, min(nlist, n // _MIN_PER_CENTROID))
    ivf = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, nlist, faiss.METRIC_INNER_PRODUCT)
    ivf.cp.niter = _KMEANS_ITERS if n < _KMEANS_FEWER_ITERS_FROM else _KMEANS_ITERS // 2
    ivf.cp.seed = SEED
    ivf.cp.spherical = True  # unit-norm centroids suit inner product on normalised vectors
    ivf.cp.min_points_per_centroid = 1  # we size the sample ourselves; no FAISS warnings
    ivf.cp.max_points_per_centroid = _TRAIN_PER_CENTROID
    sample_size = min(n, _TRAIN_PER_CENTROID * nlist)
    sample = vectors if sample_size == n else vectors[np.sort(rng.choice(n, sample_size, replace=False))]
    ivf.train(np.ascontiguousarray(sample))
    ivf, lists = _without_empty_lists(ivf, vectors)
    ivf.set_direct_map_type(DIRECT_MAP_HASHTABLE)  # reconstruct + remove_ids with arbitrary ids
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


def calibrate(
    ivf: Any,
    ids: np.ndarray,
    vectors: np.ndarray,
    nlist: int,
    target: float,
    rng: np.random.Generator,
    caps: Sequence[int] = (0,),
    k: int = 4,
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
    sample = np.sort(rng.choice(n, min(CAL_QUERIES, n), replace=False))
    queries, self_ids = vectors[sample], ids[sample]
    exact_scores, _ = faiss.knn(queries, vectors, k + 1, metric=faiss.METRIC_INNER_PRODUCT)  # best first
    threshold = exact_scores[:, k] - 1e-5  # k-th best after the query itself
    ladder = [1 << p for p in range(max(1, nlist).bit_length()) if (1 << p) < nlist] + [nlist]
    recall = 1.0
    for cap in caps:
        for nprobe in ladder:
            params = ivf_params(nprobe, max(cap, k + 1) if cap else 0)
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
