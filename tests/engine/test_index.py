"""VectorIndex: exact/IVF per-environment search, growth, removal, persistence."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import faiss
import numpy as np
import pytest

from lifemem_ray.engine.index.vector_index import PAD_ID, VectorIndex, VectorIndexError
from lifemem_ray.engine.memory_config import ConfigError, IndexConfig

DIM = 32


def unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def random_vectors(rng: np.random.Generator, n: int, dim: int = DIM) -> np.ndarray:
    return unit(rng.standard_normal((n, dim)))


def sphere_mixture(rng: np.random.Generator, centers: np.ndarray, n: int, sigma: float) -> np.ndarray:
    """A mixture of Gaussians around unit centres, projected back on the sphere (embedding-like)."""
    pick = rng.integers(len(centers), size=n)
    return unit(centers[pick] + sigma * rng.standard_normal((n, centers.shape[1])))


def random_ids(rng: np.random.Generator, n: int) -> np.ndarray:
    """Sparse 63-bit ids, as the engine uses."""
    return rng.choice(np.iinfo(np.int64).max, size=n, replace=False).astype(np.int64)


def brute_force(queries: np.ndarray, vectors: np.ndarray, ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    scores = queries @ vectors.T
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(scores, order, 1), ids[order]


def recall(got: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean([len(set(g) & set(t)) / len(t) for g, t in zip(got.tolist(), truth.tolist(), strict=True)]))


# --------------------------------------------------------------------------- basics


def test_add_search_remove_basics() -> None:
    rng = np.random.default_rng(0)
    index = VectorIndex(DIM)
    a, b = random_vectors(rng, 20), random_vectors(rng, 5)
    index.add("webshop", np.arange(100, 120), a)
    index.add("alfworld", np.arange(200, 205), b)
    assert len(index) == 25 and index.count() == 25
    assert index.count("webshop") == 20 and index.count("alfworld") == 5 and index.count("nope") == 0
    assert index.envs() == ["alfworld", "webshop"]
    assert index.env_of(103) == "webshop" and index.env_of(202) == "alfworld" and index.env_of(999) is None
    assert index.contains(np.int64(204)) and not index.contains(5)

    scores, ids = index.search(a[:3], 1, env="webshop")
    assert ids[:, 0].tolist() == [100, 101, 102]
    assert scores.dtype == np.float32 and ids.dtype == np.int64
    np.testing.assert_allclose(scores[:, 0], 1.0, atol=1e-5)

    assert index.remove(np.array([100, 101, 999, 202])) == 3  # 999 is unknown: ignored
    assert not index.contains(100) and index.count("webshop") == 18 and index.count("alfworld") == 4
    _, ids = index.search(a[:1], 20, env="webshop")
    assert 100 not in ids and (ids[0, :18] >= 0).all() and (ids[0, 18:] == PAD_ID).all()

    assert index.remove([200, 201, 203, 204]) == 4
    assert index.envs() == ["webshop"]  # an emptied environment disappears
    assert index.remove(np.array([], dtype=np.int64)) == 0


def test_duplicate_ids_are_rejected_with_the_id() -> None:
    rng = np.random.default_rng(1)
    index = VectorIndex(DIM)
    index.add("a", np.array([7, 8]), random_vectors(rng, 2))
    with pytest.raises(VectorIndexError, match=r"id 8 is already in the index \(environment 'a'\)"):
        index.add("b", np.array([9, 8]), random_vectors(rng, 2))
    with pytest.raises(VectorIndexError, match="id 11 appears more than once"):
        index.add("b", np.array([11, 12, 11]), random_vectors(rng, 3))
    assert len(index) == 2 and not index.contains(9)  # a refused batch adds nothing


@pytest.mark.parametrize(
    ("ids", "vectors", "env", "message"),
    [
        ([1, 2], np.zeros((2, DIM + 1), np.float32), "e", r"vectors must have shape \(n, 32\), got \(2, 33\)"),
        ([1], np.zeros(DIM, np.float32), "e", r"vectors must have shape \(n, 32\), got \(32,\)"),
        ([1, 2], np.zeros((3, DIM), np.float32), "e", "2 ids, 3 vectors"),
        ([1.0, 2.0], np.zeros((2, DIM), np.float32), "e", "ids must be integers, got dtype float64"),
        ([1, -2], np.zeros((2, DIM), np.float32), "e", "ids must be non-negative, got -2"),
        ([[1, 2]], np.zeros((2, DIM), np.float32), "e", r"ids must be a 1-D array, got shape \(1, 2\)"),
        ([1], [["a"] * DIM], "e", "vectors must be a numeric array"),
        ([1], np.zeros((1, DIM)), "", "env must be a non-empty string"),
        ([1], np.zeros((1, DIM)), 3, "env must be a non-empty string, got 3"),
        ([1], np.full((1, DIM), 1e39), "e", "row 0 contains NaN or infinite values"),
    ],
)
def test_add_validation(ids: object, vectors: object, env: object, message: str) -> None:
    index = VectorIndex(DIM)
    with pytest.raises(VectorIndexError, match=message):
        index.add(env, ids, vectors)  # type: ignore[arg-type]
    assert len(index) == 0


def test_nan_and_inf_name_the_row() -> None:
    index = VectorIndex(DIM)
    bad = np.zeros((3, DIM), np.float32)
    bad[2, 5] = np.nan
    with pytest.raises(VectorIndexError, match="vectors: row 2 contains NaN"):
        index.add("e", [1, 2, 3], bad)
    bad[2, 5] = np.inf
    with pytest.raises(VectorIndexError, match="queries: row 2 contains NaN or infinite"):
        index.search(bad, 3)


def test_search_validation() -> None:
    rng = np.random.default_rng(2)
    index = VectorIndex(DIM)
    index.add("e", [1], random_vectors(rng, 1))
    q = random_vectors(rng, 2)
    with pytest.raises(VectorIndexError, match=r"queries must have shape \(n, 32\), got \(2, 31\)"):
        index.search(q[:, :31], 3)
    with pytest.raises(VectorIndexError, match="k must be a positive integer, got 0"):
        index.search(q, 0)
    with pytest.raises(VectorIndexError, match="k must be a positive integer, got True"):
        index.search(q, True)
    with pytest.raises(VectorIndexError, match="envs has 1 names for 2 queries"):
        index.search_envs(q, 3, ["e"])
    with pytest.raises(VectorIndexError, match="not a string"):
        index.search_envs(q, 3, "ee")
    with pytest.raises(VectorIndexError, match="dim must be a positive integer"):
        VectorIndex(0)
    with pytest.raises(ConfigError):
        VectorIndex(DIM, IndexConfig(use_gpu="maybe"))


def test_float64_and_lists_are_converted() -> None:
    rng = np.random.default_rng(3)
    v = random_vectors(rng, 2).astype(np.float64)
    index = VectorIndex(DIM)
    index.add("e", [5, 6], v.tolist())
    index.add("e", np.array([7], dtype=np.uint32), v[:1])
    _, ids = index.search(v[1].reshape(1, -1).tolist(), 1)
    assert ids.tolist() == [[6]]
    scores, ids = index.search(np.empty((0, DIM)), 3)
    assert scores.shape == (0, 3) and ids.shape == (0, 3)


# --------------------------------------------------------------------------- exact search


def test_env_restricted_search_returns_exactly_min_k_count() -> None:
    rng = np.random.default_rng(4)
    index = VectorIndex(DIM)
    small = random_vectors(rng, 3)
    index.add("small", [1, 2, 3], small)
    index.add("big", np.arange(10, 110), random_vectors(rng, 100))
    queries = random_vectors(rng, 8)

    scores, ids = index.search(queries, 4, env="small")
    assert ids.shape == (8, 4)
    assert all(sorted(row[:3]) == [1, 2, 3] for row in ids.tolist())
    assert (ids[:, 3] == PAD_ID).all() and np.isneginf(scores[:, 3]).all()
    assert np.isfinite(scores[:, :3]).all() and (np.diff(scores[:, :3], axis=1) <= 0).all()

    scores, ids = index.search(queries, 4, env="unknown")
    assert (ids == PAD_ID).all() and np.isneginf(scores).all()

    _, ids = index.search(queries, 50, env="big")
    assert ((ids >= 10) & (ids < 110)).all()


def test_global_and_per_env_search_match_brute_force() -> None:
    rng = np.random.default_rng(5)
    index = VectorIndex(DIM)
    data = {}
    for env, n in [("one", 1), ("three", 3), ("fifty", 50), ("many", 700)]:
        ids, vecs = random_ids(rng, n), random_vectors(rng, n)
        index.add(env, ids, vecs)
        data[env] = (ids, vecs)
    all_ids = np.concatenate([i for i, _ in data.values()])
    all_vecs = np.concatenate([v for _, v in data.values()])
    queries = random_vectors(rng, 40)

    scores, ids = index.search(queries, 10)
    want_scores, want_ids = brute_force(queries, all_vecs, all_ids, 10)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(scores, want_scores, rtol=0, atol=1e-5)

    # More than everything: all 754 vectors, then padding.
    _, ids = index.search(queries[:2], 800)
    assert sorted(ids[0, :754].tolist()) == sorted(all_ids.tolist()) and (ids[:, 754:] == PAD_ID).all()

    envs = [list(data)[i % 4] for i in range(len(queries))]
    scores, ids = index.search_envs(queries, 5, envs)
    for i, env in enumerate(envs):
        env_ids, env_vecs = data[env]
        s, d = brute_force(queries[i : i + 1], env_vecs, env_ids, 5)
        real = min(5, len(env_ids))
        np.testing.assert_array_equal(ids[i, :real], d[0])
        np.testing.assert_allclose(scores[i, :real], s[0], atol=1e-5)
        assert (ids[i, real:] == PAD_ID).all()
    _, ids = index.search_envs(queries[:2], 3, ["many", "nowhere"])
    assert (ids[0] >= 0).all() and (ids[1] == PAD_ID).all()


# --------------------------------------------------------------------------- IVF

IVF_DIM = 64


@pytest.fixture(scope="module")
def clustered() -> dict[str, object]:
    """20k embedding-like vectors (mixture of Gaussians on the sphere) and held-out queries."""
    rng = np.random.default_rng(6)
    centers = unit(rng.standard_normal((60, IVF_DIM)))
    vectors = sphere_mixture(rng, centers, 20_000, sigma=0.12)
    queries = sphere_mixture(rng, centers, 400, sigma=0.12)
    ids = random_ids(rng, len(vectors))
    return {"vectors": vectors, "queries": queries, "ids": ids}


@pytest.fixture(scope="module")
def grown(clustered: dict[str, object]) -> tuple[VectorIndex, list[str]]:
    """Grown in batches past exact_max=2000: flat, then IVF, then retrained after 3x growth."""
    ids, vectors = clustered["ids"], clustered["vectors"]
    index = VectorIndex(IVF_DIM, IndexConfig(exact_max=2000, retrain_growth=3.0))
    kinds = []
    for start in range(0, 18_000, 2000):
        index.add("big", ids[start : start + 2000], vectors[start : start + 2000])
        kinds.append(index.stats()["envs"]["big"]["kind"])
    index.add("side", ids[18_000:], vectors[18_000:])
    return index, kinds


def test_switches_to_ivf_past_exact_max_and_retrains(grown: tuple[VectorIndex, list[str]]) -> None:
    index, kinds = grown
    assert kinds == ["flat"] + ["ivf"] * 8
    stats = index.stats()
    assert stats["gpu"] is False
    big, side = stats["envs"]["big"], stats["envs"]["side"]
    assert side["kind"] == "flat" and side["ntotal"] == 2000
    assert big["kind"] == "ivf" and big["ntotal"] == 18_000
    # Trained at 4000 when it switched, retrained at the first batch past 3 * 4000 plus the
    # env's spread (up to half the growth: 16,000), not again before 3x that.
    from lifemem_ray.engine.index.env_index import EnvIndex as _Env
    from lifemem_ray.engine.index.ivf import retrain_at as _retrain_at

    point = _retrain_at("big", _Env(index=None, kind="ivf", trained_size=4000), 3.0)
    assert 12_000 <= point <= 16_000 and big["trained_size"] == 2000 * (int(point) // 2000 + 1)
    assert 1 <= big["nlist"] <= 18_000 // 39
    assert 1 <= big["nprobe"] <= big["nlist"] and big["calibrated_recall"] >= 0.97


def test_retrain_growth_is_configurable(clustered: dict[str, object]) -> None:
    ids, vectors = clustered["ids"][:12_000], clustered["vectors"][:12_000]
    trained = []
    index = VectorIndex(IVF_DIM, IndexConfig(exact_max=2000, retrain_growth=2.0))
    for start in range(0, 12_000, 2000):
        index.add("e", ids[start : start + 2000], vectors[start : start + 2000])
        trained.append(index.stats()["envs"]["e"]["trained_size"])
    # IVF at 4000 (past exact_max), retrained past 2 * 4000 (plus the env's spread, < 1000 here).
    assert trained == [0, 4000, 4000, 4000, 10_000, 10_000]


def test_ids_are_read_back_from_faiss_for_flat_and_ivf(
    grown: tuple[VectorIndex, list[str]], clustered: dict[str, object]
) -> None:
    index, _ = grown
    ids = clustered["ids"]
    held = index.ids()
    assert set(held) == {"big", "side"}
    assert sorted(held["big"].tolist()) == sorted(ids[:18_000].tolist())  # IVF: from its inverted lists
    assert sorted(held["side"].tolist()) == sorted(ids[18_000:].tolist())  # flat: from its id map


def test_ivf_recall_on_held_out_queries(grown: tuple[VectorIndex, list[str]], clustered: dict[str, object]) -> None:
    ivf_index = grown[0]
    ids, vectors, queries = clustered["ids"], clustered["vectors"], clustered["queries"]
    _, got = ivf_index.search(queries, 4, env="big")
    _, truth = brute_force(queries, vectors[:18_000], ids[:18_000], 4)
    assert recall(got, truth) >= 0.95
    _, got = ivf_index.search(queries, 4)
    _, truth = brute_force(queries, vectors, ids, 4)
    assert recall(got, truth) >= 0.95


def test_candidate_search_probes_fewer_lists_and_stays_close(
    grown: tuple[VectorIndex, list[str]], clustered: dict[str, object]
) -> None:
    """The evolution's neighbour search (nprobe_fraction < 1) is approximate, never short."""
    ivf_index = grown[0]
    e = ivf_index._envs["big"]
    assert e.kind == "ivf" and e.nprobe >= 2
    queries = clustered["queries"]
    full_s, full = ivf_index.search_envs(queries, 4, ["big"] * len(queries))
    part_s, part = ivf_index.search_envs(queries, 4, ["big"] * len(queries), nprobe_fraction=0.5)
    few_s, few = ivf_index.search_envs(queries, 4, ["big"] * len(queries), nprobe_fraction=0.01)  # one list
    assert (part >= 0).all() and (few >= 0).all() and part.shape == full.shape
    assert recall(few, full) < recall(part, full) < 1.0  # fewer lists, fewer exact neighbours
    assert (part_s <= full_s + 1e-5).all() and (few_s <= part_s + 1e-5).all()  # never better than probing more
    _capped_s, capped = ivf_index.search_envs(queries, 4, ["big"] * len(queries), max_codes=8)
    assert (capped >= 0).all() and recall(capped, full) < recall(part, full)  # scanning stops early, rows stay full


def test_ivf_restricted_search_never_returns_fewer_than_available(clustered: dict[str, object]) -> None:
    """With nprobe=1 the probed list is far smaller than k: the row is searched again with
    4x the lists until it is full (all lists at the end: exact)."""
    rng = np.random.default_rng(7)
    ids, vectors = clustered["ids"][:6000], clustered["vectors"][:6000]
    index = VectorIndex(IVF_DIM, IndexConfig(exact_max=2000, nprobe=1))
    # A rare region: five vectors in a direction nothing else is near.
    rare_dir = unit(rng.standard_normal((1, IVF_DIM)))
    rare = unit(rare_dir + 0.01 * rng.standard_normal((5, IVF_DIM)))
    index.add("e", ids, vectors)
    index.add("e", np.arange(5), rare)
    index.add("other", np.arange(10, 20), random_vectors(rng, 10, IVF_DIM))
    assert index.stats()["envs"]["e"]["kind"] == "ivf" and index.stats()["envs"]["e"]["nprobe"] == 1

    all_ids, all_vecs = np.concatenate([ids, np.arange(5)]), np.concatenate([vectors, rare])
    queries = np.concatenate([rare_dir, clustered["queries"][:20]])
    k = 1000
    naive = index._envs["e"].index.search(queries, k)[1]  # what nprobe=1 alone would give
    assert ((naive >= 0).sum(axis=1) < k).all()
    scores, got = index.search(queries, k, env="e")
    assert ((got >= 0).sum(axis=1) == k).all()
    want_scores, want = brute_force(queries, all_vecs, all_ids, k)
    assert recall(got, want) > 0.85  # k=1000 from lists calibrated for k=10: approximate, never short
    assert sorted(got[0, :5].tolist()) == [0, 1, 2, 3, 4]
    np.testing.assert_allclose(scores[:, 0], want_scores[:, 0], atol=1e-5)  # the best is always found

    _, everything = index.search(queries[:1], 10_000, env="e")
    assert (everything >= 0).sum() == 6005 and len(set(everything[0, :6005].tolist())) == 6005
    _, global_rows = index.search(queries[:3], 6015)
    assert ((global_rows >= 0).sum(axis=1) == 6015).all()


def test_remove_after_ivf_and_shrink_back_to_flat(clustered: dict[str, object]) -> None:
    ids, vectors = clustered["ids"][:5000], clustered["vectors"][:5000]
    index = VectorIndex(IVF_DIM, IndexConfig(exact_max=1000))
    index.add("e", ids, vectors)
    assert index.stats()["envs"]["e"]["kind"] == "ivf"

    assert index.remove(ids[:1000]) == 1000
    assert index.count("e") == 4000 and not index.contains(ids[0]) and index.contains(ids[1000])
    _, got = index.search(vectors[:1500], 1, env="e")
    assert not np.isin(got, ids[:1000]).any()
    np.testing.assert_array_equal(got[1000:, 0], ids[1000:1500])  # kept vectors still find themselves
    index.add("e", ids[:10], vectors[:10])  # a removed id may come back
    assert index.env_of(ids[0]) == "e"

    assert index.remove(ids[10:4600]) == 3600  # 410 left <= exact_max // 2: exact again
    stats = index.stats()["envs"]["e"]
    assert stats["kind"] == "flat" and stats["ntotal"] == 410
    _, got = index.search(vectors[4600:4610], 1, env="e")
    np.testing.assert_array_equal(got[:, 0], ids[4600:4610])


# --------------------------------------------------------------------------- persistence


def test_save_load_round_trip(tmp_path: Path, clustered: dict[str, object]) -> None:
    ids, vectors, queries = clustered["ids"][:4000], clustered["vectors"][:4000], clustered["queries"][:50]
    index = VectorIndex(IVF_DIM, IndexConfig(exact_max=1500))
    index.add("ivf env", ids[:3000], vectors[:3000])
    index.add("flat/env", ids[3000:], vectors[3000:])
    index.save(tmp_path / "idx", stamp=42)

    loaded = VectorIndex.load(tmp_path / "idx", IVF_DIM, IndexConfig(exact_max=1500))
    assert loaded is not None
    again, stamp = loaded
    assert stamp == 42 and len(again) == 4000 and again.envs() == index.envs()
    assert again.stats()["envs"] == index.stats()["envs"]
    for env in (None, "ivf env", "flat/env"):
        s1, i1 = index.search(queries, 7, env=env)
        s2, i2 = again.search(queries, 7, env=env)
        np.testing.assert_array_equal(i1, i2)
        np.testing.assert_array_equal(s1, s2)
    assert again.env_of(ids[3500]) == "flat/env"

    # The loaded index keeps working: remove (hash-table direct map) and add.
    assert again.remove(ids[:10]) == 10
    with pytest.raises(VectorIndexError, match="already in the index"):
        again.add("ivf env", ids[10:11], vectors[10:11])
    again.add("ivf env", ids[:10], vectors[:10])

    # Saving again replaces the files atomically and cleans up the old ones.
    again.save(tmp_path / "idx", stamp=43)
    files = sorted(p.name for p in (tmp_path / "idx").iterdir())
    assert len(files) == 3 and "manifest.json" in files
    assert VectorIndex.load(tmp_path / "idx", IVF_DIM)[1] == 43  # type: ignore[index]


def test_load_returns_none_on_bad_cache(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    rng = np.random.default_rng(8)
    assert VectorIndex.load(tmp_path / "missing", DIM) is None

    def fresh(name: str) -> Path:
        index = VectorIndex(DIM)
        index.add("a", np.arange(30), random_vectors(rng, 30))
        index.add("b", np.arange(30, 40), random_vectors(rng, 10))
        index.save(tmp_path / name, stamp=1)
        assert VectorIndex.load(tmp_path / name, DIM) is not None
        return tmp_path / name

    d = fresh("garbage")
    (d / "manifest.json").write_text("{not json")
    assert VectorIndex.load(d, DIM) is None
    assert "ignoring unusable saved index" in caplog.text

    d = fresh("dim")
    assert VectorIndex.load(d, DIM * 2) is None

    d = fresh("truncated")
    env_file = next(d.glob("env-*.faiss"))
    env_file.write_bytes(env_file.read_bytes()[:-100])
    assert VectorIndex.load(d, DIM) is None

    d = fresh("missing-file")
    next(d.glob("env-*.faiss")).unlink()
    assert VectorIndex.load(d, DIM) is None

    d = fresh("count")
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["envs"][0]["count"] += 1
    (d / "manifest.json").write_text(json.dumps(manifest))
    assert VectorIndex.load(d, DIM) is None

    d = fresh("no-manifest")
    (d / "manifest.json").unlink()
    assert VectorIndex.load(d, DIM) is None


def test_empty_index_round_trip(tmp_path: Path) -> None:
    VectorIndex(DIM).save(tmp_path, stamp=0)
    loaded = VectorIndex.load(tmp_path, DIM)
    assert loaded is not None and len(loaded[0]) == 0 and loaded[1] == 0
    scores, ids = loaded[0].search(np.ones((2, DIM), np.float32), 3)
    assert (ids == PAD_ID).all() and np.isneginf(scores).all()
    with pytest.raises(VectorIndexError, match="stamp must be an integer"):
        VectorIndex(DIM).save(tmp_path, stamp="7")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- GPU, threads


@pytest.mark.skipif(faiss.get_num_gpus() > 0, reason="a GPU is present")
def test_use_gpu_yes_without_gpu_is_a_clear_error() -> None:
    with pytest.raises(VectorIndexError, match="use_gpu = 'yes' but FAISS sees no GPU"):
        VectorIndex(DIM, IndexConfig(use_gpu="yes"))
    assert VectorIndex(DIM, IndexConfig(use_gpu="auto")).stats()["gpu"] is False
    assert VectorIndex(DIM, IndexConfig(use_gpu="no")).stats()["gpu"] is False


def test_concurrent_adds_and_searches() -> None:
    rng = np.random.default_rng(9)
    index = VectorIndex(DIM, IndexConfig(exact_max=300))
    vectors = random_vectors(rng, 4 * 500)
    queries = random_vectors(rng, 16)
    errors: list[BaseException] = []

    def writer(t: int) -> None:
        try:
            for b in range(10):
                lo = t * 500 + b * 50
                index.add(f"env{t % 2}", np.arange(lo, lo + 50), vectors[lo : lo + 50])
                index.search(queries, 5)
                index.search_envs(queries, 5, ["env0", "env1"] * 8)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert len(index) == 2000 and index.count("env0") == 1000
    _, ids = index.search(vectors[:5], 1)
    np.testing.assert_array_equal(ids[:, 0], np.arange(5))


def test_background_retrain_keeps_serving_and_loses_nothing(clustered: dict[str, object]) -> None:
    """Adds and removes while a bigger IVF trains on a thread all land in the swapped index."""
    ids, vectors = clustered["ids"][:14_000], clustered["vectors"][:14_000]
    index = VectorIndex(IVF_DIM, IndexConfig(exact_max=2000, retrain_growth=2.0, background_retrain=True))
    index.add("e", ids[:4000], vectors[:4000])  # flat -> IVF: synchronous
    assert index.stats()["envs"]["e"]["trained_size"] == 4000
    index.add("e", ids[4000:10_100], vectors[4000:10_100])  # past 2.5x: a retrain starts, the old index takes the adds
    index.add("e", ids[10_100:14_000], vectors[10_100:14_000])  # during (or after) the retrain
    index.remove(ids[:100])
    assert index.count("e") == 13_900
    _, got = index.search(vectors[9000:9010], 1, env="e")
    assert got[:, 0].tolist() == ids[9000:9010].tolist()  # served throughout
    index.wait_retrains()
    st = index.stats()["envs"]["e"]
    assert st["trained_size"] == 10_100 and st["ntotal"] == 13_900
    _, got = index.search(vectors[100:14_000:500], 1, env="e")
    assert got[:, 0].tolist() == ids[100:14_000:500].tolist()
    _, gone = index.search(vectors[:5], 10, env="e")
    assert not set(ids[:5].tolist()) & set(gone.ravel().tolist())


def test_environments_growing_together_retrain_at_different_sizes() -> None:
    from lifemem_ray.engine.index.env_index import EnvIndex as _Env
    from lifemem_ray.engine.index.ivf import retrain_at as _retrain_at

    e = _Env(index=None, kind="ivf", trained_size=10_000)
    points = {
        env: _retrain_at(env, e, 2.0) for env in ("alfworld", "webshop", "sql", "tau2-retail", "bfcl", "scienceworld")
    }
    assert all(20_000 <= p < 25_000 for p in points.values()), points
    assert len({round(p) for p in points.values()}) == len(points), "a fixed, different point per environment"
    assert _retrain_at("sql", e, 2.0) == points["sql"]


def _duplicate_heavy(rng: np.random.Generator, dim: int = 16) -> np.ndarray:
    """Four trajectories repeated 1,500 times each (one huge IVF list apiece) beside 3,000 spread ones."""
    templates = random_vectors(rng, 4, dim)
    return np.vstack([np.repeat(templates, 1500, axis=0), random_vectors(rng, 3000, dim)])


def _scanned_per_query(index: VectorIndex, queries: np.ndarray, env: str) -> float:
    faiss.cvar.indexIVF_stats.reset()
    index.search(queries, 4, env)
    return faiss.cvar.indexIVF_stats.ndis / len(queries)


def test_scan_cap_is_calibrated_and_bounds_the_scan_of_huge_lists() -> None:
    rng = np.random.default_rng(31)
    vectors = _duplicate_heavy(rng)
    ids = random_ids(rng, len(vectors))
    capped = VectorIndex(16, IndexConfig(exact_max=512, search_max_codes=1024))
    uncapped = VectorIndex(16, IndexConfig(exact_max=512, search_max_codes=0))
    for index in (capped, uncapped):
        index.add("e", ids, vectors)
    info = capped.stats()["envs"]["e"]
    # The smallest of 1024/16 ... 1024 that still reaches the target recall.
    assert (
        info["kind"] == "ivf" and info["max_codes"] in (64, 128, 256, 512, 1024) and info["calibrated_recall"] >= 0.97
    )
    assert uncapped.stats()["envs"]["e"]["max_codes"] == 0
    repeats = vectors[::1500][:4]
    # A repeated trajectory's list holds 1,500 equal vectors: scanned whole without the cap.
    assert _scanned_per_query(uncapped, repeats, "e") >= 1500
    assert _scanned_per_query(capped, repeats, "e") <= info["max_codes"]
    # Equal vectors are equally good answers: the capped search finds top scores all the same.
    got, _ = capped.search(repeats, 4, "e")
    assert np.allclose(got, 1.0, atol=1e-5)
    spread = vectors[6000:6200]
    truth, _ = brute_force(spread, vectors, ids, 4)
    got, _ = capped.search(spread, 4, "e")
    assert (got >= truth[:, -1:] - 1e-5).mean() >= 0.9


def test_scan_cap_is_dropped_where_it_would_cost_recall() -> None:
    rng = np.random.default_rng(32)
    # Tight clusters of distinct (not equal) vectors: a few huge lists whose exact
    # neighbours a 32-vector scan of a list would mostly miss.
    vectors = sphere_mixture(rng, random_vectors(rng, 3, 16), 6000, 0.02)
    ids = random_ids(rng, len(vectors))
    index = VectorIndex(16, IndexConfig(exact_max=512, search_max_codes=32))
    index.add("e", ids, vectors)
    info = index.stats()["envs"]["e"]
    assert info["max_codes"] == 0 and info["calibrated_recall"] >= 0.97
    truth, _ = brute_force(vectors[:200], vectors, ids, 4)
    got, _ = index.search(vectors[:200], 4, "e")
    assert (got >= truth[:, -1:] - 1e-5).mean() >= 0.95


def test_a_saved_index_is_recalibrated_for_another_scan_cap(tmp_path: Path) -> None:
    rng = np.random.default_rng(33)
    vectors = _duplicate_heavy(rng)
    ids = random_ids(rng, len(vectors))
    index = VectorIndex(16, IndexConfig(exact_max=512, search_max_codes=1024))
    index.add("e", ids, vectors)
    index.save(tmp_path, stamp=7)
    assert json.loads((tmp_path / "manifest.json").read_text())["calibration"]["search_max_codes"] == 1024
    same, stamp = VectorIndex.load(tmp_path, 16, IndexConfig(exact_max=512, search_max_codes=1024))
    assert stamp == 7 and same.stats()["envs"]["e"] == index.stats()["envs"]["e"]
    other, _ = VectorIndex.load(tmp_path, 16, IndexConfig(exact_max=512, search_max_codes=0))
    info = other.stats()["envs"]["e"]
    assert info["max_codes"] == 0 and info["calibrated_recall"] >= 0.97
    assert _scanned_per_query(other, vectors[::1500][:4], "e") >= 1500


def test_background_retrain_runs_niced_and_is_adopted_by_the_next_search(
    clustered: dict[str, object], monkeypatch
) -> None:
    """The build thread runs at index.retrain_nice; it never takes the index lock to swap its
    result in: the next search (here, no add follows) adopts it with the adds since."""
    import os
    import sys
    import threading

    ids, vectors = clustered["ids"][:10_600], clustered["vectors"][:10_600]
    index = VectorIndex(
        IVF_DIM, IndexConfig(exact_max=2000, retrain_growth=2.0, background_retrain=True, retrain_nice=7)
    )
    index.add("e", ids[:4000], vectors[:4000])
    seen: dict[str, object] = {}
    gate = threading.Event()
    real_build = index._build

    def build(*args):
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        seen["main_nice"] = os.getpriority(os.PRIO_PROCESS, threading.main_thread().native_id)
        gate.wait(30)
        return real_build(*args)

    monkeypatch.setattr(index, "_build", build)
    index.add("e", ids[4000:10_100], vectors[4000:10_100])  # past 2.5x: the retrain starts and waits at the gate
    index.add("e", ids[10_100:], vectors[10_100:])  # taken by the old index meanwhile
    thread = index._retraining["e"][0]
    gate.set()
    thread.join(30)
    assert not thread.is_alive() and "e" in index._ready  # built, not yet swapped in
    assert index.stats()["envs"]["e"]["trained_size"] == 4000
    _, got = index.search(vectors[9600::50], 1, env="e")  # adopts it first
    assert got[:, 0].tolist() == ids[9600::50].tolist()
    assert not index._ready and index.stats()["envs"]["e"]["trained_size"] == 10_100 and index.count("e") == 10_600
    if sys.platform.startswith("linux"):
        assert seen["nice"] == max(7, seen["main_nice"])
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == seen["main_nice"]  # only that thread


def test_faiss_thread_count_holds_in_threads_started_later(monkeypatch) -> None:
    """OpenMP keeps the count per thread: a Ray call thread or a retrain thread that searches
    must use set_faiss_threads' count, not every core."""
    import threading

    import lifemem_ray.engine.index.env_index as index_module

    monkeypatch.setattr(index_module, "_faiss_threads", None)
    before = faiss.omp_get_max_threads()
    index_module.set_faiss_threads(1)
    try:
        rng = np.random.default_rng(5)
        index = VectorIndex(8, IndexConfig())
        index.add("e", np.arange(50), random_vectors(rng, 50, 8))
        seen: dict[str, int] = {}

        def call() -> None:
            seen["fresh"] = faiss.omp_get_max_threads()
            index.search(random_vectors(rng, 3, 8), 2, env="e")
            seen["after"] = faiss.omp_get_max_threads()

        thread = threading.Thread(target=call)
        thread.start()
        thread.join()
        assert seen["after"] == 1
        if faiss.omp_get_max_threads() != seen["fresh"]:  # single-core machines start at 1 anyway
            assert seen["fresh"] > 1
    finally:
        faiss.omp_set_num_threads(before)
        index_module._thread_state.threads = None


def test_calibrated_recall_is_the_recall_a_brute_force_count_gives() -> None:
    """The recall calibration reports (exact neighbours from faiss.knn) equals a count made
    independently with numpy on the same sample queries, at the nprobe and cap it chose."""
    from lifemem_ray.engine.index.ivf import CAL_QUERIES as _CAL_QUERIES
    from lifemem_ray.engine.index.ivf import calibrate as _calibrate

    rng = np.random.default_rng(47)
    vectors = sphere_mixture(rng, random_vectors(rng, 40), 6000, 0.25)
    ids = random_ids(rng, len(vectors))
    index = VectorIndex(DIM, IndexConfig(exact_max=512))
    index.add("e", ids, vectors)
    ivf = index._envs["e"].index
    nprobe, got_recall, cap = _calibrate(ivf, ids, vectors, ivf.nlist, 0.97, np.random.default_rng(5), (256, 0), 4)
    sample = np.sort(np.random.default_rng(5).choice(len(ids), min(_CAL_QUERIES, len(ids)), replace=False))
    queries = vectors[sample]
    exact, _ = brute_force(queries, vectors, ids, 5)
    threshold = exact[:, 4] - 1e-5  # the 4th best after the query itself
    scores, found = ivf.search(queries, 5, params=faiss.SearchParametersIVF(nprobe=nprobe, max_codes=cap))
    hits = []
    for row, own in enumerate(ids[sample]):
        others = [s for s, i in zip(scores[row], found[row], strict=True) if i != own and i >= 0][:4]
        hits.append(sum(s >= threshold[row] for s in others) / 4)
    assert got_recall >= 0.97 and got_recall == pytest.approx(float(np.mean(hits)), abs=1e-9)


def _small_index(n: int = 50, dim: int = 16) -> tuple[VectorIndex, np.ndarray]:
    rng = np.random.default_rng(3)
    vecs = rng.standard_normal((n, dim)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    index = VectorIndex(dim, IndexConfig())
    index.add("e", np.arange(n, dtype=np.int64), vecs)
    return index, vecs


def test_a_cache_written_for_another_store_is_not_loaded(tmp_path):
    index, _ = _small_index()
    index.save(tmp_path / "idx", stamp=7, identity="store-a:digest-1")
    assert VectorIndex.load(tmp_path / "idx", 16, IndexConfig(), identity="store-a:digest-1") is not None
    assert VectorIndex.load(tmp_path / "idx", 16, IndexConfig(), identity="store-b:digest-1") is None
    assert VectorIndex.load(tmp_path / "idx", 16, IndexConfig(), identity="store-a:digest-2") is None


def test_a_full_disk_leaves_no_partial_files_and_says_so(tmp_path, monkeypatch):
    import errno

    import lifemem_ray.engine.index.env_index as index_module
    from lifemem_ray.core.errors import IndexSaveError

    index, _ = _small_index()
    index.save(tmp_path / "idx", stamp=1)
    before = sorted(p.name for p in (tmp_path / "idx").iterdir())
    real = faiss.write_index

    def full(ix, path):
        Path(path).write_bytes(b"")  # the file was created, then the disk filled up
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(index_module.faiss, "write_index", full)
    with pytest.raises(IndexSaveError, match="no space left on the device"):
        index.save(tmp_path / "idx", stamp=2)
    monkeypatch.setattr(index_module.faiss, "write_index", real)
    assert sorted(p.name for p in (tmp_path / "idx").iterdir()) == before  # the previous cache is whole
    loaded = VectorIndex.load(tmp_path / "idx", 16, IndexConfig())
    assert loaded is not None and loaded[1] == 1
