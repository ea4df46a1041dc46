"""A shared log that is damaged, or written by two openings of one store, never costs an
acknowledged write silently: a damaged entry is kept and named, a copy that holds it repairs
the log, a rebuild that would lack it is refused (or the operator accepts the named loss), a
damaged checkpoint falls back to the one before it, and a writer taken over is deposed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from support.s3_server import S3_ENV, s3_server
from test_shared_log import durable, fill, tables

from lifemem_ray.engine.memory import Memory
from lifemem_ray.engine.store.durable_copy import materialize
from lifemem_ray.engine.store.log_errors import (
    CheckpointDamagedError,
    LogDamagedError,
    LogForkedError,
    WriterDeposedError,
)
from lifemem_ray.engine.store.shared_log import SharedLog, open_shared_log
from lifemem_ray.engine.store.storage import MemoryStore


def six_batches(memory: Memory) -> list[int]:
    """30 trajectories in 6 acknowledged batches of 5, a checkpoint after the third; the log's
    head after each batch."""
    heads = []
    for batch in range(6):
        fill(memory, batch * 5, 5, seed=batch)
        if batch == 2:
            memory.parts.state.store.checkpoint(keep=3)
        heads.append(memory.parts.state.store.shared_log_status()["head"])
    return heads


def flip_bit(shared: SharedLog, seq: int) -> None:
    """One bit flipped in the second-to-last byte of entry ``seq`` (damage, not a torn write)."""
    path = f"{shared.root}/log/{seq:020d}.txn"
    data = bytearray(shared.fs.cat_file(path))
    data[-2] ^= 0x01
    shared.fs.pipe_file(path, bytes(data))


def count(path: Path, config) -> int:
    with Memory.open(path, config) as memory:
        return memory.stats()["trajectories"]


@pytest.mark.parametrize("where", ["folder", "s3"])
def test_a_damaged_last_entry_loses_nothing_acknowledged(tmp_path, monkeypatch, where):
    if where == "s3":
        for key, value in S3_ENV.items():
            monkeypatch.setenv(key, value)
        server = s3_server()
        s3 = server.__enter__()
        uri, endpoint = s3.uri("lifemem", "shard-00"), s3.endpoint_url
    else:
        uri, endpoint = str(tmp_path / "shared"), ""
    try:
        config = durable(uri, endpoint)
        with Memory.open(tmp_path / "node", config) as memory:
            heads = six_batches(memory)
            assert memory.stats()["trajectories"] == 30
        shared = open_shared_log(uri, endpoint)
        assert shared is not None
        newest = shared.head()
        flip_bit(shared, newest)

        # A rebuild that would lack the entry is refused, naming it and the ways out.
        with pytest.raises(LogDamagedError) as refused:
            Memory.open(tmp_path / "rebuilt", config)
        assert refused.value.seq == newest and f"entry {newest} is damaged" in str(refused.value)
        assert "--accept-loss" in str(refused.value) and "local copy" in str(refused.value)
        assert shared.head() == newest, "an acknowledged entry is never removed"

        # The node's intact copy opens with all 30 and repairs the log with a checkpoint.
        with Memory.open(tmp_path / "node", config) as memory:
            assert memory.stats()["trajectories"] == 30
            assert memory.parts.state.store.shared_log_status()["repaired_entries"] == [newest]
        assert shared.checkpoints()[-1].seq >= newest
        assert count(tmp_path / "rebuilt", config) == 30  # the refused folder starts from it now
        assert count(tmp_path / "fresh", config) == 30
        assert heads[-1] <= newest
    finally:
        if where == "s3":
            server.__exit__(None, None, None)


def test_the_loss_of_a_damaged_entry_is_accepted_only_explicitly_and_by_name(tmp_path):
    config = durable(str(tmp_path / "shared"))
    with Memory.open(tmp_path / "node", config) as memory:
        heads = six_batches(memory)
    shared = SharedLog(str(tmp_path / "shared"))
    first_of_last_batch = heads[4] + 1
    flip_bit(shared, first_of_last_batch)
    shutil.rmtree(tmp_path / "node")  # the node is lost for good, with its copy
    with pytest.raises(LogDamagedError, match=f"entry {first_of_last_batch} is damaged"):
        materialize(str(tmp_path / "shared"), tmp_path / "copy")
    copy = materialize(str(tmp_path / "shared"), tmp_path / "accepted", accept_loss_from=first_of_last_batch)
    with Memory.open(copy, durable("")) as memory:  # what the entries before it hold: the first 25
        assert memory.stats()["trajectories"] == 25 and memory.verify(deep=True)["ok"]
        assert memory.get("shop-24") is not None and memory.get("home-25") is None
    assert shared.head() == heads[-1], "the log itself is left as it was"


def test_a_damaged_checkpoint_falls_back_to_the_one_before_it(tmp_path):
    config = durable(str(tmp_path / "shared"))
    with Memory.open(tmp_path / "node", config) as memory:
        for batch in range(4):
            fill(memory, batch * 5, 5, seed=batch)
            memory.parts.state.store.checkpoint(keep=2)
        fill(memory, 20, 5, seed=9)
    shared = SharedLog(str(tmp_path / "shared"))
    older, newest = shared.checkpoints()
    data_file = tmp_path / "shared" / "checkpoints" / f"{newest.seq:020d}" / "data.mdb"
    damaged = bytearray(data_file.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    data_file.write_bytes(bytes(damaged))
    with Memory.open(tmp_path / "rebuilt", config) as rebuilt:  # the older one, then the log after it
        assert rebuilt.stats()["trajectories"] == 25 and rebuilt.verify(deep=True)["ok"]
    assert tables(tmp_path / "rebuilt") == tables(tmp_path / "node")

    older_file = tmp_path / "shared" / "checkpoints" / f"{older.seq:020d}" / "data.mdb"
    older_file.write_bytes(older_file.read_bytes()[:4096])
    with pytest.raises(CheckpointDamagedError) as refused:
        Memory.open(tmp_path / "again", config)
    assert set(refused.value.problems) == {older.seq, newest.seq}
    assert "sha256 mismatch" in refused.value.problems[newest.seq]
    assert refused.value.first_entry == older.seq + 1 and "snapshot" in str(refused.value)


def test_a_writer_taken_over_is_deposed_and_knows_it_without_writing(tmp_path, monkeypatch):
    config = durable(str(tmp_path / "shared"))
    with Memory.open(tmp_path / "a", config) as memory:
        fill(memory, 0, 10, seed=1)
    shutil.copytree(tmp_path / "a", tmp_path / "b")  # the same store, opened on another node
    with Memory.open(tmp_path / "a", config) as old:
        first = old.parts.state.store.shared_log_status()
        assert first["writer"]["epoch"] >= 1 and first["deposed"] is None
        with Memory.open(tmp_path / "b", config) as new:
            assert new.parts.state.store.shared_log_status()["writer"]["epoch"] == first["writer"]["epoch"] + 1
            status = old.parts.state.store.shared_log_status()
            assert status["deposed"] and "taken over" in status["deposed"]  # known at once, no write needed
            with pytest.raises(LogForkedError):
                fill(old, 10, 5, seed=2)
            appends = []
            monkeypatch.setattr(SharedLog, "append", lambda *a: appends.append(a))
            with pytest.raises(LogForkedError):
                fill(old, 10, 5, seed=2)
            assert appends == [], "a deposed writer does not even try"
            monkeypatch.undo()
            fill(new, 10, 5, seed=2)
            assert new.stats()["trajectories"] == 15
    assert count(tmp_path / "c", config) == 15


def test_an_append_collides_with_a_later_epoch_as_deposed(tmp_path):
    shared = SharedLog(str(tmp_path))
    from lifemem_ray.engine.store.shared_log import Writer

    shared.append(1, [], Writer("dep", 2))
    with pytest.raises(WriterDeposedError) as deposed:
        shared.append(1, [("meta", b"k", b"v")], Writer("dep", 1))
    assert (deposed.value.seq, deposed.value.by, deposed.value.mine) == (1, ("dep", 2), ("dep", 1))


def test_a_log_last_written_by_another_deployment_is_refused_before_anything_is_fetched(tmp_path):
    shared_uri = str(tmp_path / "shared")
    with Memory.open(tmp_path / "a", durable(shared_uri, **{"store.shared_log_owner": "deployment-a"})) as memory:
        fill(memory, 0, 10, seed=1)
        memory.parts.state.store.checkpoint(keep=1)
    before = sorted(p.name for p in (tmp_path / "shared").rglob("*"))
    with pytest.raises(LogForkedError, match="last written by deployment deployment-a"):
        Memory.open(tmp_path / "b", durable(shared_uri, **{"store.shared_log_owner": "deployment-b"}))
    assert not (tmp_path / "b" / "data.mdb").exists(), "nothing was fetched"
    assert sorted(p.name for p in (tmp_path / "shared").rglob("*")) == before, "nothing was written"
    # The owner's own rebuild (a shard moved to another node of the same deployment) is let through.
    assert count(tmp_path / "c", durable(shared_uri, **{"store.shared_log_owner": "deployment-a"})) == 10
    with MemoryStore(tmp_path / "c", read_only=True) as store:
        assert store.dim == 384
