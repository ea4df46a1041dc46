"""SQL task generation: task ``index`` of a split from its own seeded RNG (a domain, its rows,
a question of one of :data:`TASK_TYPES`, the gold SQL), kept only when its gold SQL gives a
non-trivial result or changes the database."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lifemem_ray.lab.envs.base import Task, TaskError
from lifemem_ray.lab.envs.sql.database import build_db, run_sql, snapshot
from lifemem_ray.lab.envs.sql.domains import DOMAINS, Domain, create_table, sql_literal

#: The workflow kinds, in the order tasks cycle through them (task i has kind i % 7).
TASK_TYPES: tuple[str, ...] = ("select", "count", "aggregate", "join", "insert", "update", "delete")
MODIFY_TYPES = frozenset({"insert", "update", "delete"})


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
        return (
            q,
            [f"SELECT {dom.label} FROM {c} WHERE {dom.cat} = {sql_literal(a.cat)} AND {dom.num} > {a.threshold}"],
            False,
        )
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
        return q, [f"SELECT COUNT(*) FROM {c} WHERE {dom.cat} = {sql_literal(a.cat)}"], False
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
    return q, [f"SELECT {expr} FROM {c} WHERE {dom.cat} = {sql_literal(a.cat)}"], False


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
                f"SELECT {c}.{dom.label} FROM {c} JOIN {p} ON {c}.{dom.fk} = {p}.{dom.ppk} WHERE {p}.{dom.pcat} = {sql_literal(pcat)}"
            ],
            False,
        )
    if v == 1:
        q = f"{head} List the distinct {dom.plabel} of the {dom.pnoun}s that have at least one {dom.noun} with {_say(dom.cat_words, dom.cat)} '{a.cat}'."
        return (
            q,
            [
                f"SELECT DISTINCT {p}.{dom.plabel} FROM {p} JOIN {c} ON {c}.{dom.fk} = {p}.{dom.ppk} WHERE {c}.{dom.cat} = {sql_literal(a.cat)}"
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
    desc = ", ".join(f"{name} {sql_literal(val)}" for name, val in zip(cols, vals, strict=True))
    q = f"Insert a new {dom.noun} into the {c} table with {desc}; let the database assign {dom.pk}."
    return q, [f"INSERT INTO {c} ({', '.join(cols)}) VALUES ({', '.join(sql_literal(v) for v in vals)})"], False


def _ask_update(a: _Ask) -> Question:
    dom, c, rng = a.dom, a.dom.child, a.rng
    v = rng.randrange(3)
    if v == 0:
        q = f"Increase the {_say(dom.num_words, dom.num)} of every {dom.noun} in the {c} table with {_say(dom.cat_words, dom.cat)} '{a.cat}' by {dom.num_delta}."
        return (
            q,
            [f"UPDATE {c} SET {dom.num} = {dom.num} + {dom.num_delta} WHERE {dom.cat} = {sql_literal(a.cat)}"],
            False,
        )
    if v == 1:
        cat_i, label_i = _col(dom, dom.cat), _col(dom, dom.label)
        row = rng.choice(a.children)
        new = rng.choice([x for x in a.cats if x != row[cat_i]] or a.cats)
        q = f"In the {c} table, change the {_say(dom.cat_words, dom.cat)} of the {dom.noun} whose {dom.label} is {sql_literal(row[label_i])} to '{new}'."
        return (
            q,
            [f"UPDATE {c} SET {dom.cat} = {sql_literal(new)} WHERE {dom.label} = {sql_literal(row[label_i])}"],
            False,
        )
    plabel_i = _col(dom, dom.plabel, parent=True)
    prow = rng.choice(a.parents)
    target = rng.choice([x for x in a.parents if x[0] != prow[0]] or a.parents)
    q = (
        f"{a.head} Move every {dom.noun} of the {dom.pnoun} with {dom.plabel} {sql_literal(prow[plabel_i])} "
        f"to the {dom.pnoun} with {dom.plabel} {sql_literal(target[plabel_i])} (update {c}.{dom.fk})."
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
        return q, [f"DELETE FROM {c} WHERE {dom.cat} = {sql_literal(a.cat)}"], False
    label_i = _col(dom, dom.label)
    row = rng.choice(a.children)
    q = f"Delete the {dom.noun} whose {dom.label} is {sql_literal(row[label_i])} from the {c} table."
    return q, [f"DELETE FROM {c} WHERE {dom.label} = {sql_literal(row[label_i])}"], False


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
            "schema": [create_table(dom.parent, dom.parent_cols), create_table(dom.child, dom.child_cols)],
            "tables": {dom.parent: [list(r) for r in parents], dom.child: [list(r) for r in children]},
            "gold_sql": gold,
            "ordered": ordered,
        }
        conn = build_db(payload)
        try:
            before = snapshot(conn)
            result = [run_sql(conn, s) for s in gold][-1]
            if kind in MODIFY_TYPES:
                ok = snapshot(conn) != before
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
