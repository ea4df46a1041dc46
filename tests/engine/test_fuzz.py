"""Hostile input, generated: a bounded, seeded set of malformed records, files and configs.

Each must get a clear refusal of the library's own kind (a RecordError naming FILE:LINE, a
ConfigError naming the setting) and never store anything half-way: the attacks of the
hardening review stay fixed.
"""

from __future__ import annotations

import gzip
import json
import random

import pytest

from lifemem_ray.core.errors import LifeMemError
from lifemem_ray.core.importers import RecordError, check_file
from lifemem_ray.engine.memory import Memory
from lifemem_ray.engine.memory_config import MemoryConfig
from lifemem_ray.lab.synthetic import generate, text_vectors

BOUNDS = MemoryConfig.bounds()

SEED = 20261202
CASES = 300  # generated records, bounded so the file runs in seconds

GOOD = {
    "env": "shop",
    "task": "buy a red shirt",
    "steps": [{"action": "search[red shirt]", "observation": "3 results"}],
    "outcome": {"success": True, "reward": 1.0},
}


def _mutations(rng: random.Random) -> list[bytes]:
    """Malformed lines: broken JSON, wrong types, bad text, oversized parts, duplicate keys."""

    def record(**change: object) -> bytes:
        data = json.loads(json.dumps(GOOD))
        for key, value in change.items():
            if value is _DROP:
                data.pop(key, None)
            else:
                data[key] = value
        return json.dumps(data).encode()

    pool = [
        lambda: b"{" + rng.choice([b"", b'"env":', b'"steps": [', b"\\"]),
        lambda: json.dumps(GOOD).encode()[: rng.randint(1, 60)],
        lambda: record(env=rng.choice(["", " ", None, 5, [], "x" * 200])),
        lambda: record(task=rng.choice([None, 7, {"a": 1}])),
        lambda: record(steps=rng.choice([[], None, "search", [{}], [{"action": 5}], [{"action": "a", "extra": 1}]])),
        lambda: record(steps=[{"action": "a\x00b"}]),
        lambda: record(outcome=rng.choice(["yes", {"success": "maybe"}, {"reward": float("inf")}, [1]])),
        lambda: record(metadata=rng.choice([[1], "m", {"k": "v\x00"}, {"k": list(range(20_000))}])),
        lambda: record(task=_DROP, initial_observation=""),
        lambda: record(id=rng.choice([" ", "x" * 600, 12.5, [1], True])),  # integer ids are accepted (as text)
        lambda: b'{"env": "shop", "env": "sql", "task": "t", "steps": [{"action": "a"}]}',
        lambda: json.dumps(GOOD).encode()[:-1] + b', "task": "again"}',
        lambda: '{"env": "shop", "task": "\ud800", "steps": [{"action": "a"}]}'.encode("utf-8", "surrogatepass"),
        lambda: b'{"env": "shop", "task": "\xff\xfe", "steps": [{"action": "a"}]}',
        lambda: rng.choice([b"[]", b"null", b"42", b'"text"', b"NaN"]),
    ]
    return [rng.choice(pool)() for _ in range(CASES)]


class _Drop:
    pass


_DROP = _Drop()


def test_every_generated_malformed_record_is_refused_by_file_and_line(tmp_path):
    rng = random.Random(SEED)
    good_line = json.dumps(GOOD).encode()
    for n, bad in enumerate(_mutations(rng)):
        path = tmp_path / f"case-{n}.jsonl"
        before = rng.randint(0, 3)
        path.write_bytes(b"\n".join([good_line] * before + [bad, good_line]) + b"\n")
        with pytest.raises(RecordError) as err:
            check_file(path)
        assert err.value.path == str(path) and err.value.line == before + 1, (bad, str(err.value))
        skipped = check_file(path, skip_invalid=True)
        assert skipped.valid == before + 1 and skipped.skip == {before + 1}
        assert sum(1 for _ in skipped.records()) == before + 1


def test_a_damaged_compressed_file_is_refused_before_anything_is_read_into_the_store(tmp_path):
    rng = random.Random(SEED)
    lines = [json.dumps(t.to_dict()) for t in generate(60, seed=1, envs=["shop"], length_scale=0.1)]
    raw = gzip.compress(("\n".join(lines) + "\n").encode())
    for n in range(20):
        damaged = bytearray(raw)
        where = rng.randrange(10, len(damaged))
        damaged[where] ^= 1 << rng.randrange(8)
        path = tmp_path / f"d{n}.jsonl.gz"
        path.write_bytes(bytes(damaged))
        with pytest.raises(RecordError):
            check_file(path)
        assert check_file(path, skip_invalid=True).valid in (0, 60)  # a bad checksum trusts none of it
    truncated = tmp_path / "cut.jsonl.gz"
    truncated.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(RecordError, match="cannot read"):
        check_file(truncated)


def test_hostile_batches_leave_the_store_as_it_was(tmp_path):
    rng = random.Random(SEED)
    trajs = list(generate(30, seed=2, envs=["shop", "sql"], length_scale=0.1))
    vecs = text_vectors([t.task for t in trajs], 32)
    with Memory.open(tmp_path / "m", MemoryConfig(), dim=32) as memory:
        memory.add_many(trajs[:10], vecs[:10])
        for _ in range(30):
            batch = list(range(10, 30))
            rng.shuffle(batch)
            batch = batch[: rng.randint(1, 8)]
            vectors = vecs[batch].copy()
            attack = rng.choice(["nan", "zero", "shape", "conflict"])
            items = [trajs[i] for i in batch]
            if attack == "nan":
                vectors[rng.randrange(len(batch)), 0] = float("nan")
            elif attack == "zero":
                vectors[rng.randrange(len(batch))] = 0.0
            elif attack == "shape":
                vectors = vectors[:, :16]
            else:
                items.append(json_copy_with_other_task(trajs[rng.randrange(10)]))
                vectors = __import__("numpy").vstack([vectors, vecs[:1]])
            with pytest.raises(LifeMemError if attack == "conflict" else ValueError):
                memory.add_many(items, vectors)
            assert len(memory) == 10
        assert memory.verify()["ok"]


def json_copy_with_other_task(traj):
    import dataclasses

    return dataclasses.replace(traj, task=traj.task + " (changed)")
