"""A store whose committed transactions also go to shared storage (a folder, or S3 through
moto's server on loopback) is rebuilt elsewhere with exactly its tables: nothing acknowledged
missing, nothing doubled, the same retrieval answers."""

from __future__ import annotations

import shutil
from pathlib import Path

import lmdb
import numpy as np
import pytest
from support.s3_server import S3_ENV, s3_server
from test_memory import rand_vecs, traj

from lifemem_ray.core.errors import StoreError
from lifemem_ray.core.model import Outcome, Step, Trajectory
from lifemem_ray.engine.memory import Memory
from lifemem_ray.engine.memory_config import MemoryConfig
from lifemem_ray.engine.store.log_errors import LogDamagedError
from lifemem_ray.engine.store.redo import RecordingTxn
from lifemem_ray.engine.store.shared_log import (
    Entry,
    LogForkedError,
    SharedLog,
    SharedLogError,
    Writer,
    decode_entry,
    encode_entry,
)

ACTIONS = [
    ("search[x]", "click[B1]", "click[Buy Now]"),
    ("go to desk", "take mug", "put mug in sink"),
    ("open drawer", "take key", "close drawer"),
]


def durable(uri: str, endpoint: str = "", **extra: object) -> MemoryConfig:
    return MemoryConfig().replace(
        {
            "store.shared_log_uri": uri,
            "store.shared_log_endpoint_url": endpoint,
            "evolution.split_min_size": 12,
            **extra,
        }
    )


FENCE_KEYS = (b"writer", b"redo_seq")  # each opening for writing appends its own fence entry


def tables(path: Path) -> dict[str, dict[bytes, bytes]]:
    """Every key and value of every table of the store at ``path`` (generation included), but
    the fence keys: each opening for writing takes the log over with a fence entry of its own."""
    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=32)
    try:
        out: dict[str, dict[bytes, bytes]] = {}
        with env.begin() as txn:
            names = [k for k, _ in txn.cursor()]
            for name in names:
                db = env.open_db(name, txn=txn, create=False)
                out[name.decode()] = {k: v for k, v in txn.cursor(db=db) if name != b"meta" or k not in FENCE_KEYS}
        return out
    finally:
        env.close()


def fill(memory: Memory, start: int, n: int, seed: int) -> list[str]:
    trajs = [traj(i, env=("shop", "home")[i % 2], actions=ACTIONS[i % 3]) for i in range(start, start + n)]
    memory.add_many(trajs, rand_vecs(n, seed=seed))
    return [t.id for t in trajs]


def answers(memory: Memory, queries: np.ndarray) -> list[list[str]]:
    return [
        [t.id for t in memory.retrieve("q", env, vector=q).trajectories] for q in queries for env in ("shop", "home")
    ]


def test_a_store_rebuilt_from_its_log_has_exactly_its_tables(tmp_path):
    config = durable(str(tmp_path / "shared"))
    queries = rand_vecs(6, seed=99)
    with Memory.open(tmp_path / "a", config) as memory:
        ids = fill(memory, 0, 60, seed=1)
        fill(memory, 60, 40, seed=2)
        memory.maintain()  # splits and skills: background changes are logged like ingest
        assert memory.remove(ids[:5]) == 5
        before = answers(memory, queries)
        count = memory.stats()["trajectories"]
    with Memory.open(tmp_path / "b", config) as rebuilt:  # no local copy: the log alone
        assert rebuilt.stats()["trajectories"] == count == 95
        assert answers(rebuilt, queries) == before
        assert rebuilt.verify(deep=True)["ok"]
    assert tables(tmp_path / "b") == tables(tmp_path / "a")


def test_checkpoint_prunes_the_log_and_rebuild_starts_from_it(tmp_path):
    config = durable(str(tmp_path / "shared"))
    with Memory.open(tmp_path / "a", config) as memory:
        fill(memory, 0, 30, seed=1)
        done = memory.parts.state.store.checkpoint(keep=2)
        assert not done["skipped"] and done["pruned"]["entries_removed"] == done["seq"]
        assert memory.parts.state.store.checkpoint(keep=2)["skipped"]  # nothing new since
        fill(memory, 30, 30, seed=2)
        memory.parts.state.store.checkpoint(keep=2)
        fill(memory, 60, 10, seed=3)
        status = memory.parts.state.store.shared_log_status()
    log = SharedLog(str(tmp_path / "shared"))
    assert [c.seq for c in log.checkpoints()] == sorted(c.seq for c in log.checkpoints()) and len(
        log.checkpoints()
    ) == 2
    # The entries after the *older* kept checkpoint stay: a damaged newest one falls back to it.
    assert log.sequence_numbers()[0] == log.checkpoints()[0].seq + 1 and status["head"] == status["local_seq"]
    with Memory.open(tmp_path / "b", config) as rebuilt:
        assert rebuilt.stats()["trajectories"] == 70
    assert tables(tmp_path / "b") == tables(tmp_path / "a")


def test_a_local_copy_behind_the_log_catches_up_or_is_replaced(tmp_path):
    config = durable(str(tmp_path / "shared"))
    with Memory.open(tmp_path / "a", config) as memory:
        fill(memory, 0, 20, seed=1)
    shutil.copytree(tmp_path / "a", tmp_path / "stale")  # a node that comes back with an old disk
    with Memory.open(tmp_path / "a", config) as memory:
        fill(memory, 20, 20, seed=2)
    with Memory.open(tmp_path / "stale", config) as back:  # replays what it lacks
        assert back.stats()["trajectories"] == 40
    assert tables(tmp_path / "stale") == tables(tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "older")
    with Memory.open(tmp_path / "a", config) as memory:
        fill(memory, 40, 20, seed=3)
        memory.parts.state.store.checkpoint(keep=1)  # the log no longer reaches back to "older"
        fill(memory, 60, 5, seed=4)
    with Memory.open(tmp_path / "older", config) as back:
        assert back.stats()["trajectories"] == 65
    assert list((tmp_path / "older").glob("data.mdb.behind-*")), "the old copy is kept aside"
    assert tables(tmp_path / "older") == tables(tmp_path / "a")


def test_nothing_is_stored_when_the_log_cannot_be_written(tmp_path, monkeypatch):
    config = durable(str(tmp_path / "shared"))
    with Memory.open(tmp_path / "a", config) as memory:
        fill(memory, 0, 10, seed=1)

        def unreachable(self, seq, ops, writer):
            raise SharedLogError("shared log: storage unreachable (test)")

        monkeypatch.setattr(SharedLog, "append", unreachable)
        with pytest.raises(StoreError, match="unreachable"):
            fill(memory, 10, 5, seed=2)
        assert memory.stats()["trajectories"] == 10 and memory.get("shop-10") is None
        monkeypatch.undo()
        fill(memory, 10, 5, seed=2)  # storage back: the same add goes through
        assert memory.stats()["trajectories"] == 15
    with Memory.open(tmp_path / "b", config) as rebuilt:
        assert rebuilt.stats()["trajectories"] == 15


def test_an_entry_appended_whose_local_commit_failed_is_replayed_before_the_next_write(tmp_path, monkeypatch):
    config = durable(str(tmp_path / "shared"))
    with Memory.open(tmp_path / "a", config) as memory:
        fill(memory, 0, 10, seed=1)
        store = memory.parts.state.store
        real_begin = store.env.begin

        class FailingCommit:  # the entry reaches the log, then the local commit fails
            def __init__(self, **kw):
                self.txn = real_begin(**kw)

            def __enter__(self):
                return self.txn

            def __exit__(self, *exc):
                self.txn.abort()
                raise lmdb.DiskError("commit failed (test)")

        class Environment:  # the store's environment, its write transactions failing at commit
            def __init__(self, env):
                self.env = env

            def begin(self, **kw):
                return FailingCommit(**kw) if kw.get("write") else real_begin(**kw)

            def __getattr__(self, name):
                return getattr(self.env, name)

        monkeypatch.setattr(store, "env", Environment(store.env))
        with pytest.raises((lmdb.Error, StoreError)):
            store.write(lambda txn: store.put_meta(txn, "probe", 1))
        monkeypatch.undo()
        assert store.get_meta("probe") is None  # not committed here, but in the log
        store.write(lambda txn: store.put_meta(txn, "probe2", 2))  # catches up first
        assert store.get_meta("probe") == 1 and store.get_meta("probe2") == 2
    with Memory.open(tmp_path / "b", config):
        pass
    assert tables(tmp_path / "b") == tables(tmp_path / "a")


def test_two_writers_of_one_log_are_refused(tmp_path):
    config = durable(str(tmp_path / "shared"))
    with Memory.open(tmp_path / "a", config) as memory:
        fill(memory, 0, 10, seed=1)
    shutil.copytree(tmp_path / "a", tmp_path / "twin")
    with Memory.open(tmp_path / "a", config) as first, Memory.open(tmp_path / "twin", config) as twin:
        fill(twin, 10, 5, seed=2)  # the twin took the shard over
        with pytest.raises(LogForkedError, match="took this store over"):
            fill(first, 20, 5, seed=3)
    with Memory.open(tmp_path / "lone", MemoryConfig(), dim=8):
        pass  # a store of its own, then pointed at the same log
    lone_tables = tables(tmp_path / "lone")
    with pytest.raises(LogForkedError, match="belongs to store"):
        Memory.open(tmp_path / "lone", config)
    assert tables(tmp_path / "lone") == lone_tables  # refused, nothing changed


def test_durability_turned_on_for_an_existing_store_checkpoints_it_first(tmp_path):
    with Memory.open(tmp_path / "a", MemoryConfig().replace({"evolution.split_min_size": 12})) as memory:
        fill(memory, 0, 25, seed=1)
    config = durable(str(tmp_path / "shared"))
    with Memory.open(tmp_path / "a", config) as memory:
        assert [c.seq for c in SharedLog(str(tmp_path / "shared")).checkpoints()] == [0]
        fill(memory, 25, 5, seed=2)
    with Memory.open(tmp_path / "b", config) as rebuilt:
        assert rebuilt.stats()["trajectories"] == 30
    assert tables(tmp_path / "b") == tables(tmp_path / "a")


def test_entries_are_framed_and_checked(tmp_path):
    writer = Writer("deployment-a", 3)
    data = encode_entry(7, [("traj", b"\x00\x01", b"value"), ("tid", b"id", None)], writer)
    assert decode_entry(data, "here", 7) == Entry(7, [("traj", b"\x00\x01", b"value"), ("tid", b"id", None)], writer)
    with pytest.raises(LogDamagedError, match="entry 7 is damaged") as damaged:
        decode_entry(data[:-1] + b"X", "here", 7)
    assert (damaged.value.uri, damaged.value.seq) == ("here", 7)
    with pytest.raises(LogDamagedError, match="holds entry 7"):
        decode_entry(data, "here", 8)
    log = SharedLog(str(tmp_path))
    log.append(1, [("meta", b"a", b"1")], writer)
    log.append(2, [("meta", b"b", b"2")], writer)
    (tmp_path / "log" / f"{3:020d}.txn").write_bytes(data[:10])  # damaged: it stays, and is named
    assert log.damaged(0, 3) == {3: "checksum mismatch"} and log.head() == 3
    with pytest.raises(LogDamagedError, match="entry 3"):
        list(log.entries(after=0))
    (tmp_path / "log" / f"{2:020d}.txn").unlink()
    log.append(4, [("meta", b"c", b"3")], writer)
    with pytest.raises(SharedLogError, match="entry 2 is missing"):
        list(log.entries(after=0))
    log.append(4, [("meta", b"c", b"3")], writer)  # the same entry again: an append retried after a lost answer
    with pytest.raises(LogForkedError, match="another writer"):
        log.append(4, [], writer)
    with pytest.raises(LogForkedError, match="took this store over"):
        log.append(4, [], Writer("deployment-a", 2))


def test_a_logged_transaction_refuses_writes_replay_could_not_repeat(tmp_path):
    env = lmdb.open(str(tmp_path), max_dbs=2)
    db = env.open_db(b"t")
    with env.begin(write=True) as raw:
        txn = RecordingTxn(raw, {id(db): "t"})
        txn.put(b"k", b"v", db=db)
        for call in (lambda: txn.put(b"k", b"v", db=db, overwrite=False), lambda: txn.replace(b"k", b"w", db=db)):
            with pytest.raises(StoreError):
                call()
        assert txn.ops == [("t", b"k", b"v")]
    env.close()


def test_rebuild_through_an_s3_compatible_server(tmp_path, monkeypatch):
    for key, value in S3_ENV.items():
        monkeypatch.setenv(key, value)
    with s3_server() as s3:
        config = durable(s3.uri("lifemem", "shard-00"), s3.endpoint_url)
        queries = rand_vecs(4, seed=7)
        with Memory.open(tmp_path / "a", config) as memory:
            fill(memory, 0, 30, seed=1)
            memory.parts.state.store.checkpoint(keep=1)
            fill(memory, 30, 20, seed=2)
            memory.remove(["shop-2"])
            before = answers(memory, queries)
        with Memory.open(tmp_path / "b", config) as rebuilt:
            assert rebuilt.stats()["trajectories"] == 49
            assert answers(rebuilt, queries) == before
        assert tables(tmp_path / "b") == tables(tmp_path / "a")
        log = SharedLog(s3.uri("lifemem", "shard-00"), endpoint_url=s3.endpoint_url)
        with pytest.raises(LogForkedError):  # exclusive create on S3 too (If-None-Match)
            log.append(log.head(), [], Writer())


def test_a_checkpoint_keeping_one_leaves_no_deleted_byte_in_the_durable_storage(tmp_path):
    config = durable(str(tmp_path / "shared"))
    secret = "observation only the deleted trajectory holds"
    with Memory.open(tmp_path / "a", config) as memory:
        fill(memory, 0, 20, seed=1)
        memory.parts.state.store.checkpoint(keep=3)
        gone = Trajectory(
            env="shop",
            task="a task whose trajectory is deleted",
            steps=(Step(action="click[Buy Now]", observation=secret),),
            outcome=Outcome(success=True),
            id="shop-gone",
        )
        memory.add_many([gone], rand_vecs(1, seed=5))
        memory.parts.state.store.checkpoint(keep=3)  # the trajectory is in a checkpoint now, and in the log before it

        def held() -> int:
            return sum(p.read_bytes().count(secret.encode()) for p in (tmp_path / "shared").rglob("*") if p.is_file())

        assert held() > 0
        memory.remove([gone.id])
        memory.parts.state.store.compact()
        memory.parts.state.store.checkpoint(keep=1)  # what `lifemem-ray compact` does on each shard
        assert held() == 0
        assert len(SharedLog(str(tmp_path / "shared")).checkpoints()) == 1
    with Memory.open(tmp_path / "b", config) as rebuilt:
        assert rebuilt.stats()["trajectories"] == 20
