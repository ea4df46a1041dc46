"""AlfWorldEnv against the real ALFWorld TextWorld engine and the shared game files.

A game costs about a second to load (PDDL translation) and steps tens of milliseconds, so
the episodes here use the smallest games (bathrooms, living rooms) and one engine.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from lifemem_ray.lab.envs import EnvUnavailable, Task, TaskError, make_env
from lifemem_ray.lab.envs.alfworld import TASK_TYPES, AlfWorldEnv

# Not importorskip: importing alfworld sets ALFWORLD_DATA (and creates ~/.cache/alfworld).
for _package in ("alfworld", "textworld", "fast_downward"):
    if importlib.util.find_spec(_package) is None:
        pytest.skip(f"{_package} is not installed (pip install alfworld)", allow_module_level=True)

SHARED = Path(os.environ.get("LIFEMEM_SHARED_DIR", Path(__file__).resolve().parents[4] / "shared"))
DATA = Path(os.environ.get("ALFWORLD_DATA") or SHARED / "data" / "alfworld")
if not (DATA / "json_2.1.1").is_dir():
    pytest.skip(f"ALFWorld game files not found at {DATA} (shared data/alfworld)", allow_module_level=True)


@pytest.fixture(scope="module")
def env():
    e = AlfWorldEnv(data_dir=DATA)
    try:
        yield e
    finally:
        e.close()


def _smallest(env: AlfWorldEnv, task_type: str, n: int = 1) -> list[Task]:
    """The ``n`` cheapest games of a type (the engine's cost grows with the room)."""
    tasks = [t for t in env.tasks("train") if t.metadata["task_type"] == task_type]
    return sorted(tasks, key=lambda t: ((DATA / t.payload["game_file"]).stat().st_size, t.id))[:n]


def test_tasks_fixed_partition(env):
    train, test = env.tasks("train"), env.tasks("test")
    assert len(train) == 340 and len(test) == 134  # ALFWorld's solvable games: valid_train+valid_seen | valid_unseen
    assert {t.split for t in train} == {"train"} and {t.split for t in test} == {"test"}
    assert {t.metadata["source_split"] for t in train} == {"valid_train", "valid_seen"}
    assert {t.metadata["source_split"] for t in test} == {"valid_unseen"}
    ids = [t.id for t in train + test]
    assert len(set(ids)) == len(ids)
    assert {t.metadata["task_type"] for t in train[:6]} == set(TASK_TYPES)  # types interleaved
    assert set(Counter(t.metadata["task_type"] for t in test)) == set(TASK_TYPES)
    assert all(t.env == "alfworld" and t.instruction.strip() and t.instruction.endswith(".") for t in train + test)
    again = make_env("alfworld", data_dir=str(DATA))
    try:
        assert again.tasks("train") == train and again.tasks("test") == test
    finally:
        again.close()
    assert env.tasks("train", limit=5) == train[:5]
    shuffled = env.tasks("test", seed=3)
    assert shuffled == env.tasks("test", seed=3) != test and sorted(t.id for t in shuffled) == sorted(
        t.id for t in test
    )
    with pytest.raises(ValueError, match="split"):
        env.tasks("valid_seen")


def test_reset_invalid_actions_and_max_steps(env):
    task = _smallest(env, "pick_and_place_simple")[0]
    obs, info = env.reset(task)
    assert f"Your task is to: {task.instruction}" in obs and "Welcome" not in obs
    assert info["instruction"] == task.instruction and info["success"] is None
    assert "look" in info["valid_actions"] and any(a.startswith("go to ") for a in info["valid_actions"])
    default = env.max_steps
    env.max_steps = 4
    try:
        for bad in ["fly to the moon", "", None, "go to\nnowhere"]:
            r = env.step(bad)  # type: ignore[arg-type]
            assert r.observation.startswith("Nothing happens.") and r.reward == 0.0
        assert r.done and r.info["success"] is False  # four invalid actions used the four steps
        assert env.step("look").done
    finally:
        env.max_steps = default
    with pytest.raises(TaskError, match="game_file"):
        env.reset(Task(env="alfworld", id="x", instruction="y", payload={"game_file": "../../etc/passwd"}))
    with pytest.raises(TaskError, match="belongs"):
        env.reset(Task(env="twx-coin", id="x", instruction="y", payload=task.payload))


@pytest.mark.parametrize(
    "task_type", ["pick_and_place_simple", "look_at_obj_in_light", "pick_clean_then_place_in_recep"]
)
def test_gold_replay_succeeds(env, task_type):
    argv = list(sys.argv)
    task = _smallest(env, task_type)[0]
    env.reset(task)
    gold = env.gold_actions(task)
    assert gold and len(gold) < env.max_steps
    result = None
    for action in gold:
        result = env.step(action)
        if result.done:
            break
    assert result is not None and result.done and result.info["success"] is True and result.reward == 1.0, (
        task.id,
        gold,
    )
    assert sys.argv == argv  # fast-downward's translator rewrites sys.argv; the adapter restores it


def test_gold_of_another_task_keeps_the_episode(env):
    a, b = _smallest(env, "pick_and_place_simple", 2)
    env.reset(a)
    gold_a = env.gold_actions(a)
    first = env.step(gold_a[0])
    assert not first.done
    gold_b = env.gold_actions(b)
    assert gold_b and gold_b != gold_a
    for action in gold_a[1:]:
        r = env.step(action)
    assert r.done and r.info["success"] is True


def test_put_aliases(env):
    task = _smallest(env, "pick_and_place_simple")[0]
    env.reset(task)
    gold = env.gold_actions(task)
    *moves, put = gold
    assert put.startswith("put ") and " in/on " in put
    for action in moves:
        env.step(action)
    obj, recep = put[len("put ") :].split(" in/on ")
    r = env.step(f"Put {obj} on {recep}.")
    assert r.done and r.info["success"] is True


def test_close_frees_the_engine(env, tmp_path):
    before = os.environ.get("ALFWORLD_DATA")
    e = AlfWorldEnv(data_dir=DATA, max_steps=5)
    assert os.environ.get("ALFWORLD_DATA") == before  # importing alfworld sets it; the adapter restores it
    task = _smallest(env, "look_at_obj_in_light")[0]
    try:
        e.reset(task)
    finally:
        e.close()
    assert e._engine is None
    e.close()  # twice is fine
    obs, _ = e.reset(task)  # a closed instance starts a new engine when used again
    assert task.instruction in obs
    e.close()
    # An engine that ran a game and was closed must let the interpreter exit cleanly.
    code = (
        "import sys; from lifemem_ray.lab.envs.alfworld import AlfWorldEnv; from lifemem_ray.lab.envs import Task; "
        f"e = AlfWorldEnv(data_dir={str(DATA)!r}); "
        f"e.reset(Task(env='alfworld', id='t', instruction='x', payload={{'game_file': {task.payload['game_file']!r}}})); e.close()"
    )
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with pytest.raises(EnvUnavailable, match="no game files"):
        AlfWorldEnv(data_dir=tmp_path)
