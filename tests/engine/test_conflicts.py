"""One ingest rule at every entry point: an id already stored (or repeated in the same
request) with other content is refused, and nothing of that request is stored."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lifemem_ray.core.errors import IdConflictError
from lifemem_ray.core.importers import write_jsonl
from lifemem_ray.engine.ingest import prepare_items
from lifemem_ray.engine.memory import Memory
from lifemem_ray.engine.memory_config import MemoryConfig
from lifemem_ray.lab.synthetic import generate, text_vectors

ROOT = Path(__file__).resolve().parents[2]
DIM = 32


def _gen(n: int, seed: int, envs=("shop", "sql")):
    return list(generate(n, seed=seed, envs=list(envs), length_scale=0.1, id_prefix=f"s{seed}"))


def _batch(n: int, seed: int, dim: int = DIM):
    trajs = _gen(n, seed)
    return trajs, text_vectors([t.task for t in trajs], dim)


def _other_content(traj):
    return dataclasses.replace(traj, task=traj.task + " (edited)")


def _engine(tmp_path) -> Memory:
    return Memory.open(tmp_path / "store", MemoryConfig(), dim=DIM)


@pytest.mark.parametrize("path", ["add", "add_many", "prepared_items"])
@pytest.mark.parametrize("where", ["stored", "in_batch"])
def test_engine_entry_points_refuse_the_whole_batch(tmp_path, path, where):
    with _engine(tmp_path) as memory:
        first, first_vecs = _batch(8, seed=1)
        memory.add_many(first, first_vecs)
        fresh, fresh_vecs = _batch(6, seed=2)
        if where == "stored":
            bad = _other_content(first[3])
            batch, vecs = [fresh[0], bad, fresh[1]], np.stack([fresh_vecs[0], first_vecs[3], fresh_vecs[1]])
        else:
            bad = _other_content(fresh[0])
            batch, vecs = [fresh[0], fresh[1], bad], np.stack([fresh_vecs[0], fresh_vecs[1], fresh_vecs[0]])
        if path == "add" and where == "in_batch":
            pytest.skip("one trajectory cannot repeat itself")
        with pytest.raises(IdConflictError, match=repr(bad.id)):
            if path == "add":
                memory.add(bad, vecs[1])
            elif path == "add_many":
                memory.add_many(batch, vecs)
            else:
                memory.add_items(prepare_items(batch, vecs, DIM, memory.features))
        assert len(memory) == 8
        assert memory.get(fresh[0].id) is None and memory.get(fresh[1].id) is None
        if where == "stored":
            assert memory.get(first[3].id) == first[3]  # the stored content is untouched
        assert memory.verify()["ok"]


def test_cli_ingest_refuses_the_file(tmp_path):
    store = tmp_path / "store"
    first = _gen(6, 1, ["shop"])
    write_jsonl(first, tmp_path / "a.jsonl")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "lifemem_ray.cli", "ingest", "--store", str(store)]
    ok = subprocess.run([*cmd, str(tmp_path / "a.jsonl")], capture_output=True, text=True, timeout=600, env=env)
    assert ok.returncode == 0, ok.stderr[-2000:]
    fresh = _gen(4, 2, ["shop"])
    write_jsonl([fresh[0], _other_content(first[1]), fresh[1]], tmp_path / "b.jsonl")
    bad = subprocess.run([*cmd, str(tmp_path / "b.jsonl")], capture_output=True, text=True, timeout=600, env=env)
    assert bad.returncode == 1 and first[1].id in bad.stderr and "Traceback" not in bad.stderr
    with Memory.open(store, read_only=True) as memory:
        assert len(memory) == 6 and memory.get(fresh[0].id) is None
