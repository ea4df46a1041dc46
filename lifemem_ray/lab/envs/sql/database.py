"""The SQL environment's database and judging: an in-memory SQLite per task, actions parsed
(``Action: Operation`` + fenced SQL, ``Action: Answer`` + ``Final Answer:``, the short forms),
answers normalised and compared as LifelongAgentBench does, rows rendered for the observation."""

from __future__ import annotations

import ast
import math
import re
import sqlite3
from collections.abc import Sequence
from typing import Any

from lifemem_ray.lab.envs.base import Task

MAX_ROWS_SHOWN = 40
MAX_OBS_CHARS = 2000

_ACTION_LABEL = re.compile(r"Action\s*:\s*(Operation|Answer)\b", re.I)
_FENCE = re.compile(r"```[ \t]*(?:sql|sqlite|mysql)?[ \t]*\n?(.*?)```", re.I | re.S)
_FINAL = re.compile(r"Final\s+Answer\s*:\s*(.*)", re.I | re.S)
_SHORT = re.compile(r"^[ \t]*(Operation|Final\s+Answer|Answer)\s*:[ \t]*(.*)", re.I | re.M | re.S)


def build_db(payload: dict[str, Any]) -> sqlite3.Connection:
    conn = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
    for stmt in payload["schema"]:
        conn.execute(stmt)
    for table, rows in payload["tables"].items():
        if rows:
            marks = ", ".join("?" * len(rows[0]))
            conn.executemany(f"INSERT INTO {table} VALUES ({marks})", [tuple(r) for r in rows])
    return conn


def run_sql(conn: sqlite3.Connection, sql: str) -> list[tuple]:
    return [tuple(r) for r in conn.execute(sql).fetchall()]


def snapshot(conn: sqlite3.Connection) -> dict[str, list[tuple]]:
    """Every user table's rows as a sorted multiset of normalised tuples, plus its columns."""
    tables = [
        r[0]
        for r in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY name"
        )
    ]
    out: dict[str, list[tuple]] = {}
    for t in tables:
        cur = conn.execute(f'SELECT * FROM "{t}"')
        cols = tuple(d[0].lower() for d in cur.description)
        rows = sorted((norm_row(r) for r in cur.fetchall()), key=repr)
        out[t.lower()] = [cols, *rows]
    return out


def norm_value(v: Any) -> Any:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        if isinstance(v, float) and not math.isfinite(v):
            return str(v)
        return round(float(v), 2) + 0.0
    if v is None:
        return None
    if isinstance(v, bytes):
        return v.hex()
    s = " ".join(str(v).split()).lower()
    if not s or s[0] not in "0123456789+-.":  # fast path: plain text
        return s
    num = s.replace(",", "") if re.fullmatch(r"[-+]?\d{1,3}(,\d{3})+(\.\d+)?", s) else s
    try:
        f = float(num)
    except ValueError:
        return s
    return round(f, 2) + 0.0 if math.isfinite(f) else s


def norm_row(row: Sequence[Any]) -> tuple:
    return tuple(norm_value(v) for v in row)


def normalise_rows(value: Any, width: int) -> list[tuple] | None:
    """An answer (already parsed) as rows of ``width`` columns; None when it cannot be read so."""
    if isinstance(value, (list, tuple, set)):
        items = list(value)
        if items and all(isinstance(x, (list, tuple)) for x in items):
            return [norm_row(x) for x in items]
        if not items:
            return []
        if any(isinstance(x, (list, tuple)) for x in items):
            return None
        if width == 1:
            return [(norm_value(x),) for x in items]
        if len(items) == width:
            return [norm_row(items)]
        return None
    return [(norm_value(value),)]


def parse_answer(text: str, width: int) -> list[tuple] | None:
    text = text.strip().rstrip(".").strip()
    if text.startswith("```"):
        text = text.strip("`").strip()
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        if width == 1 and ("," in text or "\n" in text):
            value = [x.strip().strip("'\"") for x in re.split(r"[,\n]", text) if x.strip()]
        elif width > 1 and "," in text and "\n" not in text:
            value = [x.strip().strip("'\"") for x in text.split(",")]
        else:
            value = text.strip("'\"")
    return normalise_rows(value, width)


def parse_action(action: str) -> tuple[str, str] | tuple[str, None]:
    """("operation", sql) | ("answer", text) | ("invalid", reason)."""
    m = _ACTION_LABEL.search(action)
    if m:
        rest = action[m.end() :]
        if m.group(1).lower() == "operation":
            block = _FENCE.search(rest)
            if block and block.group(1).strip():
                return "operation", block.group(1).strip()
            line = rest.strip()
            if line and "```" not in line and "\n" not in line:
                return "operation", line
            return "invalid", "'Action: Operation' must be followed by a ```sql ... ``` block with one statement"
        final = _FINAL.search(rest)
        if final:
            return "answer", final.group(1).strip()
        return "invalid", "'Action: Answer' must be followed by 'Final Answer: <answer>'"
    m = _SHORT.search(action)
    if m:
        body = m.group(2).strip()
        if m.group(1).lower() == "operation":
            block = _FENCE.search(body)
            body = block.group(1).strip() if block else body.strip("`").strip()
            if body:
                return "operation", body
            return "invalid", "'Operation:' must be followed by a SQL statement"
        return "answer", body
    return "invalid", "use 'Action: Operation' with a ```sql``` block, or 'Action: Answer' with 'Final Answer: ...'"


def render_rows(rows: list[tuple], total: int) -> str:
    shown = repr(rows)
    note = ""
    if total < 0:
        note = f" ... (at least {-total} rows, first {len(rows)} shown)"
    elif total > len(rows):
        note = f" ... ({total} rows in all, first {len(rows)} shown)"
    if len(shown) > MAX_OBS_CHARS:
        shown = shown[:MAX_OBS_CHARS].rstrip() + " ..."
        note = note or f" (output cut at {MAX_OBS_CHARS} characters; {abs(total)} rows in all)"
    return shown + note


def sorted_or_not(rows: list[tuple], task: Task) -> list[tuple]:
    normed = [norm_row(r) for r in rows]
    return normed if task.payload.get("ordered") else sorted(normed, key=repr)


def rows_equal(got: list[tuple], want: list[tuple]) -> bool:
    """Row lists equal, numbers within 0.01 (an unrounded average matches its 2-decimal gold)."""
    if len(got) != len(want):
        return False
    for a, b in zip(got, want, strict=True):
        if len(a) != len(b):
            return False
        for x, y in zip(a, b, strict=True):
            if isinstance(x, float) and isinstance(y, float):
                if abs(x - y) > 0.01 + 1e-9:
                    return False
            elif x != y:
                return False
    return True
