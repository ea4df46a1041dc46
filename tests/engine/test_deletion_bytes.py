"""Deleted means deleted, byte for byte: a removal by id leaves its id in no log entry, a
snapshot holds none of a deleted trajectory's id or text anywhere in its files (not only in
its tables), and `compact` rewrites a live store so it drops them too; a crash in the middle
of a compaction leaves the store whole.

The trajectories to delete carry recognisable ids and a marker in every observation, and the
files are scanned as raw bytes, as `grep -a` would."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest

from lifemem_ray.core.errors import StoreLockedError
from lifemem_ray.engine.memory import Memory
from lifemem_ray.engine.memory_config import MemoryConfig
from lifemem_ray.engine.store import lmdb_rewrite, storage
from lifemem_ray.engine.store.environment import TABLES
from lifemem_ray.engine.store.storage import MemoryStore

CONFIG = MemoryConfig().replace({"evolution.init_size": 20, "evolution.batch_size": 32})
MARKER = "QZX-DELETED-OBSERVATION-7F3A"
DELETED_ID = re.compile(rb"gone-\d{4}-QZX")
SCRIPT = shutil.which("lifemem-ray") or str(Path(sys.executable).parent / "lifemem-ray")


def _planted(synthetic, n_victims: int = 300, n_keepers: int = 300, tenant: str = "default"):
    """(victims, keepers, vectors): victims with ids ``gone-NNNN-QZX`` and :data:`MARKER` in
    every observation (of ``tenant``), keepers as generated (default tenant)."""
    trajs, vecs = synthetic
    victims = [
        dataclasses.replace(
            t,
            id=f"gone-{i:04d}-QZX",
            tenant=tenant,
            steps=tuple(dataclasses.replace(s, observation=f"{s.observation} {MARKER}") for s in t.steps),
        )
        for i, t in enumerate(trajs[:n_victims])
    ]
    keepers = list(trajs[n_victims : n_victims + n_keepers])
    return victims, keepers, vecs[: n_victims + n_keepers]


def _leaks(folder: Path) -> dict[str, set[bytes]]:
    """What of the deleted trajectories any file under ``folder`` holds, read as raw bytes."""
    found: dict[str, set[bytes]] = {}
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        data = path.read_bytes()
        hits = set(DELETED_ID.findall(data)) | ({MARKER.encode()} if MARKER.encode() in data else set())
        if hits:
            found[str(path.relative_to(folder))] = hits
    return found


def _check_survivors(mem: Memory, keepers) -> None:
    report = mem.verify(deep=True)
    assert report["ok"], report["problems"][:5]
    assert len(mem) == len(keepers) and all(mem.get(t.id) is not None for t in keepers)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- the log ---------------------------------------------------------------------------------
def test_a_removal_by_id_blanks_exactly_its_own_log_entries(tmp_path, synthetic):
    victims, keepers, vecs = _planted(synthetic, 100, 200)
    with Memory.open(tmp_path / "m", CONFIG) as mem:
        mem.add_many(victims + keepers, vecs)
        assert mem.remove([t.id for t in victims]) == 100
        with mem.store.read() as txn:
            logged = [e.get("id", "") for _, e in mem.store.iter_log(txn)]
            rows = sum(1 for _ in txn.cursor(db=mem.store.db["logvid"]))
        assert not [i for i in logged if DELETED_ID.fullmatch(i.encode())], "no log entry names a removed id"
        assert {t.id for t in keepers} <= set(logged), "the other trajectories' entries keep their ids"
        assert rows == sum(1 for i in logged if i), (
            "every entry naming an id is indexed by its trajectory, and only those"
        )
        again = dataclasses.replace(victims[0], task=victims[0].task + " (again)")  # an id re-added with other content
        mem.add_many([again], vecs[:1])
        with mem.store.read() as txn:
            assert [e["op"] for _, e in mem.store.iter_log(txn) if e.get("id") == again.id] != []
        assert mem.remove([again.id]) == 1
        with mem.store.read() as txn:
            assert not [e for _, e in mem.store.iter_log(txn) if e.get("id") == again.id]
        _check_survivors(mem, keepers)


def test_a_store_written_before_the_log_index_gets_it_at_its_first_writable_open(tmp_path, synthetic, monkeypatch):
    """An older version's removal left the ids in the log and there was no ``logvid`` table:
    a read-only open still works; the first writable open indexes the log in bounded passes
    and blanks the ids of trajectories no longer stored; removals then blank their entries."""
    victims, keepers, vecs = _planted(synthetic, 50, 150)
    path = tmp_path / "m"
    with Memory.open(path, CONFIG) as mem:
        mem.add_many(victims + keepers, vecs)
        with monkeypatch.context() as older:
            older.setattr(MemoryStore, "forget_logged_id", lambda self, txn, vid: 0)  # what a removal did before
            assert mem.remove([t.id for t in victims]) == 50
    env = lmdb.open(str(path), max_dbs=len(TABLES) + 2)
    with env.begin(write=True) as txn:  # back to the older layout
        txn.drop(env.open_db(b"logvid", txn=txn), delete=True)
        txn.delete(b"log_by_vid", db=env.open_db(b"meta", txn=txn))
    env.close()
    with Memory.open(path, CONFIG, read_only=True) as view:
        assert "logvid" not in view.store.db and len(view) == 150
        with view.store.read() as txn:
            assert sum(1 for _, e in view.store.iter_log(txn) if DELETED_ID.fullmatch(e.get("id", "").encode())) >= 50
    monkeypatch.setattr(storage, "LOG_INDEX_CHUNK", 7)
    with Memory.open(path, CONFIG) as mem:
        with mem.store.read() as txn:
            logged = [e.get("id", "") for _, e in mem.store.iter_log(txn)]
            rows = sum(1 for _ in txn.cursor(db=mem.store.db["logvid"]))
        assert not [i for i in logged if DELETED_ID.fullmatch(i.encode())], (
            "the ids of removed trajectories are blanked"
        )
        assert rows == sum(1 for i in logged if i) and {t.id for t in keepers} <= set(logged)
        assert mem.store.get_meta("log_by_vid") is True and mem.store.get_meta("log_by_vid_from") is None
        assert mem.remove([keepers[0].id]) == 1
        with mem.store.read() as txn:
            assert keepers[0].id not in {e.get("id") for _, e in mem.store.iter_log(txn)}
        _check_survivors(mem, keepers[1:])


# -- snapshots and compaction in the engine ------------------------------------------------------
def test_a_snapshot_holds_no_byte_of_a_deleted_trajectory_and_compact_clears_the_live_store(tmp_path, synthetic):
    victims, keepers, vecs = _planted(synthetic)
    path = tmp_path / "m"
    with Memory.open(path, CONFIG) as mem:
        mem.add_many(victims + keepers, vecs)
        assert mem.remove([t.id for t in victims]) == len(victims)
        mem.shard.snapshot(str(tmp_path / "snap"))
        assert _leaks(tmp_path / "snap") == {}, "the snapshot holds deleted ids or texts"
        assert MARKER.encode() in (path / "data.mdb").read_bytes(), "the live store keeps deleted bytes until compacted"
        out = mem.shard.compact()
        assert out["bytes_after"] == (path / "data.mdb").stat().st_size and out["bytes_before"] > 0
        assert _leaks(path) == {}, "after compact no file of the store holds deleted ids or texts"
        assert not (path / lmdb_rewrite.COMPACT_STAGING).exists()
        _check_survivors(mem, keepers)
        mem.add_many(victims[:10], vecs[:10])  # the store goes on working on the new file
        assert mem.remove([t.id for t in victims[:10]]) == 10
        _check_survivors(mem, keepers)
    with Memory.open(path, CONFIG) as mem:
        _check_survivors(mem, keepers)
    with Memory.open(tmp_path / "snap", CONFIG, read_only=True) as snap:
        _check_survivors(snap, keepers)


def test_searches_and_reads_go_on_while_the_store_is_compacted(tmp_path, synthetic):
    """The environment is closed and reopened around the swap: readers of other threads wait
    for it (never touch a closed environment), and every answer is complete."""
    import threading

    victims, keepers, vecs = _planted(synthetic, 100, 200)
    with Memory.open(tmp_path / "m", CONFIG) as mem:
        mem.add_many(victims + keepers, vecs)
        mem.remove([t.id for t in victims])
        stop, answering, errors, answers = threading.Event(), threading.Event(), [], [0]

        def read() -> None:
            while not stop.is_set():
                try:
                    got = mem.retrieve_many(
                        [t.task for t in keepers[:8]], [t.env for t in keepers[:8]], k=3, vectors=vecs[100:108]
                    )
                    assert all(r.trajectories for r in got) and mem.get(keepers[0].id) is not None
                    answers[0] += 1
                    answering.set()
                except Exception as exc:
                    errors.append(exc)
                    return

        readers = [threading.Thread(target=read) for _ in range(2)]
        for thread in readers:
            thread.start()
        try:
            assert answering.wait(timeout=60), errors[:1]
            for _ in range(3):
                mem.shard.compact()
        finally:
            stop.set()
            for thread in readers:
                thread.join(timeout=60)
        assert not errors and answers[0] > 0, errors[:1]
        _check_survivors(mem, keepers)


def test_a_snapshot_after_a_tenant_purge_holds_no_byte_of_the_tenant(tmp_path, synthetic):
    victims, keepers, vecs = _planted(synthetic, tenant="acme")
    with Memory.open(tmp_path / "m", CONFIG) as mem:
        mem.add_many(victims + keepers, vecs)
        assert mem.purge_tenant("acme") == len(victims)
        mem.shard.snapshot(str(tmp_path / "snap"))
        assert _leaks(tmp_path / "snap") == {}, "the snapshot holds the purged tenant's ids or texts"
        assert MARKER.encode() in (tmp_path / "m" / "data.mdb").read_bytes(), (
            "the live store keeps deleted bytes until compacted"
        )
        mem.shard.compact()
        assert _leaks(tmp_path / "m") == {}
    with Memory.open(tmp_path / "snap", CONFIG, read_only=True) as snap:
        _check_survivors(snap, keepers)
        assert set(snap.stats()["per_tenant"]) == {"default"}


# -- a crash in the middle of a compaction -------------------------------------------------------
def _deleted_store(path: Path, synthetic) -> list:
    victims, keepers, vecs = _planted(synthetic, 100, 200)
    with Memory.open(path, CONFIG) as mem:
        mem.add_many(victims + keepers, vecs)
        mem.remove([t.id for t in victims])
    return keepers


def test_a_compaction_that_fails_before_the_swap_leaves_the_store_as_it_was(tmp_path, synthetic, monkeypatch):
    path = tmp_path / "m"
    keepers = _deleted_store(path, synthetic)
    before = _digest(path / "data.mdb")

    def refuse(src, dst):
        raise OSError(28, "No space left on device")

    with Memory.open(path, CONFIG) as mem:
        with monkeypatch.context() as patch:
            patch.setattr(os, "replace", refuse)
            with pytest.raises(OSError, match="No space"):
                mem.shard.compact()
        assert _digest(path / "data.mdb") == before and not (path / lmdb_rewrite.COMPACT_STAGING).exists()
        _check_survivors(mem, keepers)  # the store was reopened on its own file and works
        mem.remove([keepers[0].id])
        _check_survivors(mem, keepers[1:])
    with Memory.open(path, CONFIG) as mem:
        _check_survivors(mem, keepers[1:])


CRASHER = r"""
import os, signal, sys
from lifemem_ray.engine.store import lmdb_rewrite
from lifemem_ray.engine.memory_config import MemoryConfig
from lifemem_ray.engine.memory import Memory

path, where = sys.argv[1], sys.argv[2]
die = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
if where == "before-replace":
    os.replace = die
else:  # after the replace, before the folder is fsynced and the environment reopened
    lmdb_rewrite.fsync_dir = lambda d: die() if str(d) == path else None
with Memory.open(path, MemoryConfig().replace({"evolution.init_size": 20, "evolution.batch_size": 32})) as memory:
    memory.shard.compact()
"""


@pytest.mark.parametrize("where", ["before-replace", "after-replace"])
def test_a_compaction_killed_midway_leaves_a_whole_store(tmp_path, synthetic, where):
    """SIGKILL with the copy written but not swapped in: the old file, whole, and the leftover
    copy is removed at the next open; killed right after the swap: the new file, whole."""
    path = tmp_path / "m"
    keepers = _deleted_store(path, synthetic)
    before = _digest(path / "data.mdb")
    proc = subprocess.run(
        [sys.executable, "-c", CRASHER, str(path), where], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    if where == "before-replace":
        assert _digest(path / "data.mdb") == before and (path / lmdb_rewrite.COMPACT_STAGING / "data.mdb").is_file()
    else:
        assert MARKER.encode() not in (path / "data.mdb").read_bytes(), "the compacted copy is in place"
    with Memory.open(path, CONFIG) as mem:
        assert not (path / lmdb_rewrite.COMPACT_STAGING).exists(), "the leftover is removed at the next writable open"
        _check_survivors(mem, keepers)
        mem.shard.compact()
        assert _leaks(path) == {}
        _check_survivors(mem, keepers)


# -- the command line ---------------------------------------------------------------------------
HOLDER = r"""
import sys, time
from lifemem_ray.engine.memory_config import MemoryConfig
from lifemem_ray.engine.memory import Memory

with Memory.open(sys.argv[1], MemoryConfig().replace({"evolution.init_size": 20}), read_only=sys.argv[2] == "read") as memory:
    print("ready", flush=True)
    time.sleep(300)
"""


def test_cli_compact_rewrites_a_store_and_refuses_one_another_process_has_open(tmp_path, synthetic):
    path = tmp_path / "m"
    keepers = _deleted_store(path, synthetic)
    for mode, why in (("write", "open for writing by another process"), ("read", "open in another process")):
        before = _digest(path / "data.mdb")
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), mode], stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
            proc = subprocess.run(
                [SCRIPT, "compact", "--store", str(path)], capture_output=True, text=True, timeout=300
            )
        finally:
            holder.kill()
            holder.wait(timeout=30)
        assert proc.returncode == 1 and why in proc.stderr and "compact" in proc.stderr, (mode, proc.stderr)
        assert _digest(path / "data.mdb") == before and not (path / lmdb_rewrite.COMPACT_STAGING).exists()
    assert MARKER.encode() in (path / "data.mdb").read_bytes()
    proc = subprocess.run(
        [SCRIPT, "compact", "--store", str(path), "--json"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["bytes_before"] > 0 and out["bytes_after"] == (path / "data.mdb").stat().st_size
    assert _leaks(path) == {}
    with Memory.open(path, CONFIG) as mem:
        _check_survivors(mem, keepers)
    proc = subprocess.run([SCRIPT, "compact"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "--store DIR is required" in proc.stderr


def test_compacting_refuses_while_another_process_has_the_store_open_read_only(tmp_path, synthetic):
    """The swap is refused while another process maps the file (its lock-table entry would
    outlive it): checked with LMDB's own exclusive-open lock, nothing replaced."""
    path = tmp_path / "m"
    keepers = _deleted_store(path, synthetic)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), "read"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        with Memory.open(path, CONFIG) as mem:
            before = _digest(path / "data.mdb")
            with pytest.raises(StoreLockedError, match="open in another process"):
                mem.shard.compact()
            assert _digest(path / "data.mdb") == before
            _check_survivors(mem, keepers)
    finally:
        holder.kill()
        holder.wait(timeout=30)
