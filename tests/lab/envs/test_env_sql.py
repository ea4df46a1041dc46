"""SqlEnv: generated SQLite tasks in the LifelongAgentBench protocol (stdlib only, no skips)."""

from __future__ import annotations

import os
import sqlite3
from collections import Counter

import pytest

from lifemem_ray.lab.envs import Task, TaskError, make_env
from lifemem_ray.lab.envs.sql import TASK_TYPES, SqlEnv, parse_action
from lifemem_ray.lab.envs.sql.env import _authorizer


@pytest.fixture
def env():
    e = SqlEnv(n_train=21, n_test=7)
    try:
        yield e
    finally:
        e.close()


def test_tasks_deterministic_and_split(env):
    train, test = env.tasks("train"), env.tasks("test")
    assert len(train) == 21 and len(test) == 7
    assert {t.split for t in train} == {"train"} and {t.split for t in test} == {"test"}
    ids = [t.id for t in train + test]
    assert len(set(ids)) == len(ids)
    again = SqlEnv(n_train=21, n_test=7)
    assert [(t.id, t.instruction, t.payload) for t in again.tasks("train")] == [
        (t.id, t.instruction, t.payload) for t in train
    ]
    # A task does not depend on how many are generated; another seed gives other tasks.
    assert SqlEnv(n_train=3).tasks("train") == train[:3]
    assert SqlEnv(n_train=3, seed=1).tasks("train")[0].instruction != train[0].instruction
    assert Counter(t.metadata["task_type"] for t in train) == Counter({k: 3 for k in TASK_TYPES})
    assert all(t.env == "sql" and t.instruction.strip() for t in train)
    shuffled = env.tasks("train", seed=5)
    assert shuffled == env.tasks("train", seed=5) and sorted(t.id for t in shuffled) == sorted(ids[:21])
    assert env.tasks("train", limit=4) == train[:4]
    with pytest.raises(ValueError, match="split"):
        env.tasks("dev")


def test_registry_builds_it():
    e = make_env("sql", n_train=2, n_test=1)
    try:
        assert isinstance(e, SqlEnv) and len(e.tasks("test")) == 1
    finally:
        e.close()


def test_every_generated_gold_succeeds():
    e = SqlEnv()  # the defaults: 60 train + 20 test
    try:
        tasks = e.tasks("train") + e.tasks("test")
        assert len(tasks) == 80
        for task in tasks:
            e.reset(task)
            result = None
            for action in e.gold_actions(task):
                result = e.step(action)
            assert result is not None and result.done, task.id
            assert result.info["success"] is True and result.reward == 1.0, (task.id, task.instruction)
    finally:
        e.close()


def test_reset_shows_question_and_schema(env):
    task = env.tasks("train")[0]
    obs, info = env.reset(task)
    assert task.instruction in obs and "CREATE TABLE" in obs and "Action: Operation" in obs
    assert info["instruction"] == task.instruction and info["valid_actions"] is None


def test_invalid_actions_are_steps(env):
    env = SqlEnv(n_train=1, n_test=0, max_steps=3)
    env.reset(env.tasks()[0])
    r = env.step("I think I should look at the table")
    assert r.observation.startswith("Invalid action") and not r.done and r.reward == 0.0
    r = env.step(None)  # type: ignore[arg-type]
    assert r.observation.startswith("Invalid action") and not r.done
    r = env.step("Operation: SELEC nonsense")
    assert r.observation.startswith("Error:")
    assert r.done and r.info["success"] is False  # the third step hits max_steps
    with pytest.raises(RuntimeError, match="reset"):
        env.step("Answer: 1")


def test_wrong_answer_and_wrong_modification_fail(env):
    query = next(t for t in env.tasks() if t.metadata["task_type"] == "count")
    env.reset(query)
    r = env.step("Action: Answer\nFinal Answer: [(-12345,)]")
    assert r.done and r.info["success"] is False and r.reward == 0.0
    mod = next(t for t in env.tasks() if t.metadata["task_type"] == "delete")
    env.reset(mod)
    r = env.step("Answer: done")  # nothing was deleted
    assert r.done and r.info["success"] is False


def test_answer_forms_and_short_forms(env):
    task = next(t for t in env.tasks() if t.metadata["task_type"] == "count")
    gold = env.gold_actions(task)
    value = gold[-1].split("Final Answer:", 1)[1].strip()  # "[(n,)]"
    n = value.strip("[(,)]")
    for answer in (
        f"Answer: {n}",
        f"Final Answer: {n}",
        f"Action: Answer\nFinal Answer: [{n}]",
        f"Thought: counted.\nAction: Answer\nFinal Answer: {value}",
    ):
        env.reset(task)
        assert env.step("Operation: " + gold[0].split("```sql\n")[1].split("\n```")[0]).observation == value
        assert env.step(answer).info["success"] is True, answer
    assert parse_action("Operation: SELECT 1") == ("operation", "SELECT 1")
    assert parse_action("Action: Operation\n```sql\nSELECT 2;\n```\nmore text") == ("operation", "SELECT 2;")
    assert parse_action("Action: Answer")[0] == "invalid"


def test_unordered_answer_accepted_ordered_one_checked():
    e = SqlEnv(n_train=60, n_test=0)
    try:
        unordered = next(
            t
            for t in e.tasks()
            if t.metadata["task_type"] == "join" and not t.payload["ordered"] and "total" not in t.instruction
        )
        gold = e.gold_actions(unordered)
        rows = eval(gold[-1].split("Final Answer:", 1)[1])
        e.reset(unordered)
        assert e.step("Answer: " + repr(list(reversed(rows)))).info["success"] is True
        ordered = next(t for t in e.tasks() if t.payload["ordered"])
        rows = eval(e.gold_actions(ordered)[-1].split("Final Answer:", 1)[1])
        e.reset(ordered)
        assert e.step("Answer: " + repr(list(reversed(rows)))).info["success"] is False
    finally:
        e.close()


@pytest.mark.parametrize(
    "sql, word",
    [
        ("ATTACH DATABASE '/tmp/lifemem-sql-attack.db' AS x", "ATTACH"),
        ("/* hidden */ attach '/tmp/lifemem-sql-attack.db' as y", "ATTACH"),
        ("DETACH main", "DETACH"),
        ("VACUUM INTO '/tmp/lifemem-sql-attack.db'", "VACUUM"),
        ("SELECT load_extension('/tmp/evil.so')", "LOAD_EXTENSION"),
        ("PRAGMA journal_mode = WAL", "PRAGMA"),
        ("PRAGMA writable_schema = 1", "PRAGMA"),
    ],
)
def test_malicious_sql_refused(env, sql, word):
    env.reset(env.tasks()[0])
    r = env.step(f"Action: Operation\n```sql\n{sql};\n```")
    assert r.observation.startswith("Refused") and (word in r.observation or "PRAGMA" in r.observation), r.observation
    assert not r.done

    assert not os.path.exists("/tmp/lifemem-sql-attack.db")


def test_authorizer_backstop_and_limits(env):
    conn = sqlite3.connect(":memory:")
    conn.set_authorizer(_authorizer)
    with pytest.raises(sqlite3.DatabaseError):
        conn.execute("ATTACH DATABASE ':memory:' AS other")
    with pytest.raises(sqlite3.DatabaseError):
        conn.execute("PRAGMA foreign_keys = OFF")
    conn.close()
    env.reset(env.tasks()[0])
    r = env.step("Operation: PRAGMA table_info(" + env.tasks()[0].payload["schema"][1].split()[2] + ")")
    assert r.observation.startswith("[(0, ")  # read-only introspection is allowed
    r = env.step("Operation: WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT COUNT(*) FROM c")
    assert "interrupted" in r.observation
    r = env.step("Operation: SELECT 1; SELECT 2")
    assert r.observation.startswith("Error")


def test_fresh_database_per_reset(env):
    task = next(t for t in env.tasks() if t.metadata["task_type"] == "delete")
    table = task.payload["schema"][1].split()[2]
    env.reset(task)
    before = env.step(f"Operation: SELECT COUNT(*) FROM {table}").observation
    env.step(f"Operation: DELETE FROM {table}")
    env.reset(task)
    assert env.step(f"Operation: SELECT COUNT(*) FROM {table}").observation == before


def test_bad_tasks_rejected(env):
    with pytest.raises(TaskError, match="environment"):
        env.reset(Task(env="alfworld", id="x", instruction="q"))
    with pytest.raises(TaskError, match="payload"):
        env.reset(Task(env="sql", id="x", instruction="q", payload={}))
    with pytest.raises(RuntimeError, match="reset"):
        SqlEnv(n_train=0, n_test=0).step("Answer: 1")


def test_close_frees_connection(env):
    env.reset(env.tasks()[0])
    conn = env._conn
    env.close()
    env.close()  # twice is fine
    with pytest.raises(sqlite3.ProgrammingError):
        conn.execute("SELECT 1")
