"""BfclEnv: tasks and splits, turn handling, error handling, gold replay and agreement with BFCL's checker."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("bfcl_eval", reason="bfcl-eval not installed: pip install --no-deps bfcl-eval mpmath==1.3.0")

from lifemem_ray.lab.envs import TaskError, make_env
from lifemem_ray.lab.envs.bfcl import BfclEnv

ALL = ("multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param", "multi_turn_long_context")


@pytest.fixture()
def env():
    environment = make_env("bfcl")
    try:
        yield environment
    finally:
        environment.close()


def test_tasks_deterministic_and_split(env: BfclEnv) -> None:
    train, test = env.tasks("train"), env.tasks("test")
    assert (len(train), len(test)) == (140, 60)
    assert [t.id for t in train] == [t.id for t in BfclEnv().tasks("train")]
    assert {t.id for t in train}.isdisjoint({t.id for t in test})
    assert len({t.id for t in train + test}) == 200
    assert all(t.env == "bfcl" and t.instruction.strip() and t.metadata["task_type"] for t in train + test)
    assert [t.id for t in env.tasks("test", limit=4, seed=2)] == [t.id for t in env.tasks("test", seed=2)][:4]
    assert {t.id for t in BfclEnv(seed=1).tasks("train")} != {t.id for t in train}


def test_reset_turns_and_invalid_actions(env: BfclEnv) -> None:
    task = next(t for t in env.tasks("train") if "GorillaFileSystem" in t.metadata["involved_classes"])
    obs, info = env.reset(task)
    assert obs == task.instruction == info["instruction"]
    assert "cd(folder)" in info["valid_actions"] and "finish_turn" in info["valid_actions"]
    for bad in ["cd(", "cd(folder=some_name)", "print('x'); ls()", "", "[1, 2]"]:
        result = env.step(bad)
        assert result.observation.startswith("Error") and not result.done
    assert env.step("no_such_function()").observation.startswith("Error during execution")
    assert env.step("cd()").observation.startswith("Error during execution")  # missing argument
    assert "current_directory_content" in env.step('{"name": "ls", "arguments": {"a": true}}').observation
    assert env.step("[pwd(), ls()]").observation.count("->") == 2
    result = env.step("finish_turn")
    assert not result.done and result.observation == env._turn_text(env._entry, 1, []) and result.info["turn"] == 1
    with pytest.raises(TaskError):
        env.reset(make_env("bfcl", categories=("multi_turn_miss_func",)).tasks("test", limit=1)[0])


def test_gold_replay_succeeds_in_every_category() -> None:
    env = BfclEnv(categories=ALL)
    try:
        tasks = env.tasks("train", limit=8, seed=5) + env.tasks("test", limit=4, seed=5)
        assert {t.metadata["category"] for t in env.tasks("test")} == set(ALL)
        for task in tasks:
            env.reset(task)
            for action in env.gold_actions(task):
                result = env.step(action)
            assert result.done and result.info["success"] is True and result.reward == 1.0, (
                task.id,
                result.info.get("failure"),
            )
    finally:
        env.close()


def test_verdicts_agree_with_bfcl_checker(env: BfclEnv) -> None:
    """A gold episode and one that skips a turn's calls: same verdict as BFCL's multi_turn_checker."""
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import (
        multi_turn_checker,
    )

    for task in env.tasks("test", limit=2):
        entry = env._entries["multi_turn_base"][task.payload["entry_id"]]
        gold = entry["ground_truth"]
        for skip in (None, 1):
            env.reset(task)
            decoded = []
            for turn, calls in enumerate(gold):
                steps = [] if turn == skip else [[c] for c in calls]
                for (call,) in steps:
                    env.step(call)
                result = env.step("finish_turn")
                decoded.append(steps)
            reference = multi_turn_checker(decoded, gold, dict(entry), "multi_turn_base", f"lifemem_test_{skip}")
            assert result.done and result.info["success"] is reference["valid"], (task.id, skip, reference)
            if skip is not None:
                assert result.info["failure"]["error_type"] == reference["error_type"]


def test_turn_step_limit_force_terminates() -> None:
    env = BfclEnv(max_steps_per_turn=3)
    try:
        env.reset(env.tasks("test", limit=1)[0])
        assert not env.step("pwd()").done and not env.step("pwd()").done
        last = env.step("pwd()")
        assert (
            last.done
            and last.info["success"] is False
            and last.info["failure"]["error_type"] == "multi_turn:force_terminated"
        )
        assert env.step("finish_turn").done  # after the end: still done, no crash
    finally:
        env.close()
        env.close()


def test_module_imports_without_bfcl() -> None:
    code = (
        "import sys; sys.modules['bfcl_eval'] = None\n"
        "from lifemem_ray.lab.envs.bfcl import BfclEnv\n"
        "from lifemem_ray.lab.envs import EnvUnavailable\n"
        "try:\n    BfclEnv()\nexcept EnvUnavailable as e:\n    print('unavailable:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "unavailable:" in out.stdout and "pip install --no-deps bfcl-eval" in out.stdout


def test_gold_replay_all_800_entries() -> None:
    """Every ground truth of the four multi-turn categories replays to success (about 3 s)."""
    env = BfclEnv(categories=ALL)
    try:
        failed = []
        for task in env.tasks("train") + env.tasks("test"):
            env.reset(task)
            for action in env.gold_actions(task):
                result = env.step(action)
            if not (result.done and result.info["success"]):
                failed.append(task.id)
        assert failed == []
    finally:
        env.close()


def test_runaway_math_is_refused() -> None:
    env = BfclEnv()
    try:
        task = next(t for t in env.tasks("train") + env.tasks("test") if "MathAPI" in t.metadata["involved_classes"])
        env.reset(task)
        assert "at most" in env.step("power(base=10, exponent=1000000000000)").observation
        assert "at most" in env.step("logarithm(value=20, base=10, precision=1000000000)").observation
        assert '"result": 8' in env.step("power(2, 3)").observation
    finally:
        env.close()
