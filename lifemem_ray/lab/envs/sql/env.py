"""The SQL environment (:class:`SqlEnv`): one episode per task on a fresh in-memory SQLite,
statements reaching outside the database refused (an authorizer), runaway ones interrupted."""

from __future__ import annotations

import dataclasses
import re
import sqlite3
from collections.abc import Callable
from typing import Any

from lifemem_ray.core.errors import InvalidArgumentError
from lifemem_ray.core.lru import LruCache
from lifemem_ray.lab.envs.base import Environment, EnvStateError, StepResult, Task, TaskError, check_task, select_tasks
from lifemem_ray.lab.envs.sql.database import (
    MAX_ROWS_SHOWN,
    build_db,
    parse_action,
    parse_answer,
    render_rows,
    rows_equal,
    snapshot,
    sorted_or_not,
)
from lifemem_ray.lab.envs.sql.tasks import MODIFY_TYPES, TASK_TYPES, generate_task

MAX_VM_STEPS = 2_000_000  # progress-handler budget of one statement (~0.1-0.5 s)
_READ_ONLY_PRAGMAS = frozenset(
    {"table_info", "table_xinfo", "table_list", "index_list", "index_info", "index_xinfo", "foreign_key_list"}
)
_FORBIDDEN = re.compile(r"^\s*(attach|detach|vacuum)\b|\b(load_extension)\s*\(", re.I)
SQL_COMMENT = re.compile(r"/\*.*?(?:\*/|$)|--[^\n]*", re.S)

PROTOCOL = (
    "Reply with one action per turn.\n"
    "To run one SQL statement:\nAction: Operation\n```sql\nSELECT ...;\n```\n"
    "To finish:\nAction: Answer\nFinal Answer: [(value, ...), ...]\n"
    "(Short forms: 'Operation: <sql>' and 'Answer: <value>'.) The database is SQLite. "
    "For a question about modifying the database, the answer can be anything once the change is made."
)


class SqlEnv(Environment):
    """Generated SQL tasks on a fresh in-memory SQLite database per episode.

    ``n_train``/``n_test`` tasks per split, generated from ``seed`` (same seed, same
    tasks, ids ``sql-s<seed>-<split>-<index>``); ``max_steps`` actions per episode.
    """

    name = "sql"

    def __init__(self, n_train: int = 60, n_test: int = 20, seed: int = 0, max_steps: int = 8) -> None:
        for label, value, low in (("n_train", n_train, 0), ("n_test", n_test, 0), ("max_steps", max_steps, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidArgumentError(f"{label} must be an integer >= {low}, got {value!r}", where="SqlEnv")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise InvalidArgumentError(f"seed must be an integer, got {seed!r}", where="SqlEnv")
        self.n_train, self.n_test, self.seed, self.max_steps = n_train, n_test, seed, max_steps
        self._tasks: dict[str, list[Task]] = {}
        self._conn: sqlite3.Connection | None = None
        self._task: Task | None = None
        self._steps = 0
        self._done = True
        self._expected: list[tuple] | None = None
        self._expected_state: dict[str, list[tuple]] | None = None
        self._width = 1
        self._ref_cache: LruCache[
            str, tuple[dict[str, Any], tuple[list[tuple], dict[str, list[tuple]] | None, int]]
        ] = LruCache(512, "SqlEnv references")

    # -- tasks

    def _split(self, split: str) -> list[Task]:
        if split not in ("train", "test"):
            raise InvalidArgumentError(f"split must be 'train' or 'test', got {split!r}", where="SqlEnv.tasks")
        if split not in self._tasks:
            n = self.n_train if split == "train" else self.n_test
            self._tasks[split] = [generate_task(self.seed, split, i) for i in range(n)]
        return self._tasks[split]

    def tasks(self, split: str = "train", limit: int | None = None, seed: int = 0) -> list[Task]:
        """The split's tasks: generation order for ``seed=0`` (kinds cycle), else shuffled by ``seed``."""
        out = [
            t if t.env == self.name else dataclasses.replace(t, env=self.name) for t in self._split(split)
        ]  # under an alias name
        return select_tasks("SqlEnv", {split: out}, split, limit, seed)

    # -- episodes

    def _check_task(self, task: Task) -> None:
        check_task("SqlEnv", task, self.name)
        p = task.payload
        missing = [k for k in ("kind", "schema", "tables", "gold_sql") if k not in p]
        if missing:
            raise TaskError(f"task {task.id!r} payload lacks {', '.join(missing)}", where="SqlEnv.reset")
        if p["kind"] not in TASK_TYPES:
            raise TaskError(f"task {task.id!r} has unknown kind {p['kind']!r}", where="SqlEnv.reset")
        if (
            not isinstance(p["gold_sql"], list)
            or not p["gold_sql"]
            or not all(isinstance(s, str) for s in p["gold_sql"])
        ):
            raise TaskError(f"task {task.id!r} gold_sql must be a non-empty list of strings", where="SqlEnv.reset")

    def _reference(self, task: Task) -> tuple[list[tuple], dict[str, list[tuple]] | None, int]:
        """The gold result (last statement's rows), the table state after the gold SQL (modifications only), the result width.

        Cached per task id (and checked against the payload), since every reset and gold_actions needs it.
        """
        hit = self._ref_cache.get(task.id)
        if hit is not None and (hit[0] is task.payload or hit[0] == task.payload):
            return hit[1]
        ref = self._compute_reference(task)
        self._ref_cache.put(task.id, (task.payload, ref))
        return ref

    def _compute_reference(self, task: Task) -> tuple[list[tuple], dict[str, list[tuple]] | None, int]:
        try:
            conn = build_db(task.payload)
        except (sqlite3.Error, TypeError, AttributeError, ValueError) as exc:
            raise TaskError(f"task {task.id!r}: cannot build its database: {exc}", where="SqlEnv") from None
        try:
            result: list[tuple] = []
            width = 1
            for stmt in task.payload["gold_sql"]:
                cur = conn.execute(stmt)
                if cur.description:
                    width = len(cur.description)
                result = [tuple(r) for r in cur.fetchall()]
            state = snapshot(conn) if task.payload["kind"] in MODIFY_TYPES else None
            return result, state, width
        except sqlite3.Error as exc:
            raise TaskError(f"task {task.id!r}: gold SQL fails: {exc}", where="SqlEnv") from None
        finally:
            conn.close()

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """A fresh database for ``task``; the first observation holds the question, the schemas and the protocol."""
        self._check_task(task)
        self._close_conn()
        expected, state, width = self._reference(task)
        try:
            conn = build_db(task.payload)
        except (sqlite3.Error, TypeError, AttributeError, ValueError) as exc:
            raise TaskError(f"task {task.id!r}: cannot build its database: {exc}", where="SqlEnv.reset") from None
        conn.set_authorizer(_authorizer)
        conn.set_progress_handler(_budget(), 1000)
        conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, 1_000_000)
        self._conn = conn
        self._task, self._steps, self._done = task, 0, False
        self._expected, self._expected_state, self._width = sorted_or_not(expected, task), state, width
        schema = "\n".join(s + ";" for s in task.payload["schema"])
        obs = f"{task.instruction}\n\nSchema:\n{schema}\n\n{PROTOCOL}"
        return obs, {
            "instruction": task.instruction,
            "valid_actions": None,
            "success": None,
            "task_type": task.payload["kind"],
        }

    def step(self, action: str) -> StepResult:
        """Run one Operation or judge an Answer; anything else is an invalid action (a step)."""
        if self._task is None or self._conn is None:
            raise EnvStateError("no episode running; call reset(task) first", where="SqlEnv.step")
        if self._done:
            raise EnvStateError(f"episode of task {self._task.id!r} is over; call reset(task)", where="SqlEnv.step")
        self._steps += 1
        info: dict[str, Any] = {"instruction": self._task.instruction, "valid_actions": None, "success": None}
        body: str | None
        if not isinstance(action, str):
            kind, body = "invalid", f"the action must be text, got {type(action).__name__}"
        else:
            kind, body = parse_action(action)
        reward, done = 0.0, False
        if kind == "invalid":
            obs = f"Invalid action: {body}."
        elif kind == "operation":
            obs = self._execute(body or "")
        else:
            success = self._judge(body or "")
            obs = "Answer submitted: correct." if success else "Answer submitted: incorrect."
            reward, done = (1.0 if success else 0.0), True
            info["success"] = success
        if not done and self._steps >= self.max_steps:
            done = True
            info["success"] = False
            obs += f"\nStep limit ({self.max_steps}) reached without an answer."
        info["score"] = reward if done else None
        self._done = done
        return StepResult(obs, reward, done, info)

    def _execute(self, sql: str) -> str:
        assert self._conn is not None
        bad = _FORBIDDEN.search(SQL_COMMENT.sub(" ", sql))
        if bad:
            word = (bad.group(1) or bad.group(2)).upper()
            return f"Refused: {word} is not allowed; only this task's database can be used."
        self._conn.set_progress_handler(_budget(), 1000)
        try:
            if not sqlite3.complete_statement(sql if sql.rstrip().endswith(";") else sql + ";"):
                return "Error: incomplete SQL statement."
            cur = self._conn.execute(sql)
            rows = cur.fetchmany(MAX_ROWS_SHOWN + 1)
            total = len(rows)
            if total > MAX_ROWS_SHOWN:
                rows = rows[:MAX_ROWS_SHOWN]
                try:
                    for _ in cur:  # count the rest (bounded by the progress handler)
                        total += 1
                except sqlite3.Error:
                    total = -total  # interrupted: only a lower bound
        except sqlite3.Error as exc:
            msg = str(exc)
            if "not authorized" in msg or "prohibited" in msg:
                return "Refused: this statement reaches outside the task's database (ATTACH, PRAGMA writes and extensions are not allowed)."
            if "interrupted" in msg:
                return "Error: the statement ran too long and was interrupted."
            return f"Error: {msg}"
        except sqlite3.Warning as exc:  # e.g. several statements at once (older Pythons)
            return f"Error: {exc}"
        except (OverflowError, MemoryError, ValueError) as exc:
            return f"Error: {type(exc).__name__}: {exc}"
        return render_rows([tuple(r) for r in rows], total)

    def _judge(self, answer: str) -> bool:
        assert self._task is not None and self._conn is not None
        if self._task.payload["kind"] in MODIFY_TYPES:
            self._conn.set_authorizer(None)
            try:
                return snapshot(self._conn) == self._expected_state
            except sqlite3.Error:
                return False
        got = parse_answer(answer, self._width)
        if got is None:
            return False
        if not self._task.payload.get("ordered"):
            got = sorted(got, key=repr)
        return rows_equal(got, self._expected or [])

    def gold_actions(self, task: Task) -> list[str] | None:
        """The gold SQL as Operations, then the gold result (``[]`` for modifications) as the answer."""
        self._check_task(task)
        result, _, _ = self._reference(task)
        ops = [f"Action: Operation\n```sql\n{s};\n```" for s in task.payload["gold_sql"]]
        answer = "[]" if task.payload["kind"] in MODIFY_TYPES else repr(result)
        return [*ops, f"Action: Answer\nFinal Answer: {answer}"]

    def _close_conn(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def close(self) -> None:
        """Drop the episode's database (nothing else is held)."""
        self._close_conn()
        self._task, self._done = None, True


def _budget() -> Callable[[], int]:
    """A progress handler that interrupts a statement after ~MAX_VM_STEPS virtual-machine steps."""
    calls = [0]

    def handler() -> int:
        calls[0] += 1
        return 1 if calls[0] * 1000 > MAX_VM_STEPS else 0

    return handler


def _authorizer(action: int, arg1: str | None, arg2: str | None, dbname: str | None, source: str | None) -> int:
    """Deny what reaches beyond this in-memory database: ATTACH/DETACH, PRAGMA writes, load_extension."""
    if action in (sqlite3.SQLITE_ATTACH, sqlite3.SQLITE_DETACH):
        return sqlite3.SQLITE_DENY
    if action == sqlite3.SQLITE_PRAGMA:
        return sqlite3.SQLITE_OK if (arg1 or "").lower() in _READ_ONLY_PRAGMAS else sqlite3.SQLITE_DENY
    if action == sqlite3.SQLITE_FUNCTION and (arg2 or "").lower() == "load_extension":
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK
