"""Deleted bytes through the coordinator: snapshots and compaction of a deployment hold none (the
engine's side: tests/engine/test_deletion_bytes.py)."""

from __future__ import annotations

import json
import subprocess

from test_deletion_bytes import CONFIG, MARKER, SCRIPT, _leaks, _planted

from lifemem_ray.engine.memory import Memory


# -- through a Ray deployment ------------------------------------------------------------------
def test_through_the_coordinator_snapshots_and_compaction_hold_no_deleted_bytes(
    deployment, ray_local, synthetic, tmp_path
):
    from lifemem_ray.actors.cluster import deployment as dep

    victims, keepers, vecs = _planted(synthetic)
    store = tmp_path / "store"
    client, _info = deployment(shards=2, store=store, **{"evolution.init_size": 20})
    client.add_many(victims + keepers, vecs).result(timeout=300)
    assert client.remove([t.id for t in victims]) == len(victims)
    manifest = dep.snapshot(tmp_path / "snap", client.namespace)
    assert manifest["shards"] == 2
    assert _leaks(tmp_path / "snap") == {}, "the deployment's snapshot holds deleted ids or texts"
    shard_dirs = sorted(store.glob("shard-*"))
    assert any(MARKER.encode() in (d / "data.mdb").read_bytes() for d in shard_dirs), (
        "the live shards keep deleted bytes until compacted"
    )
    out = dep.compact(client.namespace)
    assert len(out["shards"]) == 2 and out["bytes_after"] > 0
    for d in shard_dirs:
        assert _leaks(d) == {}, f"{d.name} holds deleted ids or texts after compact"
    report = client.verify(deep=True)
    assert report["ok"], [s["problems"][:3] for s in report["shards"]]
    assert client.stats()["trajectories"] == len(keepers)
    client.add_many(victims[:20], vecs[:20]).result(timeout=300)  # ingest resumed, on the compacted stores
    assert client.stats()["trajectories"] == len(keepers) + 20
    for d in manifest["shard_dirs"]:
        with Memory.open(tmp_path / "snap" / d, CONFIG, read_only=True) as snap:
            assert snap.verify(deep=True)["ok"]
    remote = ["--address", ray_local.get_runtime_context().gcs_address, "--namespace", client.namespace]
    proc = subprocess.run([SCRIPT, "compact", *remote, "--json"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [s["index"] for s in json.loads(proc.stdout)["shards"]] == [0, 1]
    assert client.verify(deep=True)["ok"] and client.stats()["trajectories"] == len(keepers) + 20
