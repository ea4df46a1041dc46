"""ScienceWorldEnv over the real simulator (two JVM starts, ~30 s on an idle machine; skips without the package or Java)."""

from __future__ import annotations

import os
import shutil
import sys

import pytest

pytest.importorskip("scienceworld", reason="scienceworld is not installed (pip install scienceworld)")
if not (os.environ.get("JAVA_HOME") or shutil.which("java")):
    pytest.skip(
        "no Java runtime for ScienceWorld (apt-get install -y openjdk-17-jre-headless)", allow_module_level=True
    )

from lifemem_ray.lab.envs import EnvUnavailable, Task, TaskError, make_env
from lifemem_ray.lab.envs.scienceworld import ScienceWorldEnv

KINDS = ["find-non-living-thing", "lifespan-longest-lived", "power-component"]


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def env():
    e = ScienceWorldEnv(
        task_names=KINDS, variations_per_task_train=2, variations_per_task_test=1, list_valid_actions=False
    )
    try:
        yield e
    finally:
        e.close()


def test_tasks_deterministic_and_split(env):
    train, test = env.tasks("train"), env.tasks("test")
    assert len(train) == 6 and len(test) == 3
    assert {t.split for t in train} == {"train"} and {t.split for t in test} == {"test"}
    ids = [t.id for t in train + test]
    assert len(set(ids)) == len(ids)
    assert all(t.env == "scienceworld" and t.instruction.startswith("Your task is") for t in train + test)
    assert sorted(t.metadata["task_type"] for t in train) == sorted(KINDS * 2)
    # The package's folds: train variations come first, test variations from the last quarter.
    assert max(t.payload["variation"] for t in train) < min(t.payload["variation"] for t in test)
    assert env.tasks("train") == train
    shuffled = env.tasks("train", seed=3)
    assert shuffled == env.tasks("train", seed=3) and sorted(shuffled, key=lambda t: t.id) == sorted(
        train, key=lambda t: t.id
    )
    assert env.tasks("train", limit=2) == train[:2]
    assert "find-non-living-thing-train-0" in ids
    with pytest.raises(ValueError, match="split"):
        env.tasks("dev")


def test_reset_gives_instruction_and_valid_actions(env):
    task = env.tasks("test")[0]
    env.list_valid_actions = True  # off elsewhere: listing them is most of a step's cost
    try:
        obs, info = env.reset(task)
        step = env.step("look around")
    finally:
        env.list_valid_actions = False
    assert isinstance(step.info["valid_actions"], list) and step.info["valid_actions"]
    assert "This room is called" in obs
    assert info["instruction"] == task.instruction and info["success"] is None and info["score"] == 0.0
    assert isinstance(info["valid_actions"], list) and "look around" in info["valid_actions"]
    assert all(isinstance(a, str) for a in info["valid_actions"])


def test_invalid_actions_are_steps(env):
    task = env.tasks("train", limit=1)[0]
    env.reset(task)
    saved = env.max_steps
    env.max_steps = 6
    try:
        for bad in ["xyzzy plugh", "", None, 42, "go to\n\nnowhere " * 500, "\x00\x01 focus"]:
            result = env.step(bad)  # type: ignore[arg-type]
            assert isinstance(result.observation, str) and result.observation
            assert result.reward == 0.0
        assert result.done and result.info["success"] is False  # the sixth step hits max_steps
        after = env.step("look around")
        assert after.done and "over" in after.observation
    finally:
        env.max_steps = saved


def test_focusing_on_the_wrong_thing_fails(env):
    task = next(t for t in env.tasks("train") if t.metadata["task_type"] == "lifespan-longest-lived")
    env.reset(task)
    result = env.step("focus on agent")
    assert result.done and result.info["success"] is False and result.reward < 0


def test_gold_actions_reach_success(env):
    tasks = env.tasks("train", limit=2) + env.tasks("test", limit=1)
    for task in tasks:
        gold = env.gold_actions(task)
        assert gold and len(gold) <= env.max_steps, task.id
        env.reset(task)
        total = 0.0
        for i, action in enumerate(gold):  # noqa: B007 - i: how far it got, in the message below
            result = env.step(action)
            total += result.reward
            if result.done:
                break
        assert result.done and result.info["success"] is True, (task.id, gold[: i + 1], result.observation)
        assert total == pytest.approx(1.0) and result.info["score"] == 1.0


def test_gold_of_another_task_keeps_the_running_episode(env):
    first, second = env.tasks("train")[:2]
    gold = env.gold_actions(first)
    env.reset(first)
    env.step(gold[0])
    assert env.gold_actions(second)  # reloads the simulator; the episode is replayed
    for action in gold[1:]:
        result = env.step(action)
        if result.done:
            break
    assert result.info["success"] is True


def test_bad_tasks_raise_task_error(env):
    good = env.tasks("train", limit=1)[0]
    with pytest.raises(TaskError, match="belongs to"):
        env.reset(Task(env="alfworld", id="x", instruction="x", payload=good.payload))
    with pytest.raises(TaskError, match="task_name"):
        env.reset(Task(env="scienceworld", id="x", instruction="x", payload={"task_name": "fly", "variation": 0}))
    with pytest.raises(TaskError, match="variation"):
        env.reset(
            Task(env="scienceworld", id="x", instruction="x", payload={"task_name": "find-plant", "variation": "0"})
        )
    with pytest.raises(ValueError, match="unknown task name"):
        ScienceWorldEnv(task_names=["fly-to-the-moon"])


def test_close_kills_the_jvm_and_tasks_are_stable_across_instances(env):
    other = make_env("scienceworld", task_names=KINDS[:1], variations_per_task_train=2, variations_per_task_test=1)
    try:
        assert isinstance(other, ScienceWorldEnv)
        assert other.tasks("test") == [t for t in env.tasks("test") if t.metadata["task_type"] == KINDS[0]]
        pid = other.jvm_pid
        assert pid is not None and _alive(pid)
    finally:
        other.close()
    assert not _alive(pid), f"JVM {pid} still runs after close()"
    other.close()  # twice is fine
    with pytest.raises(RuntimeError, match="reset"):
        other.step("look around")


def test_missing_package_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "scienceworld", None)
    with pytest.raises(EnvUnavailable, match="pip install scienceworld"):
        ScienceWorldEnv()
