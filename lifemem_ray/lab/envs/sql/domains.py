"""The SQL tasks' domains: two related tables each (a parent referenced by a child), the
words the question templates use for them, and row generators; SQL literals and CREATE TABLE."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

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


def sql_literal(value: Any) -> str:
    """A SQL literal (strings quoted with doubled quotes)."""
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    return repr(value)


def create_table(table: str, cols: Sequence[tuple[str, str]]) -> str:
    return f"CREATE TABLE {table} ({', '.join(f'{c} {t}' for c, t in cols)})"
