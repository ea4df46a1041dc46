"""A real crash: an ingesting process is killed with SIGKILL, then the store is reopened."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np

from lifemem_ray.engine.memory import Memory

INGEST = r"""
import sys
from lifemem_ray.engine.memory_config import MemoryConfig
from lifemem_ray.engine.memory import Memory
from lifemem_ray.lab.synthetic import generate, label_vectors

path, start, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
trajs = list(generate(3000, seed=1, length_scale=0.3))
vecs = label_vectors([t.metadata["workflow"] for t in trajs], list(range(len(trajs))))
config = MemoryConfig().replace({"evolution.split_min_size": 30, "evolution.batch_size": 16})
with Memory.open(path, config) as memory:
    print("ready", flush=True)
    for i in range(start, len(trajs), 16):
        results = memory.add_many(trajs[i:i + 16], vecs[i:i + 16])
        # Acknowledged: add_many returned, so the batch is committed.
        print("ack", " ".join(r.id for r in results), flush=True)
"""


def _run_and_kill(path, start: int, after_acks: int, delay: float) -> list[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", INGEST, str(path), str(start), "0"], stdout=subprocess.PIPE, text=True
    )
    acked: list[str] = []
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    while len(acked) < after_acks:
        line = proc.stdout.readline()
        if not line:
            break
        acked.extend(line.split()[1:])
    time.sleep(delay)  # let it get into the middle of the next transactions
    os.kill(proc.pid, signal.SIGKILL)
    # Lines printed before the kill were acknowledged too.
    for line in proc.stdout:
        if line.startswith("ack"):
            acked.extend(line.split()[1:])
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    return acked


def test_sigkill_during_ingest_loses_nothing_acknowledged(tmp_path):
    path = tmp_path / "store"
    acked: list[str] = []
    start = 0
    for round_, (after, delay) in enumerate([(200, 0.013), (400, 0.031), (300, 0.007)]):
        acked += _run_and_kill(path, start, after, delay)
        # The next run retries from the last acknowledged point; retried ids are idempotent.
        start = max(0, len(set(acked)) - 8)
        with Memory.open(path) as memory:
            report = memory.verify()
            assert report["ok"], report["problems"]
            with memory.store.read() as txn:
                stored_ids = {t.id for _, t, _ in memory.store.iter_trajectories(txn)}
            missing = set(acked) - stored_ids
            assert not missing, f"round {round_}: acknowledged but lost: {sorted(missing)[:5]}"
            assert len(memory) == len(stored_ids)
            # Every trajectory is in exactly one cluster; counts and R match a recomputation (verify()).
            clusters = memory.clusters()
            assert sum(c.count for c in clusters) == len(memory) - memory.stats()["pending"]
            for c in clusters[:5]:
                ids = memory.members(c.id)
                with memory.store.read() as txn:
                    w = np.stack([memory.store.vectors(txn, memory.store.lookup_id(txn, i))[2] for i in ids])
                assert abs(np.linalg.norm(w.mean(axis=0)) - c.mrl) < 1e-4
    assert len(set(acked)) >= 800
