"""Deletion in the engine: by id and a whole tenant; clusters, skills and the index follow;
it survives SIGKILL (acknowledged deletions hold, an acknowledged purge completes at the next
open) and snapshots taken afterwards do not bring the data back."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from typing import Any

import pytest

from lifemem_ray.core.tenancy import DEFAULT_TENANT
from lifemem_ray.engine.memory import Memory
from lifemem_ray.engine.memory_config import MemoryConfig

CONFIG = MemoryConfig().replace({"evolution.init_size": 20, "evolution.batch_size": 32})


def _acme(trajs):
    return [dataclasses.replace(t, tenant="acme") for t in trajs]


def _fill(path, synthetic, default: int = 200, acme: int = 300) -> None:
    trajs, vecs = synthetic
    with Memory.open(path, CONFIG) as mem:
        mem.add_many(trajs[:default], vecs[:default])
        mem.add_many(_acme(trajs[:acme]), vecs[:acme])


def _check(mem: Memory) -> None:
    """Every invariant against a recomputation (counts, sums and R of every live cluster) and
    the index against the store."""
    report = mem.verify(deep=True)
    assert report["ok"], report["problems"]
    assert len(mem.index) == len(mem)


def test_remove_updates_counts_sums_r_and_retires_empty_clusters(tmp_path, synthetic):
    trajs, vecs = synthetic
    path = tmp_path / "m"
    _fill(path, synthetic)
    with Memory.open(path, CONFIG) as mem:
        smallest = min(mem.clusters(tenant="acme"), key=lambda c: c.count)
        members = mem.members(smallest.id, tenant="acme")
        others = [t.id for t in trajs[:50] if t.id not in members]
        assert mem.remove(members + others, tenant="acme") == len(members) + len(others)
        assert smallest.id not in {c.id for c in mem.clusters(tenant=None)}, "an emptied cluster is retired"
        assert mem.stats("acme")["trajectories"] == 300 - len(members) - len(others)
        _check(mem)
        hits = mem.retrieve_many(
            [t.task for t in trajs[:50]], [t.env for t in trajs[:50]], k=10, vectors=vecs[:50], tenant="acme"
        )
        assert not set(members + others) & {h.id for r in hits for h in r.trajectories}
    with Memory.open(path, CONFIG) as mem:  # reopened: the retired cluster stays retired
        assert smallest.id not in {c.id for c in mem.clusters(tenant=None)}
        assert all(mem.get(i, tenant="acme") is None for i in members + others)
        _check(mem)


def test_removal_in_a_pending_store(tmp_path, synthetic):
    trajs, vecs = synthetic
    with Memory.open(tmp_path / "m", CONFIG) as mem:
        mem.add_many(trajs[:10], vecs[:10])
        assert mem.remove([trajs[0].id, trajs[1].id]) == 2
        assert mem.stats()["pending"] == 8
        mem.add_many(trajs[10:40], vecs[10:40])
        assert mem.initialised and sum(c.count for c in mem.clusters()) == 38
        _check(mem)


def test_shrinking_a_cluster_redistils_its_skill(tmp_path, synthetic):
    trajs, vecs = synthetic
    growth = CONFIG.evolution.skill_refresh_growth
    with Memory.open(tmp_path / "m", CONFIG) as mem:
        mem.add_many(trajs[:300], vecs[:300])
        mem.maintain()
        big = max(mem.clusters(), key=lambda c: c.count)
        record = mem._state.clusters[big.id]
        distilled_at = record.skill_n
        assert distilled_at > 4
        keep = int(distilled_at / (1 + growth)) - 1
        members = mem.members(big.id)
        removed = mem.remove(members[: len(members) - keep])
        assert removed == len(members) - keep
        after = mem._state.clusters[big.id]
        assert after.count == keep and after.skill_n == keep, "the skill was distilled again for the members left"
        with mem.store.read() as txn:
            assert big.id not in mem.store.todos(txn)
        _check(mem)


def test_offline_description_drops_a_removed_example(tmp_path, synthetic):
    trajs, vecs = synthetic
    with Memory.open(tmp_path / "m", CONFIG) as mem:
        mem.add_many(trajs[:100], vecs[:100])
        c = max(mem.clusters(), key=lambda c: c.count)
        example = c.description.partition("Example goal: ")[2]
        founder = next(i for i in mem.members(c.id) if " ".join(mem.get(i).query_text.split())[:120] == example)
        mem.remove([founder])
        now = next(x for x in mem.clusters() if x.id == c.id)
        assert now.description.partition("Example goal: ")[2] != example
        assert f"[{now.count} trajectories" in now.description


def test_purge_tenant_removes_everything_of_it_only(tmp_path, synthetic):
    trajs, vecs = synthetic
    path = tmp_path / "m"
    _fill(path, synthetic)
    with Memory.open(path, CONFIG) as mem:
        before = {c.id: c.count for c in mem.clusters()}
        assert mem.purge_tenant("acme") == 300
        assert mem.purge_tenant("acme") == 0, "purging again is harmless"
        assert mem.clusters(tenant="acme") == [] and mem.stats("acme")["trajectories"] == 0
        assert {c.id: c.count for c in mem.clusters()} == before, "the other tenant is untouched"
        assert mem.stats()["purging"] == []
        assert mem.retrieve(trajs[0].task, None, vector=vecs[0], tenant="acme").trajectories == []
        with mem.store.read() as txn:
            logged = [e.get("id", "") for _, e in mem.store.iter_log(txn)]
        assert not [i for i in logged if i.startswith("acme\x00")], "the log keeps no id of the purged tenant"
        assert any(i and "\x00" not in i for i in logged), "the other tenant's log entries keep their ids"
        _check(mem)


def test_purge_passes_that_find_nothing_leave_the_generation_alone(tmp_path, synthetic, monkeypatch):
    """Read-only views reload when the store's generation moves: the bounded log and tombstone
    passes of a purge bump it only where they rewrote something."""
    from lifemem_ray.engine import deletion

    monkeypatch.setattr(deletion, "PURGE_LOG_CHUNK", 7)
    path = tmp_path / "m"
    _fill(path, synthetic)
    with Memory.open(path, CONFIG) as mem:
        assert mem.purge_tenant("acme") == 300
        with mem.store.read() as txn:
            entries = sum(1 for _ in mem.store.iter_log(txn))
            clusters = sum(1 for _ in mem.store.iter_clusters(txn))
        before = mem.store.generation()
        assert mem.purge_tenant("acme") == 0  # nothing left to blank or scrub: dozens of passes, each a no-op
        bumped = mem.store.generation() - before
        assert entries // 7 + clusters // 7 > 20 and bumped <= 2, (
            entries,
            clusters,
            bumped,
        )  # the intent and the last removal
        _check(mem)


def test_store_write_bumps_the_generation_unless_told_nothing_changed(tmp_path):
    from lifemem_ray.engine.store.storage import MemoryStore

    store = MemoryStore(tmp_path / "s", dim=4, workflow_dim=4)
    try:
        start = store.generation()
        assert store.write(lambda txn: 0, changed=lambda n: n > 0) == 0 and store.generation() == start
        store.write(lambda txn: 1, changed=lambda n: n > 0)
        store.write(lambda txn: None)
        assert store.generation() == start + 2
    finally:
        store.close()


def test_a_purge_forgets_the_tenants_environment_names_and_codes_stay_unique(tmp_path, synthetic):
    trajs, vecs = synthetic
    path = tmp_path / "m"
    _fill(path, synthetic)
    with Memory.open(path, CONFIG) as mem:
        with mem.store.read() as txn:
            before = mem.store.env_codes(txn)
        acme_envs = {name for name in before if name.startswith("acme\x00")}
        assert acme_envs
        mem.purge_tenant("acme")
        with mem.store.read() as txn:
            after = mem.store.env_codes(txn)
        assert not acme_envs & set(after), "no name of the purged tenant's environments is left"
        assert {n: c for n, c in after.items() if not n.startswith("\x00")} == {
            n: c for n, c in before.items() if n not in acme_envs
        }
        assert sorted(after.values()) == sorted(before.values()), "every code is kept, under a placeholder"
        mem.add_many(_acme(trajs[:30]), vecs[:30])  # the tenant starts again: new codes, none reused
        with mem.store.read() as txn:
            again = mem.store.env_codes(txn)
        assert len(set(again.values())) == len(again) and acme_envs <= set(again)
        _check(mem)
    with Memory.open(path, CONFIG) as mem:  # reopened: the index is built from the codes again
        assert (
            mem.stats("acme")["trajectories"] == 30
            and mem.retrieve(trajs[0].task, trajs[0].env, vector=vecs[0], tenant="acme").trajectories
        )
        _check(mem)


def test_a_purge_blanks_the_log_and_tombstones_in_bounded_passes(tmp_path, synthetic, monkeypatch):
    """The log and the clusters are gone over a few entries per transaction before the last
    one, which reads the log only from where those passes ended; the outcome is the same."""
    from lifemem_ray.engine import deletion
    from lifemem_ray.engine.store.storage import MemoryStore

    monkeypatch.setattr(deletion, "PURGE_LOG_CHUNK", 7)
    calls: list[tuple[int, int | None]] = []
    real = MemoryStore.redact_log

    def spy(self, txn, tenant, start=0, limit=None):
        calls.append((start, limit))
        return real(self, txn, tenant, start, limit)

    monkeypatch.setattr(MemoryStore, "redact_log", spy)
    events: list[tuple[str, Any]] = []  # the tombstone passes and the cluster records written, in order
    real_forget, real_put = deletion._forget_tombstones, MemoryStore.put_cluster

    def forget(s, txn, tenant, after=-1, limit=None):
        events.append(("pass", limit))
        return real_forget(s, txn, tenant, after=after, limit=limit)

    def put(self, txn, record):
        events.append(("put", record.id))
        return real_put(self, txn, record)

    monkeypatch.setattr(deletion, "_forget_tombstones", forget)
    monkeypatch.setattr(MemoryStore, "put_cluster", put)
    trajs, vecs = synthetic
    splitting = CONFIG.replace({"evolution.split_min_size": 8, "evolution.split_mrl_threshold": 0.99})
    with Memory.open(tmp_path / "m", splitting) as mem:
        mem.add_many(trajs[:200], vecs[:200])
        mem.add_many(_acme(trajs[:300]), vecs[:300])
        calls.clear()
        with mem.store.read() as txn:
            entries = len(list(mem.store.iter_log(txn)))
            acme = {r.id for r in mem.store.iter_clusters(txn) if r.tenant == "acme"}
            worded = {r.id for r in mem.store.iter_clusters(txn) if r.tenant == "acme" and not r.live}  # split parents
        assert worded, "the test needs tombstones with words (clusters split before the purge)"
        assert mem.purge_tenant("acme") == 300
        chunked, last = calls[:-1], calls[-1]
        assert all(limit == 7 for _, limit in chunked) and len(chunked) >= entries // 7
        assert last[1] is None and last[0] >= entries, "the last transaction reads only what came after the passes"
        with mem.store.read() as txn:
            logged = [e.get("id", "") for _, e in mem.store.iter_log(txn)]
            after = [r for r in mem.store.iter_clusters(txn) if r.id in acme]
        assert logged and not [i for i in logged if i.startswith("acme\x00")]
        assert len(after) == len(acme) and not any(
            r.live or r.envs or r.description or r.skill or r.flows for r in after
        )
        last_pass = max(i for i, e in enumerate(events) if e == ("pass", None))
        assert ("pass", 7) in events and not [e for e in events[last_pass:] if e[0] == "put" and e[1] in worded], (
            "the tombstones that were there before are scrubbed in the bounded passes, not in the last transaction"
        )
        assert mem.stats()["purging"] == [] and mem.clusters(tenant="acme") == []
        _check(mem)


def test_snapshots_after_a_deletion_do_not_bring_it_back(tmp_path, synthetic):
    trajs, vecs = synthetic
    path = tmp_path / "m"
    _fill(path, synthetic)
    victims = [t.id for t in trajs[:40]]
    with Memory.open(path, CONFIG) as mem:
        mem.remove(victims)
        mem.purge_tenant("acme")
        mem.shard.snapshot(str(tmp_path / "snap"))
    with Memory.open(tmp_path / "snap", CONFIG, read_only=True) as snap:
        assert all(snap.get(i) is None for i in victims) and len(snap) == 160
        assert snap.stats()["per_tenant"].keys() == {DEFAULT_TENANT}
        assert snap.verify()["ok"]
        hits = snap.retrieve_many([t.task for t in trajs[:40]], [t.env for t in trajs[:40]], k=10, vectors=vecs[:40])
        assert not set(victims) & {h.id for r in hits for h in r.trajectories}
    unique = [t.task.encode() for t in trajs[:40] if all(t.task != u.task for u in trajs[40:300])]
    assert unique and not [e for e in _entries(tmp_path / "snap") if any(task in e for task in unique)], (
        "no table of the snapshot holds a deleted task (records, briefs, cluster descriptions, tombstones)"
    )
    with Memory.open(tmp_path / "restored", CONFIG) as restored:  # a restore copies the snapshot's clusters
        restored.absorb(tmp_path / "snap")
        assert all(restored.get(i) is None for i in victims) and len(restored) == 160
        _check(restored)


def _entries(path) -> list[bytes]:
    """Every key and value of every table of a store, read with LMDB itself."""
    import lmdb

    from lifemem_ray.engine.store.environment import TABLES

    env = lmdb.open(str(path), max_dbs=len(TABLES) + 2, readonly=True, lock=False)
    try:
        out = []
        for name in TABLES:
            db = env.open_db(name.encode(), create=False)
            with env.begin(db=db) as txn:
                out.extend(x for kv in txn.cursor() for x in kv)
        return out
    finally:
        env.close()


# -- SIGKILL ---------------------------------------------------------------------------------
REMOVER = r"""
import sys
from lifemem_ray.engine.memory_config import MemoryConfig
from lifemem_ray.engine.memory import Memory
from lifemem_ray.lab.synthetic import generate

path = sys.argv[1]
config = MemoryConfig().replace({"evolution.init_size": 20, "evolution.batch_size": 32})
ids = [t.id for t in generate(600, seed=1, length_scale=0.2)][:300]
with Memory.open(path, config) as memory:
    print("ready", flush=True)
    for i in range(0, len(ids), 5):
        tenant = "acme" if (i // 5) % 2 else "default"
        n = memory.remove(ids[i:i + 5], tenant=tenant)
        print("ack", tenant, " ".join(ids[i:i + 5]), flush=True)  # acknowledged: remove() returned
"""


def test_sigkill_during_removals_keeps_every_acknowledged_one(tmp_path, synthetic):
    path = tmp_path / "m"
    _fill(path, synthetic)
    with Memory.open(path, CONFIG) as mem:
        mem.retrieve("warm", None, vector=synthetic[1][0])  # a saved index cache from before the removals (at close)
    assert (path / "index").exists()
    acked: dict[str, set[str]] = {"default": set(), "acme": set()}
    for after in (3, 9, 17):
        proc = subprocess.Popen([sys.executable, "-c", REMOVER, str(path)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        seen = 0
        while seen < after:
            line = proc.stdout.readline()
            if not line:
                break
            _, tenant, *ids = line.split()
            acked[tenant].update(ids)
            seen += 1
        os.kill(proc.pid, signal.SIGKILL)
        for line in proc.stdout:
            _, tenant, *ids = line.split()
            acked[tenant].update(ids)
        proc.wait(timeout=30)
        assert proc.returncode == -signal.SIGKILL
        with Memory.open(path, CONFIG) as mem:
            for tenant, ids in acked.items():
                assert all(mem.get(i, tenant=tenant) is None for i in ids), "an acknowledged removal came back"
            _check(mem)
            vecs = synthetic[1]
            hits = mem.retrieve_many(
                [t.task for t in synthetic[0][:60]], [None] * 60, k=20, vectors=vecs[:60], tenant="acme"
            )
            assert not acked["acme"] & {h.id for r in hits for h in r.trajectories}
    assert acked["default"] and acked["acme"]


PURGER = r"""
import os, signal, sys
from lifemem_ray.engine.memory_config import MemoryConfig
from lifemem_ray.engine import deletion
from lifemem_ray.engine.memory import Memory

path, kill_after = sys.argv[1], int(sys.argv[2])
deletion.PURGE_CHUNK = 40  # several bounded transactions
calls = [0]
original = deletion.Deletion.remove_keys

def remove_keys(self, keys, op, finish=None):
    if calls[0] == kill_after:
        os.kill(os.getpid(), signal.SIGKILL)  # between two transactions of the purge
    calls[0] += 1
    return original(self, keys, op, finish)

deletion.Deletion.remove_keys = remove_keys
config = MemoryConfig().replace({"evolution.init_size": 20, "evolution.batch_size": 32})
with Memory.open(path, config) as memory:
    print("purged", memory.purge_tenant("acme"), flush=True)
"""


@pytest.mark.parametrize("kill_after", [0, 1, 4, 7])
def test_sigkill_during_a_purge_completes_it_at_the_next_open(tmp_path, synthetic, kill_after):
    path = tmp_path / "m"
    _fill(path, synthetic)
    with Memory.open(path, CONFIG) as mem:
        default_before = {c.id: c.count for c in mem.clusters()}
    proc = subprocess.run(
        [sys.executable, "-c", PURGER, str(path), str(kill_after)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    with Memory.open(path, CONFIG, read_only=True) as reader:  # what the crash left: the intent, part of the data
        assert reader.stats()["purging"] == ["acme"]
        left = reader.stats("acme")["trajectories"]
        assert left == 300 - 40 * kill_after
    with Memory.open(path, CONFIG) as mem:  # a writable open finishes the purge
        assert mem.stats("acme")["trajectories"] == 0 and mem.clusters(tenant="acme") == []
        assert mem.stats()["purging"] == []
        assert {c.id: c.count for c in mem.clusters()} == default_before
        _check(mem)


def test_purging_the_default_tenant_blanks_its_ids_in_the_log_only(tmp_path, synthetic):
    path = tmp_path / "m"
    _fill(path, synthetic)
    with Memory.open(path, CONFIG) as mem:
        assert mem.purge_tenant(DEFAULT_TENANT) == 200
        with mem.store.read() as txn:
            logged = [e.get("id", "") for _, e in mem.store.iter_log(txn)]
        assert not [i for i in logged if i and "\x00" not in i], "the log keeps no id of the purged default tenant"
        assert any(i.startswith("acme\x00") for i in logged), "acme's entries keep their ids"
        assert mem.stats("acme")["trajectories"] == 300
        _check(mem)
