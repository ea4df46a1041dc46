"""SQL tasks on SQLite in the LifelongAgentBench protocol, generated from a seed.

LifelongAgentBench's database tasks need MySQL and a download; this adapter
generates the same kind of tasks (one or two small tables, a question, a gold SQL)
deterministically, so a worker can run thousands of episodes offline on the
standard library's ``sqlite3`` (a fresh in-memory database per ``reset``).

Actions (free text; the first recognised form wins):

* ``Action: Operation`` followed by a fenced block (`````sql ... `````): the first
  block's statement is executed; the observation is the rows as a Python list of
  tuples (``[(1, 'Ann')]``, ``[]`` for INSERT/UPDATE/DELETE) or ``Error: ...``.
* ``Action: Answer`` followed by ``Final Answer: <value>``: ends the episode.
* Shortened single-line forms: ``Operation: <sql>`` and ``Answer: <value>`` (also a
  bare ``Final Answer: <value>``).

Judging, as LifelongAgentBench does: a query task succeeds when the answer equals
the gold query's result (numbers rounded to 2 decimals, strings case- and
space-normalised, rows compared as a multiset unless the question asks for an
order; a lone value, a list of values or a list of tuples are all accepted); a
modification task (INSERT/UPDATE/DELETE) succeeds when, at the answer, every table
equals its state after the gold SQL (the answer text itself is ignored). Running
out of steps without an answer is a failure.

Statements that reach outside the in-memory database (ATTACH/DETACH, VACUUM,
PRAGMA other than read-only introspection, ``load_extension``) are refused with an
observation saying so; runaway queries are interrupted.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import random
import re
import sqlite3
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lifemem_ray.core.errors import InvalidArgumentError
from lifemem_ray.lab.envs.base import Environment, EnvStateError, StepResult, Task, TaskError, check_task, select_tasks

__all__ = ["TASK_TYPES", "SqlEnv", "normalise_rows", "parse_action"]

#: The workflow kinds, in the order tasks cycle through them (task i has kind i % 7).
TASK_TYPES: tuple[str, ...] = ("select", "count", "aggregate", "join", "insert", "update", "delete")
MODIFY_TYPES = frozenset({"insert", "update", "delete"})

MAX_ROWS_SHOWN = 40
MAX_OBS_CHARS = 2000
MAX_VM_STEPS = 2_000_000  # progress-handler budget of one statement (~0.1-0.5 s)
_READ_ONLY_PRAGMAS = frozenset(
    {"table_info", "table_xinfo", "table_list", "index_list", "index_info", "index_xinfo", "foreign_key_list"}
)
_FORBIDDEN = re.compile(r"^\s*(attach|detach|vacuum)\b|\b(load_extension)\s*\(", re.I)
_COMMENT = re.compile(r"/\*.*?(?:\*/|$)|--[^\n]*", re.S)

_ACTION_LABEL = re.compile(r"Action\s*:\s*(Operation|Answer)\b", re.I)
_FENCE = re.compile(r"```[ \t]*(?:sql|sqlite|mysql)?[ \t]*\n?(.*?)```", re.I | re.S)
_FINAL = re.compile(r"Final\s+Answer\s*:\s*(.*)", re.I | re.S)
_SHORT = re.compile(r"^[ \t]*(Operation|Final\s+Answer|Answer)\s*:[ \t]*(.*)", re.I | re.M | re.S)

PROTOCOL = (
    "Reply with one action per turn.\n"
    "To run one SQL statement:\nAction: Operation\n```sql\nSELECT ...;\n```\n"
    "To finish:\nAction: Answer\nFinal Answer: [(value, ...), ...]\n"
    "(Short forms: 'Operation: <sql>' and 'Answer: <value>'.) The database is SQLite. "
    "For a question about modifying the database, the answer can be anything once the change is made."
)


# --------------------------------------------------------------------------- domains

_FIRST = [
    "Alice",
    "Bob",
    "Carol",
    "David",
    "Emma",
    "Frank",
    "Grace",
    "Henry",
    "Irene",
    "Jack",
    "Karen",
    "Liam",
    "Maria",
    "Noah",
    "Olivia",
    "Peter",
    "Quinn",
    "Rosa",
    "Samuel",
    "Tina",
    "Umar",
    "Vera",
    "Walter",
    "Xenia",
    "Yusuf",
    "Zoe",
    "Aaron",
    "Bianca",
    "Caleb",
    "Diana",
    "Ethan",
    "Fiona",
]
_LAST = [
    "Smith",
    "Jones",
    "Brown",
    "Garcia",
    "Miller",
    "Davis",
    "Lopez",
    "Wilson",
    "Moore",
    "Taylor",
    "Clark",
    "Lewis",
    "Walker",
    "Hall",
    "Young",
    "King",
    "Wright",
    "Scott",
    "Green",
    "Baker",
    "Adams",
    "Nelson",
    "Hill",
    "Campbell",
]
_CITIES = ("Boston", "Denver", "Austin", "Seattle", "Chicago", "Miami", "Portland", "Atlanta")


def _names(rng: random.Random, n: int) -> list[str]:
    pool = [f"{first} {last}" for first in _FIRST for last in _LAST]
    return rng.sample(pool, n)


@dataclass(frozen=True)
class Domain:
    """Two related tables and the words the question templates use for them.

    ``parent`` rows are referenced by ``child.fk``; ``label`` is a unique column of
    the child, ``cat`` a categorical and ``num`` a numeric one; ``pcat`` is the
    parent's categorical column and ``plabel`` its unique name column.
    """

    key: str
    parent: str
    parent_cols: tuple[tuple[str, str], ...]
    child: str
    child_cols: tuple[tuple[str, str], ...]
    pk: str
    ppk: str
    fk: str
    label: str
    cat: str
    num: str
    plabel: str
    pcat: str
    noun: str  # one child row
    nouns: str  # child rows
    pnoun: str
    num_words: str
    cat_words: str
    pcat_words: str
    num_delta: int  # a sensible amount to add in UPDATE tasks
    make_parent: Callable[[random.Random, int], list[tuple]]
    make_child: Callable[[random.Random, int, list[tuple], set], tuple]  # (rng, id, parents, used labels)


def _hr_parent(rng: random.Random, n: int) -> list[tuple]:
    names = rng.sample(
        ["Sales", "Engineering", "Marketing", "Finance", "Support", "Legal", "Research", "Operations"], n
    )
    return [(i + 1, names[i], rng.choice(_CITIES), rng.randrange(200, 2000) * 1000) for i in range(n)]


def _hr_child(rng: random.Random, i: int, parents: list[tuple], used: set) -> tuple:
    name = next(x for x in _names(rng, 8) if x not in used)
    used.add(name)
    title = rng.choice(["Engineer", "Analyst", "Manager", "Designer", "Clerk"])
    return (i, name, rng.choice(parents)[0], title, rng.randrange(70, 300) * 500, rng.randrange(2008, 2025))


def _shop_parent(rng: random.Random, n: int) -> list[tuple]:
    names = _names(rng, n)
    return [(i + 1, names[i], rng.choice(_CITIES), rng.choice(["basic", "silver", "gold"])) for i in range(n)]


def _shop_child(rng: random.Random, i: int, parents: list[tuple], used: set) -> tuple:
    product = rng.choice(
        ["Laptop", "Desk Lamp", "Headphones", "Backpack", "Monitor", "Keyboard", "Coffee Maker", "Chair"]
    )
    status = rng.choice(["pending", "shipped", "delivered", "cancelled"])
    amount = round(rng.randrange(500, 150000) / 100, 2)
    date = f"2024-{rng.randrange(1, 13):02d}-{rng.randrange(1, 29):02d}"
    return (i, rng.choice(parents)[0], product, status, amount, date)


def _school_parent(rng: random.Random, n: int) -> list[tuple]:
    names = _names(rng, n)
    return [(i + 1, names[i], rng.randrange(9, 13), rng.choice(_CITIES)) for i in range(n)]


def _school_child(rng: random.Random, i: int, parents: list[tuple], used: set) -> tuple:
    subject = rng.choice(["Math", "History", "Biology", "Physics", "English", "Art"])
    return (i, rng.choice(parents)[0], subject, rng.randrange(35, 101), rng.choice(["fall", "spring"]))


def _inv_parent(rng: random.Random, n: int) -> list[tuple]:
    cities = rng.sample(list(_CITIES), n)
    return [(i + 1, f"{cities[i]} Depot", cities[i], rng.randrange(5, 50) * 100) for i in range(n)]


def _inv_child(rng: random.Random, i: int, parents: list[tuple], used: set) -> tuple:
    while True:
        category, items = rng.choice(
            [
                ("hardware", ["Bolt", "Hinge", "Bracket", "Screw", "Washer"]),
                ("electrical", ["Cable", "Switch", "Fuse", "Socket", "Relay"]),
                ("plumbing", ["Valve", "Pipe", "Faucet", "Gasket", "Elbow"]),
                ("paint", ["Primer", "Varnish", "Roller", "Brush", "Sealant"]),
            ]
        )
        name = f"{rng.choice(['Steel', 'Brass', 'Compact', 'Heavy', 'Mini', 'Pro', 'Eco'])} {rng.choice(items)} {rng.choice('ABCDEFGH')}{rng.randrange(1, 10)}"
        if name not in used:
            used.add(name)
            break
    return (i, name, category, rng.choice(parents)[0], rng.randrange(0, 500), round(rng.randrange(99, 9999) / 100, 2))


def _air_parent(rng: random.Random, n: int) -> list[tuple]:
    names = rng.sample(
        [
            ("Blue Sky Air", "USA"),
            ("Nordwind", "Germany"),
            ("Aurora Lines", "Canada"),
            ("Pacifica", "USA"),
            ("Sol Airways", "Spain"),
            ("Kestrel Air", "UK"),
            ("Maple Jet", "Canada"),
            ("Alpina", "Switzerland"),
        ],
        n,
    )
    return [(i + 1, names[i][0], names[i][1]) for i in range(n)]


def _air_child(rng: random.Random, i: int, parents: list[tuple], used: set) -> tuple:
    airline = rng.choice(parents)
    while True:
        code = ("".join(w[0] for w in airline[1].split()) + "X")[:2].upper() + str(rng.randrange(100, 1000))
        if code not in used:
            used.add(code)
            break
    origin, dest = rng.sample(list(_CITIES), 2)
    return (i, code, airline[0], origin, dest, rng.choice([90, 120, 150, 180, 220]), rng.randrange(59, 900))


def _lib_parent(rng: random.Random, n: int) -> list[tuple]:
    names = _names(rng, n)
    return [(i + 1, names[i], rng.choice(_CITIES), rng.choice(["standard", "premium", "student"])) for i in range(n)]


def _lib_child(rng: random.Random, i: int, parents: list[tuple], used: set) -> tuple:
    genre, titles = rng.choice(
        [
            ("fantasy", ["The Hobbit", "Mistborn", "Earthsea", "The Name of the Wind"]),
            ("mystery", ["Gone Girl", "The Big Sleep", "Rebecca", "In the Woods"]),
            ("science", ["Cosmos", "The Selfish Gene", "Brief Answers", "The Gene"]),
            ("history", ["SPQR", "The Silk Roads", "Guns, Germs, and Steel", "1776"]),
        ]
    )
    return (i, rng.choice(parents)[0], rng.choice(titles), genre, rng.randrange(3, 60))


DOMAINS: tuple[Domain, ...] = (
    Domain(
        "hr",
        "departments",
        (("dept_id", "INTEGER PRIMARY KEY"), ("name", "TEXT"), ("location", "TEXT"), ("budget", "INTEGER")),
        "employees",
        (
            ("emp_id", "INTEGER PRIMARY KEY"),
            ("name", "TEXT"),
            ("dept_id", "INTEGER"),
            ("title", "TEXT"),
            ("salary", "INTEGER"),
            ("hire_year", "INTEGER"),
        ),
        "emp_id",
        "dept_id",
        "dept_id",
        "name",
        "title",
        "salary",
        "name",
        "location",
        "employee",
        "employees",
        "department",
        "salary",
        "job title",
        "location",
        2500,
        _hr_parent,
        _hr_child,
    ),
    Domain(
        "shop",
        "customers",
        (("customer_id", "INTEGER PRIMARY KEY"), ("name", "TEXT"), ("city", "TEXT"), ("tier", "TEXT")),
        "orders",
        (
            ("order_id", "INTEGER PRIMARY KEY"),
            ("customer_id", "INTEGER"),
            ("product", "TEXT"),
            ("status", "TEXT"),
            ("amount", "REAL"),
            ("order_date", "TEXT"),
        ),
        "order_id",
        "customer_id",
        "customer_id",
        "order_id",
        "status",
        "amount",
        "name",
        "city",
        "order",
        "orders",
        "customer",
        "amount",
        "status",
        "city",
        10,
        _shop_parent,
        _shop_child,
    ),
    Domain(
        "school",
        "students",
        (("student_id", "INTEGER PRIMARY KEY"), ("name", "TEXT"), ("grade_level", "INTEGER"), ("city", "TEXT")),
        "exam_results",
        (
            ("result_id", "INTEGER PRIMARY KEY"),
            ("student_id", "INTEGER"),
            ("subject", "TEXT"),
            ("score", "INTEGER"),
            ("term", "TEXT"),
        ),
        "result_id",
        "student_id",
        "student_id",
        "result_id",
        "subject",
        "score",
        "name",
        "city",
        "exam result",
        "exam results",
        "student",
        "score",
        "subject",
        "city",
        5,
        _school_parent,
        _school_child,
    ),
    Domain(
        "inventory",
        "warehouses",
        (("warehouse_id", "INTEGER PRIMARY KEY"), ("name", "TEXT"), ("city", "TEXT"), ("capacity", "INTEGER")),
        "products",
        (
            ("product_id", "INTEGER PRIMARY KEY"),
            ("name", "TEXT"),
            ("category", "TEXT"),
            ("warehouse_id", "INTEGER"),
            ("quantity", "INTEGER"),
            ("unit_price", "REAL"),
        ),
        "product_id",
        "warehouse_id",
        "warehouse_id",
        "name",
        "category",
        "quantity",
        "name",
        "city",
        "product",
        "products",
        "warehouse",
        "quantity in stock",
        "category",
        "city",
        50,
        _inv_parent,
        _inv_child,
    ),
    Domain(
        "flights",
        "airlines",
        (("airline_id", "INTEGER PRIMARY KEY"), ("name", "TEXT"), ("country", "TEXT")),
        "flights",
        (
            ("flight_id", "INTEGER PRIMARY KEY"),
            ("flight_no", "TEXT"),
            ("airline_id", "INTEGER"),
            ("origin", "TEXT"),
            ("destination", "TEXT"),
            ("seats", "INTEGER"),
            ("price", "INTEGER"),
        ),
        "flight_id",
        "airline_id",
        "airline_id",
        "flight_no",
        "destination",
        "price",
        "name",
        "country",
        "flight",
        "flights",
        "airline",
        "ticket price",
        "destination",
        "country",
        25,
        _air_parent,
        _air_child,
    ),
    Domain(
        "library",
        "members",
        (("member_id", "INTEGER PRIMARY KEY"), ("name", "TEXT"), ("city", "TEXT"), ("membership", "TEXT")),
        "loans",
        (
            ("loan_id", "INTEGER PRIMARY KEY"),
            ("member_id", "INTEGER"),
            ("book_title", "TEXT"),
            ("genre", "TEXT"),
            ("loan_days", "INTEGER"),
        ),
        "loan_id",
        "member_id",
        "member_id",
        "loan_id",
        "genre",
        "loan_days",
        "name",
        "city",
        "loan",
        "loans",
        "member",
        "loan length in days",
        "genre",
        "city",
        7,
        _lib_parent,
        _lib_child,
    ),
)


def _lit(value: Any) -> str:
    """A SQL literal (strings quoted with doubled quotes)."""
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    return repr(value)


def _create(table: str, cols: Sequence[tuple[str, str]]) -> str:
    return f"CREATE TABLE {table} ({', '.join(f'{c} {t}' for c, t in cols)})"


# --------------------------------------------------------------------------- generation


def _say(words: str, column: str) -> str:
    """'job title (title)', but plain 'genre' when the words are the column name."""
    return words if words == column.replace("_", " ") else f"{words} ({column})"


def _col(dom: Domain, name: str, parent: bool = False) -> int:
    cols = dom.parent_cols if parent else dom.child_cols
    return [c for c, _ in cols].index(name)


@dataclass
class _Ask:
    """What every task kind's question draws on: the domain, its sampled rows, and the
    category and threshold drawn for this task (drawn first, in this order, for every kind)."""

    dom: Domain
    rng: random.Random
    parents: list[tuple]
    children: list[tuple]
    next_child: Callable[[], tuple]
    cats: list[Any]
    nums: list[Any]
    cat: Any
    threshold: Any

    @property
    def head(self) -> str:
        d = self.dom
        return f"The tables are {d.parent} and {d.child}; {d.child}.{d.fk} refers to {d.parent}.{d.ppk}."


Question = tuple[str, list[str], bool]  # (question, gold SQL statements, whether the answer's order matters)


def _question(
    dom: Domain,
    kind: str,
    rng: random.Random,
    parents: list[tuple],
    children: list[tuple],
    next_child: Callable[[], tuple],
) -> Question:
    """(question, gold SQL statements, ordered) for one task kind; may produce an empty-result query (the caller retries)."""
    ask = _KINDS.get(kind)
    if ask is None:
        raise TaskError(f"unknown SQL task kind {kind!r}")
    cat_i, num_i = _col(dom, dom.cat), _col(dom, dom.num)
    cats = sorted({r[cat_i] for r in children})
    nums = sorted(r[num_i] for r in children)
    cat = rng.choice(cats)
    threshold = nums[rng.randrange(len(nums) // 4, 3 * len(nums) // 4)]
    return ask(_Ask(dom, rng, parents, children, next_child, cats, nums, cat, threshold))


def _ask_select(a: _Ask) -> Question:
    dom, c, rng = a.dom, a.dom.child, a.rng
    v = rng.randrange(3)
    if v == 0:
        q = f"List the {dom.label} of every {dom.noun} in the {c} table whose {_say(dom.cat_words, dom.cat)} is '{a.cat}' and whose {_say(dom.num_words, dom.num)} is greater than {a.threshold}."
        return q, [f"SELECT {dom.label} FROM {c} WHERE {dom.cat} = {_lit(a.cat)} AND {dom.num} > {a.threshold}"], False
    if v == 1:
        k = rng.choice([3, 4, 5])
        top = sorted(a.nums, reverse=True)
        if len(set(top[: k + 1])) < k + 1:  # a tie would make the order ambiguous
            return "", [], False
        q = f"Which {k} {dom.nouns} in the {c} table have the highest {_say(dom.num_words, dom.num)}? Give their {dom.label} and {dom.num}, from the highest {dom.num} down."
        return q, [f"SELECT {dom.label}, {dom.num} FROM {c} ORDER BY {dom.num} DESC LIMIT {k}"], True
    lo, hi = sorted(rng.sample(a.nums, 2))
    q = f"List the {dom.label} and {dom.cat} of the {dom.nouns} in the {c} table whose {_say(dom.num_words, dom.num)} is between {lo} and {hi} inclusive."
    return q, [f"SELECT {dom.label}, {dom.cat} FROM {c} WHERE {dom.num} BETWEEN {lo} AND {hi}"], False


def _ask_count(a: _Ask) -> Question:
    dom, c = a.dom, a.dom.child
    v = a.rng.randrange(3)
    if v == 0:
        q = f"How many {dom.nouns} in the {c} table have {_say(dom.cat_words, dom.cat)} '{a.cat}'?"
        return q, [f"SELECT COUNT(*) FROM {c} WHERE {dom.cat} = {_lit(a.cat)}"], False
    if v == 1:
        q = f"How many {dom.nouns} in the {c} table have a {_say(dom.num_words, dom.num)} of at least {a.threshold}?"
        return q, [f"SELECT COUNT(*) FROM {c} WHERE {dom.num} >= {a.threshold}"], False
    q = f"How many distinct values of {_say(dom.cat_words, dom.cat)} occur in the {c} table?"
    return q, [f"SELECT COUNT(DISTINCT {dom.cat}) FROM {c}"], False


def _ask_aggregate(a: _Ask) -> Question:
    dom, c, rng = a.dom, a.dom.child, a.rng
    fn, word = rng.choice(
        [("AVG", "average"), ("SUM", "total"), ("MAX", "highest"), ("MIN", "lowest"), ("COUNT", "number of")]
    )
    v = rng.randrange(2)
    if fn == "COUNT":
        q = f"For each {_say(dom.cat_words, dom.cat)} in the {c} table, how many {dom.nouns} are there? Give ({dom.cat}, count) pairs."
        return q, [f"SELECT {dom.cat}, COUNT(*) FROM {c} GROUP BY {dom.cat}"], False
    expr = f"ROUND({fn}({dom.num}), 2)" if fn in ("AVG", "SUM") else f"{fn}({dom.num})"
    rounding = " (rounded to 2 decimals)" if fn in ("AVG", "SUM") else ""
    if v == 0:
        q = f"For each {_say(dom.cat_words, dom.cat)} in the {c} table, what is the {word} {_say(dom.num_words, dom.num)}{rounding}? Give ({dom.cat}, value) pairs."
        return q, [f"SELECT {dom.cat}, {expr} FROM {c} GROUP BY {dom.cat}"], False
    q = f"What is the {word} {_say(dom.num_words, dom.num)} of the {dom.nouns} in the {c} table with {_say(dom.cat_words, dom.cat)} '{a.cat}'{rounding}?"
    return q, [f"SELECT {expr} FROM {c} WHERE {dom.cat} = {_lit(a.cat)}"], False


def _ask_join(a: _Ask) -> Question:
    dom, c, p, rng, head = a.dom, a.dom.child, a.dom.parent, a.rng, a.head
    pcat_i = _col(dom, dom.pcat, parent=True)
    pcat = rng.choice(sorted({r[pcat_i] for r in a.parents}))
    v = rng.randrange(3)
    if v == 0:
        q = f"{head} List the {dom.label} of every {dom.noun} whose {dom.pnoun}'s {_say(dom.pcat_words, dom.pcat)} is '{pcat}'."
        return (
            q,
            [
                f"SELECT {c}.{dom.label} FROM {c} JOIN {p} ON {c}.{dom.fk} = {p}.{dom.ppk} WHERE {p}.{dom.pcat} = {_lit(pcat)}"
            ],
            False,
        )
    if v == 1:
        q = f"{head} List the distinct {dom.plabel} of the {dom.pnoun}s that have at least one {dom.noun} with {_say(dom.cat_words, dom.cat)} '{a.cat}'."
        return (
            q,
            [
                f"SELECT DISTINCT {p}.{dom.plabel} FROM {p} JOIN {c} ON {c}.{dom.fk} = {p}.{dom.ppk} WHERE {c}.{dom.cat} = {_lit(a.cat)}"
            ],
            False,
        )
    q = f"{head} For each {dom.pnoun} that has {dom.nouns}, give its {dom.plabel} and the total {_say(dom.num_words, dom.num)} of its {dom.nouns}, rounded to 2 decimals."
    return (
        q,
        [
            f"SELECT {p}.{dom.plabel}, ROUND(SUM({c}.{dom.num}), 2) FROM {p} JOIN {c} ON {c}.{dom.fk} = {p}.{dom.ppk} GROUP BY {p}.{dom.ppk}"
        ],
        False,
    )


def _ask_insert(a: _Ask) -> Question:
    dom, c = a.dom, a.dom.child
    row = a.next_child()
    cols = [name for name, _ in dom.child_cols if name != dom.pk]
    vals = [row[_col(dom, name)] for name in cols]
    desc = ", ".join(f"{name} {_lit(val)}" for name, val in zip(cols, vals, strict=True))
    q = f"Insert a new {dom.noun} into the {c} table with {desc}; let the database assign {dom.pk}."
    return q, [f"INSERT INTO {c} ({', '.join(cols)}) VALUES ({', '.join(_lit(v) for v in vals)})"], False


def _ask_update(a: _Ask) -> Question:
    dom, c, rng = a.dom, a.dom.child, a.rng
    v = rng.randrange(3)
    if v == 0:
        q = f"Increase the {_say(dom.num_words, dom.num)} of every {dom.noun} in the {c} table with {_say(dom.cat_words, dom.cat)} '{a.cat}' by {dom.num_delta}."
        return q, [f"UPDATE {c} SET {dom.num} = {dom.num} + {dom.num_delta} WHERE {dom.cat} = {_lit(a.cat)}"], False
    if v == 1:
        cat_i, label_i = _col(dom, dom.cat), _col(dom, dom.label)
        row = rng.choice(a.children)
        new = rng.choice([x for x in a.cats if x != row[cat_i]] or a.cats)
        q = f"In the {c} table, change the {_say(dom.cat_words, dom.cat)} of the {dom.noun} whose {dom.label} is {_lit(row[label_i])} to '{new}'."
        return q, [f"UPDATE {c} SET {dom.cat} = {_lit(new)} WHERE {dom.label} = {_lit(row[label_i])}"], False
    plabel_i = _col(dom, dom.plabel, parent=True)
    prow = rng.choice(a.parents)
    target = rng.choice([x for x in a.parents if x[0] != prow[0]] or a.parents)
    q = (
        f"{a.head} Move every {dom.noun} of the {dom.pnoun} with {dom.plabel} {_lit(prow[plabel_i])} "
        f"to the {dom.pnoun} with {dom.plabel} {_lit(target[plabel_i])} (update {c}.{dom.fk})."
    )
    return q, [f"UPDATE {c} SET {dom.fk} = {target[0]} WHERE {dom.fk} = {prow[0]}"], False


def _ask_delete(a: _Ask) -> Question:
    dom, c, rng = a.dom, a.dom.child, a.rng
    v = rng.randrange(3)
    if v == 0:
        low = a.nums[rng.randrange(1, max(2, len(a.nums) // 4))]
        q = f"Delete every {dom.noun} from the {c} table whose {_say(dom.num_words, dom.num)} is below {low}."
        return q, [f"DELETE FROM {c} WHERE {dom.num} < {low}"], False
    if v == 1:
        q = f"Delete every {dom.noun} with {_say(dom.cat_words, dom.cat)} '{a.cat}' from the {c} table."
        return q, [f"DELETE FROM {c} WHERE {dom.cat} = {_lit(a.cat)}"], False
    label_i = _col(dom, dom.label)
    row = rng.choice(a.children)
    q = f"Delete the {dom.noun} whose {dom.label} is {_lit(row[label_i])} from the {c} table."
    return q, [f"DELETE FROM {c} WHERE {dom.label} = {_lit(row[label_i])}"], False


_KINDS: dict[str, Callable[[_Ask], Question]] = {
    "select": _ask_select,
    "count": _ask_count,
    "aggregate": _ask_aggregate,
    "join": _ask_join,
    "insert": _ask_insert,
    "update": _ask_update,
    "delete": _ask_delete,
}


def _child_maker(dom: Domain, rng: random.Random, parents: list[tuple], used: set, last_id: int) -> Callable[[], tuple]:
    """Makes the child rows a question adds (an INSERT's), numbered on from ``last_id``."""
    counter = [last_id]

    def next_child() -> tuple:
        counter[0] += 1
        return dom.make_child(rng, counter[0], parents, used)

    return next_child


def generate_task(seed: int, split: str, index: int) -> Task:
    """Task ``index`` of ``split``: its own RNG, so it does not depend on how many tasks are asked for."""
    rng = random.Random(f"lifemem-sql:{seed}:{split}:{index}")
    kind = TASK_TYPES[index % len(TASK_TYPES)]
    dom = DOMAINS[rng.randrange(len(DOMAINS))]
    for _attempt in range(100):
        parents = dom.make_parent(rng, rng.randint(4, 8))
        used: set = set()
        n_child = rng.randint(12, 40)
        children = [dom.make_child(rng, i + 1, parents, used) for i in range(n_child)]
        next_child = _child_maker(dom, rng, parents, used, n_child)
        question, gold, ordered = _question(dom, kind, rng, parents, children, next_child)
        if not gold:
            continue
        payload = {
            "domain": dom.key,
            "kind": kind,
            "schema": [_create(dom.parent, dom.parent_cols), _create(dom.child, dom.child_cols)],
            "tables": {dom.parent: [list(r) for r in parents], dom.child: [list(r) for r in children]},
            "gold_sql": gold,
            "ordered": ordered,
        }
        conn = _build_db(payload)
        try:
            before = _snapshot(conn)
            result = [_run(conn, s) for s in gold][-1]
            if kind in MODIFY_TYPES:
                ok = _snapshot(conn) != before
            else:
                ok = bool(result) and result != [(0,)] and result != [(None,)]
        finally:
            conn.close()
        if ok:
            columns = {
                t: [name for name, _ in cols]
                for t, cols in ((dom.parent, dom.parent_cols), (dom.child, dom.child_cols))
            }
            schema_text = "\n".join(
                f"The name of this table is {t}, and the headers of this table are {', '.join(cs)}."
                for t, cs in columns.items()
            )
            return Task(
                env="sql",
                id=f"sql-s{seed}-{split}-{index:04d}",
                instruction=f"{question}\n{schema_text}",
                split=split,
                payload=payload,
                metadata={"task_type": kind, "domain": dom.key, "ordered": ordered},
            )
    raise TaskError(
        f"sql task generation: no valid {kind} task for seed={seed} split={split} index={index} after 100 tries"
    )


# --------------------------------------------------------------------------- database helpers


def _build_db(payload: dict[str, Any]) -> sqlite3.Connection:
    conn = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
    for stmt in payload["schema"]:
        conn.execute(stmt)
    for table, rows in payload["tables"].items():
        if rows:
            marks = ", ".join("?" * len(rows[0]))
            conn.executemany(f"INSERT INTO {table} VALUES ({marks})", [tuple(r) for r in rows])
    return conn


def _run(conn: sqlite3.Connection, sql: str) -> list[tuple]:
    return [tuple(r) for r in conn.execute(sql).fetchall()]


def _snapshot(conn: sqlite3.Connection) -> dict[str, list[tuple]]:
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
        rows = sorted((_norm_row(r) for r in cur.fetchall()), key=repr)
        out[t.lower()] = [cols, *rows]
    return out


def _norm_value(v: Any) -> Any:
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


def _norm_row(row: Sequence[Any]) -> tuple:
    return tuple(_norm_value(v) for v in row)


def normalise_rows(value: Any, width: int) -> list[tuple] | None:
    """An answer (already parsed) as rows of ``width`` columns; None when it cannot be read so."""
    if isinstance(value, (list, tuple, set)):
        items = list(value)
        if items and all(isinstance(x, (list, tuple)) for x in items):
            return [_norm_row(x) for x in items]
        if not items:
            return []
        if any(isinstance(x, (list, tuple)) for x in items):
            return None
        if width == 1:
            return [(_norm_value(x),) for x in items]
        if len(items) == width:
            return [_norm_row(items)]
        return None
    return [(_norm_value(value),)]


def _parse_answer(text: str, width: int) -> list[tuple] | None:
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


def _render_rows(rows: list[tuple], total: int) -> str:
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


# --------------------------------------------------------------------------- the environment


class SqlEnv(Environment):
    """Generated SQL tasks on a fresh in-memory SQLite database per episode.

    ``n_train``/``n_test`` tasks per split, generated from ``seed`` (same seed, same
    tasks, ids ``sql-s<seed>-<split>-<index>``); ``max_steps`` actions per episode.
    """

    name = "sql"

    def __init__(self, n_train: int = 60, n_test: int = 20, seed: int = 0, max_steps: int = 8) -> None:
        for label, value, low in (("n_train", n_train, 0), ("n_test", n_test, 0), ("max_steps", max_steps, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidArgumentError(f"SqlEnv: {label} must be an integer >= {low}, got {value!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise InvalidArgumentError(f"SqlEnv: seed must be an integer, got {seed!r}")
        self.n_train, self.n_test, self.seed, self.max_steps = n_train, n_test, seed, max_steps
        self._tasks: dict[str, list[Task]] = {}
        self._conn: sqlite3.Connection | None = None
        self._task: Task | None = None
        self._steps = 0
        self._done = True
        self._expected: list[tuple] | None = None
        self._expected_state: dict[str, list[tuple]] | None = None
        self._width = 1
        self._ref_cache: dict[str, tuple[dict[str, Any], tuple[list[tuple], dict[str, list[tuple]] | None, int]]] = {}

    # -- tasks

    def _split(self, split: str) -> list[Task]:
        if split not in ("train", "test"):
            raise InvalidArgumentError(f"SqlEnv.tasks: split must be 'train' or 'test', got {split!r}")
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
            raise TaskError(f"SqlEnv.reset: task {task.id!r} payload lacks {', '.join(missing)}")
        if p["kind"] not in TASK_TYPES:
            raise TaskError(f"SqlEnv.reset: task {task.id!r} has unknown kind {p['kind']!r}")
        if (
            not isinstance(p["gold_sql"], list)
            or not p["gold_sql"]
            or not all(isinstance(s, str) for s in p["gold_sql"])
        ):
            raise TaskError(f"SqlEnv.reset: task {task.id!r} gold_sql must be a non-empty list of strings")

    def _reference(self, task: Task) -> tuple[list[tuple], dict[str, list[tuple]] | None, int]:
        """The gold result (last statement's rows), the table state after the gold SQL (modifications only), the result width.

        Cached per task id (and checked against the payload), since every reset and gold_actions needs it.
        """
        hit = self._ref_cache.get(task.id)
        if hit is not None and (hit[0] is task.payload or hit[0] == task.payload):
            return hit[1]
        ref = self._compute_reference(task)
        if len(self._ref_cache) >= 512:
            self._ref_cache.pop(next(iter(self._ref_cache)))
        self._ref_cache[task.id] = (task.payload, ref)
        return ref

    def _compute_reference(self, task: Task) -> tuple[list[tuple], dict[str, list[tuple]] | None, int]:
        try:
            conn = _build_db(task.payload)
        except (sqlite3.Error, TypeError, AttributeError, ValueError) as exc:
            raise TaskError(f"SqlEnv: task {task.id!r}: cannot build its database: {exc}") from None
        try:
            result: list[tuple] = []
            width = 1
            for stmt in task.payload["gold_sql"]:
                cur = conn.execute(stmt)
                if cur.description:
                    width = len(cur.description)
                result = [tuple(r) for r in cur.fetchall()]
            state = _snapshot(conn) if task.payload["kind"] in MODIFY_TYPES else None
            return result, state, width
        except sqlite3.Error as exc:
            raise TaskError(f"SqlEnv: task {task.id!r}: gold SQL fails: {exc}") from None
        finally:
            conn.close()

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """A fresh database for ``task``; the first observation holds the question, the schemas and the protocol."""
        self._check_task(task)
        self._close_conn()
        expected, state, width = self._reference(task)
        try:
            conn = _build_db(task.payload)
        except (sqlite3.Error, TypeError, AttributeError, ValueError) as exc:
            raise TaskError(f"SqlEnv.reset: task {task.id!r}: cannot build its database: {exc}") from None
        conn.set_authorizer(_authorizer)
        conn.set_progress_handler(_budget(), 1000)
        conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, 1_000_000)
        self._conn = conn
        self._task, self._steps, self._done = task, 0, False
        self._expected, self._expected_state, self._width = _sorted_or_not(expected, task), state, width
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
            raise EnvStateError("SqlEnv.step: no episode running; call reset(task) first")
        if self._done:
            raise EnvStateError(f"SqlEnv.step: episode of task {self._task.id!r} is over; call reset(task)")
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
        bad = _FORBIDDEN.search(_COMMENT.sub(" ", sql))
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
        return _render_rows([tuple(r) for r in rows], total)

    def _judge(self, answer: str) -> bool:
        assert self._task is not None and self._conn is not None
        if self._task.payload["kind"] in MODIFY_TYPES:
            self._conn.set_authorizer(None)
            try:
                return _snapshot(self._conn) == self._expected_state
            except sqlite3.Error:
                return False
        got = _parse_answer(answer, self._width)
        if got is None:
            return False
        if not self._task.payload.get("ordered"):
            got = sorted(got, key=repr)
        return _rows_equal(got, self._expected or [])

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


def _sorted_or_not(rows: list[tuple], task: Task) -> list[tuple]:
    normed = [_norm_row(r) for r in rows]
    return normed if task.payload.get("ordered") else sorted(normed, key=repr)


def _rows_equal(got: list[tuple], want: list[tuple]) -> bool:
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
