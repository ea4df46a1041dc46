"""TextWorldExpressEnv against the real textworld-express simulator (a JVM per instance)."""

from __future__ import annotations

import os
import time

import pytest

pytest.importorskip("textworld_express", reason="textworld-express is not installed (pip install textworld-express)")

from lifemem_ray.lab.envs import Task, TaskError, make_env
from lifemem_ray.lab.envs.twx import VARIANTS, TextWorldExpressEnv


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as fh:
            return "zombie" not in fh.read()
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def coin():
    env = TextWorldExpressEnv("coin", n_train=6, n_test=4)
    try:
        yield env
    finally:
        env.close()


def test_tasks_deterministic_and_split(coin):
    train, test = coin.tasks("train"), coin.tasks("test")
    assert len(train) == 6 and len(test) == 4
    assert {t.split for t in train} == {"train"} and {t.split for t in test} == {"test"}
    ids = [t.id for t in train + test]
    assert len(set(ids)) == len(ids)
    assert train[0].id == "coin-train-0" and test[0].id.startswith("coin-test-")
    assert all(t.env == "twx-coin" and "coin" in t.instruction and t.metadata["task_type"] == "coin" for t in train)
    assert train[0].payload == {"game": "coin", "seed": 0, "fold": "train", "params": coin.game_params}
    assert coin.game_params["numLocations"] == 4
    assert coin.tasks("train", limit=2) == train[:2]
    shuffled = coin.tasks("train", seed=3)
    assert shuffled == coin.tasks("train", seed=3) and sorted(t.id for t in shuffled) == sorted(t.id for t in train)
    with pytest.raises(ValueError, match="split"):
        coin.tasks("dev")
    with TextWorldExpressEnv("coin", n_train=6, n_test=4) as again:
        assert [(t.id, t.instruction, t.payload) for t in again.tasks("train")] == [
            (t.id, t.instruction, t.payload) for t in train
        ]


def test_reset_gives_instruction_and_valid_actions(coin):
    task = coin.tasks("train")[1]
    obs, info = coin.reset(task)
    assert obs.strip() and info["instruction"] == task.instruction
    assert info["valid_actions"] and all(isinstance(a, str) for a in info["valid_actions"])
    assert "look around" in info["valid_actions"] and info["success"] is None


def test_invalid_actions_count_and_end_at_max_steps(coin):
    env, default = coin, coin.max_steps
    env.max_steps = 5
    try:
        env.reset(env.tasks("train")[0])
        for bad in ["fly to the moon", "", "move north\nmove south", "x" * 10_000]:
            r = env.step(bad)
            assert not r.done and r.reward == 0.0 and ("not sure" in r.observation or "Invalid" in r.observation)
            assert r.info["valid_actions"]
        r = env.step(None)  # type: ignore[arg-type]  # not text at all: still an observation
        assert r.done and r.info["success"] is False
        assert env.step("look around").done  # past the end: no crash
    finally:
        env.max_steps = default


def test_bad_tasks_and_params_rejected(coin):
    task = coin.tasks("train")[0]
    with pytest.raises(TaskError, match="belongs"):
        coin.reset(Task(env="twx-sorting", id="x", instruction="y", payload=task.payload))
    with pytest.raises(TaskError, match="seed"):
        coin.reset(Task(env="twx-coin", id="x", instruction="y", payload={**task.payload, "seed": "3"}))
    with pytest.raises(TaskError, match="numLocations"):
        coin.reset(
            Task(env="twx-coin", id="x", instruction="y", payload={**task.payload, "params": {"numLocations": 99}})
        )
    with pytest.raises(ValueError, match="variant"):
        TextWorldExpressEnv("nosuchgame")


@pytest.mark.parametrize("variant", VARIANTS)
def test_gold_replay_succeeds(variant):
    with make_env(f"twx-{variant}", n_train=2, n_test=1) as env:
        assert env.name == f"twx-{variant}"
        for task in env.tasks("train") + env.tasks("test"):
            env.reset(task)
            gold = env.gold_actions(task)
            assert gold and len(gold) < env.max_steps
            result = None
            for action in gold:
                result = env.step(action)
                if result.done:
                    break
            assert result is not None and result.done and result.info["success"] is True, (task.id, gold)


def test_gold_of_another_task_keeps_the_episode(coin):
    a, b = coin.tasks("train")[2], coin.tasks("train")[3]
    coin.reset(a)
    gold = coin.gold_actions(a)
    coin.step(gold[0])
    assert coin.gold_actions(b) != gold or a.payload == b.payload
    for action in gold[1:]:
        r = coin.step(action)
    assert r.done and r.info["success"] is True


def test_close_stops_the_jvm():
    before = os.environ.get("JAVA_TOOL_OPTIONS")
    env = TextWorldExpressEnv("sorting", n_train=1, n_test=1)
    env.reset(env.tasks("train")[0])
    pid = env.jvm_pid
    assert pid is not None and _alive(pid)
    env.close()
    deadline = time.time() + 5
    while _alive(pid) and time.time() < deadline:
        time.sleep(0.05)
    assert not _alive(pid) and env.jvm_pid is None
    env.close()  # twice is fine
    assert os.environ.get("JAVA_TOOL_OPTIONS") == before  # the heap cap is not leaked to other processes
