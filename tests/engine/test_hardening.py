"""Issue 15's attacks on a store folder and on retrieval arguments, each reproduced: a damaged
data file, unbounded k, a swapped or edited store under a cached index, a stale read-only
reader, a full disk. Each is refused with a message naming what is wrong and where."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import lmdb
import numpy as np
import pytest

from lifemem_ray.core.errors import IndexSaveError, StoreError
from lifemem_ray.core.importers import write_jsonl
from lifemem_ray.engine.memory import Memory
from lifemem_ray.engine.retrieval import MAX_QUERIES, MAX_TASK_CHARS
from lifemem_ray.engine.store import codec
from lifemem_ray.lab.synthetic import generate, label_vectors

SCRIPT = shutil.which("lifemem-ray") or str(Path(sys.executable).parent / "lifemem-ray")
N = 60


def _data(n: int = N, seed: int = 1):
    trajs = list(generate(n, seed=seed, length_scale=0.1))
    vecs = label_vectors([t.metadata["workflow"] for t in trajs], list(range(n)), seed=seed)
    return trajs, vecs


def _store(path: Path, seed: int = 1, n: int = N) -> tuple[list, np.ndarray]:
    trajs, vecs = _data(n, seed)
    with Memory.open(path) as m:
        m.add_many(trajs, vecs)
    return trajs, vecs


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([SCRIPT, *args], capture_output=True, text=True, timeout=300)


# -- 1. a truncated or empty data.mdb ----------------------------------------------------------
@pytest.fixture(scope="module")
def whole_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("whole")
    _store(root / "s")
    return root / "s"


def _damaged(whole: Path, tmp_path: Path, fraction: float) -> Path:
    target = tmp_path / f"cut{fraction}"
    shutil.copytree(whole, target)
    data = target / "data.mdb"
    os.truncate(data, int(data.stat().st_size * fraction))
    return target


@pytest.mark.parametrize("fraction", [0.9, 0.5, 0.1, 0.001, 0.0])
def test_truncated_store_is_refused_on_open(whole_store, tmp_path, fraction):
    path = _damaged(whole_store, tmp_path, fraction)
    for read_only in (False, True):
        with pytest.raises(StoreError) as info:
            Memory.open(path, read_only=read_only)
        message = str(info.value)
        assert str(path / "data.mdb") in message
        assert ("truncated" in message) or ("empty" in message) or ("not an LMDB" in message)
        assert "snapshot" in message and "backup" in message
    assert (path / "data.mdb").stat().st_size == int((whole_store / "data.mdb").stat().st_size * fraction)  # untouched


def test_truncated_store_cli_commands_exit_1_with_the_reason(whole_store, tmp_path):
    data = tmp_path / "more.jsonl"
    write_jsonl(generate(3, seed=9, length_scale=0.1), data)
    for fraction, command in [
        (0.5, ["stats"]),
        (0.1, ["check"]),
        (0.5, ["retrieve", "buy shoes", "--env", "shop"]),
        (0.0, ["ingest", str(data)]),
        (0.0, ["stats"]),
        (0.5, ["ingest", str(data)]),
    ]:
        path = _damaged(whole_store, tmp_path / f"{command[0]}{fraction}", fraction)
        proc = cli(*command, "--store", str(path))
        assert proc.returncode == 1, (command, fraction, proc.returncode, proc.stderr)
        assert "Traceback" not in proc.stderr
        assert str(path / "data.mdb") in proc.stderr and "snapshot" in proc.stderr, proc.stderr
        assert "needs the vector dimensions" not in proc.stderr  # an empty data.mdb is not a new store
        assert (path / "data.mdb").stat().st_size == int((whole_store / "data.mdb").stat().st_size * fraction)


# -- 2. bounded retrieve arguments ---------------------------------------------------------------
K_MESSAGE = "k: expected an integer within [1, 1024] (retrieval.k's bounds)"


def test_engine_retrieve_bounds(tmp_path):
    trajs, vecs = _store(tmp_path / "s")
    with Memory.open(tmp_path / "s", read_only=True) as m:
        assert len(m.retrieve(trajs[0].task, trajs[0].env, 1024, vector=vecs[0]).trajectories) == sum(
            t.env == trajs[0].env for t in trajs
        )
        assert len(m.retrieve(trajs[0].task, trajs[0].env, 1, vector=vecs[0]).trajectories) == 1
        for k in (0, 1025, 10**9, -1, True, 2.0):
            with pytest.raises(ValueError, match=r"k: expected an integer within \[1, 1024\]"):
                m.retrieve(trajs[0].task, trajs[0].env, k, vector=vecs[0])
        with pytest.raises(ValueError, match=r"tasks\[0\]: .* characters, at most"):
            m.retrieve("x" * (MAX_TASK_CHARS + 1), "shop", 1, vector=vecs[0])
        m.retrieve("x" * MAX_TASK_CHARS, "shop", 1, vector=vecs[0])
        many = MAX_QUERIES + 1
        with pytest.raises(ValueError, match="queries in one call, at most"):
            m.retrieve_many(["t"] * many, "shop", 1, vectors=np.repeat(vecs[:1], many, axis=0))
        with pytest.raises(ValueError, match="k: expected an integer"):
            m._search.search_hits(vecs[:1], ["shop"], 10**9)  # the shard's half of a sharded retrieval


def test_cli_retrieve_k_bounds(whole_store):
    for k in ("0", "1025", str(10**9)):
        proc = cli("retrieve", "buy shoes", "--store", str(whole_store), "--env", "shop", "-k", k)
        # Refused as a usage error (exit 2, the command's usage), before the store is opened.
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert f"lifemem-ray retrieve: error: argument -k: must be within [1, 1024], got {k}" in proc.stderr


# -- 3. the index cache belongs to one store and one content ------------------------------------
def _set_meta(path: Path, **values) -> None:
    env = lmdb.open(str(path), max_dbs=16, lock=False)
    meta = env.open_db(b"meta")
    with env.begin(write=True) as txn:
        for key, value in values.items():
            txn.put(key.encode(), codec.pack(value), db=meta)
    env.close()


def _meta(path: Path, key: str):
    env = lmdb.open(str(path), max_dbs=16, readonly=True, lock=False)
    meta = env.open_db(b"meta", create=False)
    with env.begin() as txn:
        raw = txn.get(key.encode(), db=meta)
    env.close()
    return codec.unpack(raw)


@pytest.mark.parametrize("same_id", [False, True])
def test_swapped_data_file_does_not_reuse_the_cache(tmp_path, same_id):
    a_trajs, _a_vecs = _store(tmp_path / "a", seed=1)
    b_trajs, b_vecs = _store(tmp_path / "b", seed=2)
    assert (tmp_path / "a" / "index" / "manifest.json").exists()
    # B's file with A's generation (and count), under A's cached index; with same_id also A's store id
    # (a copied folder that diverged): only the digest of the contents tells them apart.
    values = {"generation": _meta(tmp_path / "a", "generation")}
    if same_id:
        values["store_id"] = _meta(tmp_path / "a", "store_id")
    _set_meta(tmp_path / "b", **values)
    shutil.copy(tmp_path / "b" / "data.mdb", tmp_path / "a" / "data.mdb")
    with Memory.open(tmp_path / "a", read_only=True) as m:
        assert len(m) == len(a_trajs)
        for i in (0, 7, 33):
            got = m.retrieve(b_trajs[i].task, b_trajs[i].env, 1, vector=b_vecs[i])
            assert got.trajectories[0].id == b_trajs[i].id and got.trajectories[0].score == pytest.approx(1.0, abs=1e-3)
        assert m.verify()["ok"]
    proc = cli("check", "--store", str(tmp_path / "a"))
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stdout + proc.stderr


def test_cache_is_reused_when_it_matches(tmp_path, monkeypatch):
    _store(tmp_path / "a")
    from lifemem_ray.engine import state

    def no_rebuild(self, txn):
        raise AssertionError("the index was rebuilt although its cache matches")

    monkeypatch.setattr(state.EngineState, "_build_index", no_rebuild)
    with Memory.open(tmp_path / "a", read_only=True) as m:
        assert len(m.index) == N
    with Memory.open(tmp_path / "a") as m:
        assert len(m.index) == N


def test_store_id_created_once_and_given_to_old_stores(tmp_path):
    _store(tmp_path / "a")
    first = _meta(tmp_path / "a", "store_id")
    assert len(first) == 32
    with Memory.open(tmp_path / "a"):
        pass
    assert _meta(tmp_path / "a", "store_id") == first
    env = lmdb.open(str(tmp_path / "a"), max_dbs=16, lock=False)  # an older store: no id
    meta = env.open_db(b"meta")
    with env.begin(write=True) as txn:
        txn.delete(b"store_id", db=meta)
    env.close()
    with Memory.open(tmp_path / "a", read_only=True) as m:
        assert m.store.store_id == "" and m.verify()["ok"]
    with Memory.open(tmp_path / "a") as m:
        assert len(m.store.store_id) == 32 and m.verify()["ok"]


def test_check_deep_finds_a_record_edited_behind_the_engine(tmp_path):
    trajs, _ = _store(tmp_path / "s")
    env = lmdb.open(str(tmp_path / "s"), max_dbs=16, lock=False)
    traj_db, tid_db = env.open_db(b"traj"), env.open_db(b"tid")
    with env.begin(write=True) as txn:
        key = txn.get(trajs[5].id.encode(), db=tid_db)
        record = codec.unpack(txn.get(key, db=traj_db))
        record["task"] = record["task"] + " (edited)"
        txn.put(key, codec.pack(record), db=traj_db)
    env.close()
    with Memory.open(tmp_path / "s", read_only=True) as m:
        assert m.verify()["ok"]  # the plain check looks at structure, not content
        report = m.verify(deep=True)
    assert not report["ok"] and len(report["problems"]) == 1
    assert trajs[5].id in report["problems"][0] and "fingerprint" in report["problems"][0]
    assert cli("check", "--store", str(tmp_path / "s")).returncode == 0
    proc = cli("check", "--deep", "--store", str(tmp_path / "s"))
    assert proc.returncode == 1 and trajs[5].id in proc.stdout and "fingerprint" in proc.stdout, (
        proc.stdout + proc.stderr
    )


# -- 4. a long-lived read-only reader follows the writer -----------------------------------------
WRITER = """
import sys
from lifemem_ray.engine.memory import Memory
from lifemem_ray.lab.synthetic import generate, label_vectors
trajs = list(generate({n}, seed=1, length_scale=0.1))
vecs = label_vectors([t.metadata["workflow"] for t in trajs], list(range({n})), seed=1)
with Memory.open(sys.argv[1]) as w:
    w.add_many(trajs[{start}:], vecs[{start}:])
"""


def test_read_only_reader_reloads_when_the_store_moves_on(tmp_path):
    trajs, vecs = _data(100)
    with Memory.open(tmp_path / "s") as w:
        w.add_many(trajs[:10], vecs[:10])
    reader = Memory.open(tmp_path / "s", read_only=True)
    try:
        assert len(reader.index) == 10
        subprocess.run(
            [sys.executable, "-c", textwrap.dedent(WRITER.format(n=100, start=10)), str(tmp_path / "s")],
            check=True,
            timeout=300,
        )
        stats = reader.stats()
        assert stats["trajectories"] == 100 and len(reader.index) == 100
        assert sum(c.count for c in reader.clusters()) + stats["pending"] == 100
        for i in (50, 99):
            assert reader.retrieve(trajs[i].task, trajs[i].env, 1, vector=vecs[i]).trajectories[0].id == trajs[i].id
        assert reader.verify()["ok"]
    finally:
        reader.close()


def test_read_only_reader_search_hits_follow_the_writer(tmp_path):
    trajs, vecs = _data(40)
    with Memory.open(tmp_path / "s") as w:
        w.add_many(trajs[:5], vecs[:5])
    with Memory.open(tmp_path / "s", read_only=True) as reader:
        subprocess.run(
            [sys.executable, "-c", textwrap.dedent(WRITER.format(n=40, start=5)), str(tmp_path / "s")],
            check=True,
            timeout=300,
        )
        assert reader.verify()["ok"]  # verify first: it reloads too, no false problem
        assert len(reader.index) == 40


# -- 5. a full disk --------------------------------------------------------------------------------
def test_full_disk_on_commit_is_a_store_error(tmp_path, monkeypatch):
    trajs, vecs = _data(20)
    with Memory.open(tmp_path / "s") as m:
        m.add_many(trajs[:10], vecs[:10])
        real_begin = m.store.env.begin

        class FailingTxn:
            def __init__(self, txn):
                self.txn = txn

            def __enter__(self):
                return self.txn.__enter__()

            def __exit__(self, *exc):
                if exc[0] is None:
                    self.txn.abort()
                    raise lmdb.Error("mdb_txn_commit", os.strerror(errno.EIO))
                return self.txn.__exit__(*exc)

        def begin(*args, write=False, **kwargs):
            txn = real_begin(*args, write=write, **kwargs)
            return FailingTxn(txn) if write else txn

        m.store.env = _EnvProxy(m.store.env, begin)
        with pytest.raises(StoreError) as info:
            m.add_many(trajs[10:], vecs[10:])
        m.store.env = m.store.env.inner
        message = str(info.value)
        assert "no space left on the device (or a write error)" in message and str(tmp_path / "s") in message
        assert "nothing of this batch was stored" in message
        assert len(m) == 10 and m.get(trajs[15].id) is None


class _EnvProxy:
    def __init__(self, inner, begin):
        self.inner, self.begin = inner, begin

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_index_cache_save_failure_is_a_warning(tmp_path, monkeypatch, caplog):
    trajs, vecs = _data(20)
    from lifemem_ray.engine.index.vector_index import VectorIndex

    def full(self, directory, stamp, identity=""):
        raise IndexSaveError(
            f"{directory}: could not save the index cache: No space left on device; the store is intact"
        )

    monkeypatch.setattr(VectorIndex, "save", full)
    m = Memory.open(tmp_path / "s")
    m.add_many(trajs, vecs)
    with caplog.at_level(logging.WARNING):
        m.close()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "index cache" in r.getMessage()]
    assert warnings and warnings[0].exc_info is None and "No space left" in warnings[0].getMessage()
    monkeypatch.undo()
    with Memory.open(tmp_path / "s", read_only=True) as m:
        assert len(m.index) == 20 and m.verify()["ok"]
