"""A generated WebShop catalogue: products, goals drawn from them, and a BM25 search engine.

WebShop (Yao et al., 2022) serves 1.18M Amazon products; its records carry an ASIN, a title,
a price or price range (the reward uses one draw in the range), options (name -> values), a
description, bullet points (the Features page), attributes, a ``category``, a ``query`` and a
``product_category`` path. This module makes such records from the templates of
:mod:`lifemem_ray.lab.envs.webshop.product_types`, deterministically from a seed.

Goals follow WebShop's instruction goals: one target product; the goal's attributes are some
of the target's, its options one value per option name of the target, and its price bound
WebShop's: of the multiples of ten above the target's price, the larger of two drawn from the
first four, written ``, and price lower than X.00 dollars``.

The search engine stands in for WebShop's Lucene index (pyserini BM25, k1=0.9, b=0.4) over the
same text (title, description, first bullet point and the options, lower case): BM25 with
Lucene's English stop words and a plural-``s`` stemmer instead of Porter's; the top 50.
"""

from __future__ import annotations

import math
import random
import re
import string
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lifemem_ray.core.errors import TaskError
from lifemem_ray.lab.envs.webshop.product_types import NEUTRAL_LINES, PRODUCT_TYPES, ProductType

__all__ = [
    "SEARCH_RETURN_N",
    "Goal",
    "Product",
    "SearchEngine",
    "generate_goals",
    "generate_products",
    "request_text",
    "search_words",
]

SEARCH_RETURN_N = 50  # WebShop's SEARCH_RETURN_N
PRICE_RANGE = [10.0 * i for i in range(1, 100)]  # goal.py's PRICE_RANGE
MAX_QUERY_TOKENS = 64
PRICE_CLAUSE = ", and price lower than "

_TOKEN = re.compile(r"[a-z0-9]+")
# Lucene's default English stop words (StandardAnalyzer / EnglishAnalyzer).
# fmt: off
_STOP = frozenset({
    "a", "an", "and", "are", "as", "at", "be", "but", "by", "for", "if", "in", "into", "is", "it", "no", "not",
    "of", "on", "or", "such", "that", "the", "their", "then", "there", "these", "they", "this", "to", "was",
    "will", "with"
})
# fmt: on
# fmt: off
_SYLLABLES = (
    "ka", "lo", "mi", "ve", "tor", "zen", "qua", "bri", "sol", "dex", "nor", "vi", "ra", "tek", "lum", "ox", "fi", "ar", "co", "mo", "sen", "tri", "val", "pex",
)
# fmt: on
_FEATURE_TAILS = (
    "built for everyday use",
    "made to hold up over time",
    "a customer favourite",
    "checked by our quality team",
)


@dataclass(frozen=True)
class Product:
    """One catalogue record, with WebShop's fields."""

    asin: str
    title: str
    category: str
    query: str
    product_category: str
    nouns: tuple[str, ...]  # the title's nouns (brand, model code, type nouns): the type reward's parse
    attributes: tuple[str, ...]
    options: tuple[tuple[str, tuple[str, ...]], ...]
    pricing: tuple[float, ...]  # one price, or a (low, high) range as WebShop shows 'from to'
    price: float  # the price the reward uses (WebShop: one uniform draw in the range)
    bullets: tuple[str, ...]
    description: str

    @property
    def price_tag(self) -> str:
        """WebShop's price text: ``$11.59`` or ``$14.99 to $17.99``."""
        return " to ".join(f"${p}" for p in self.pricing)

    def option_values(self) -> dict[str, str]:
        """Option value -> its option name (values are unique within a product)."""
        return {value: name for name, values in self.options for value in values}


@dataclass(frozen=True)
class Goal:
    """One instruction goal (WebShop's goal dict)."""

    asin: str
    instruction: str
    attributes: tuple[str, ...]
    options: tuple[tuple[str, str], ...]  # (option name, value) of the target
    price_upper: float
    query: str
    category: str
    product_category: str
    name: str  # the target's title
    name_nouns: tuple[str, ...]

    def to_payload(self) -> dict[str, Any]:
        """A JSON-able form for a Task's payload."""
        return {
            "asin": self.asin,
            "attributes": list(self.attributes),
            "options": [list(o) for o in self.options],
            "price_upper": self.price_upper,
            "query": self.query,
            "category": self.category,
            "product_category": self.product_category,
            "name": self.name,
            "name_nouns": list(self.name_nouns),
        }

    @classmethod
    def from_payload(cls, instruction: str, payload: dict[str, Any]) -> Goal:
        """The goal a payload describes; TaskError names what is missing or malformed."""
        try:
            return cls(
                asin=str(payload["asin"]),
                instruction=instruction,
                attributes=tuple(str(a) for a in payload["attributes"]),
                options=tuple((str(n), str(v)) for n, v in payload["options"]),
                price_upper=float(payload["price_upper"]),
                query=str(payload["query"]),
                category=str(payload["category"]),
                product_category=str(payload["product_category"]),
                name=str(payload["name"]),
                name_nouns=tuple(str(n) for n in payload["name_nouns"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise TaskError(
                f"task payload is not a WebShop goal ({type(exc).__name__}: {exc})", where="webshop"
            ) from None


# --------------------------------------------------------------------------- products


def _brands(rng: random.Random, n: int, taken: set[str]) -> list[str]:
    """``n`` made-up brand names, none used by another type (a brand is a title noun)."""
    out: list[str] = []
    while len(out) < n:  # bounded in practice: 24^2..24^3 names, a few hundred drawn
        name = "".join(rng.sample(_SYLLABLES, rng.choice((2, 2, 3)))).capitalize()
        if name.lower() not in taken:
            taken.add(name.lower())
            out.append(name)
    return out


def _asin(rng: random.Random, taken: set[str]) -> str:
    while True:
        asin = "B0" + "".join(rng.choices(string.ascii_uppercase + string.digits, k=8))
        if asin not in taken:
            taken.add(asin)
            return asin


def _pricing(rng: random.Random, low: float, high: float) -> tuple[tuple[float, ...], float]:
    first = round(rng.uniform(low, high), 2)
    if rng.random() < 0.6:
        return (first,), first
    second = round(min(high * 1.3, first * rng.uniform(1.1, 1.6)), 2)
    return (first, second), round(rng.uniform(first, second), 2)


def _product(rng: random.Random, kind: ProductType, brand: str, asin: str) -> Product:
    code = rng.choice(string.ascii_uppercase) + rng.choice(string.ascii_uppercase) + str(rng.randint(10, 990))
    chosen = set(rng.sample(kind.attributes, rng.randint(2, min(4, len(kind.attributes)))))
    attributes = tuple(a for a in kind.attributes if a in chosen)
    options = []
    for name, pool in kind.options:
        if rng.random() < 0.85:
            keep = set(rng.sample(pool, rng.randint(2, len(pool))))
            options.append((name, tuple(v for v in pool if v in keep)))
    in_title = rng.sample(attributes, rng.randint(1, len(attributes)))
    title = f"{brand} {code} {kind.phrase}, " + ", ".join(a.title() for a in in_title)
    pricing, price = _pricing(rng, *kind.price)
    bullets = tuple(f"{a.capitalize()}: {rng.choice(_FEATURE_TAILS)}" for a in attributes)
    bullets += tuple(rng.sample(NEUTRAL_LINES[kind.category], 2))
    description = (
        f"Brand Name: {brand}. Model: {code}. Product Type: {kind.phrase}. "
        f"Highlights: {', '.join(attributes)}. {NEUTRAL_LINES[kind.category][0]}."
    )
    return Product(
        asin=asin,
        title=title,
        category=kind.category,
        query=kind.query,
        product_category=kind.path,
        nouns=(brand.lower(), code.lower(), *kind.nouns),
        attributes=attributes,
        options=tuple(options),
        pricing=pricing,
        price=price,
        bullets=bullets,
        description=description,
    )


def generate_products(seed: int = 0, per_type: int = 24, brands_per_type: int = 6) -> list[Product]:
    """``per_type`` products of every product type, the same for the same arguments."""
    rng = random.Random(f"lifemem-webshop-catalogue:{seed}")
    brands_taken: set[str] = set()
    asins: set[str] = set()
    products: list[Product] = []
    for kind in PRODUCT_TYPES:
        brands = _brands(rng, brands_per_type, brands_taken)
        products += [_product(rng, kind, rng.choice(brands), _asin(rng, asins)) for _ in range(per_type)]
    return products


# --------------------------------------------------------------------------- goals

_OPENERS = ("i need", "i am looking for", "i'm looking for", "find me", "i want", "can you find me", "i would like")


def _article(word: str, plural: bool) -> str:
    if plural:
        return "some"
    vowel = word[:1] in "aeio" or (word[:1] == "u" and not word.startswith(("us", "uni")))
    return "an" if vowel else "a"


def _option_text(rng: random.Random, options: Sequence[tuple[str, str]]) -> str:
    if not options:
        return ""
    form = rng.randrange(3)
    if form == 0:
        return " in " + " and ".join(f"{name} {value}" for name, value in options)
    if form == 1:
        return ", " + ", ".join(f"{name}: {value}" for name, value in options)
    return " that is " + " and ".join(value for _, value in options)


def _instruction(
    rng: random.Random, kind: ProductType, attributes: Sequence[str], options: Sequence[tuple[str, str]]
) -> str:
    attrs = " and ".join(attributes)
    if rng.random() < 0.5:
        head = f"{_article(attrs, kind.plural)} {attrs} {kind.query}"
    else:
        head = f"{_article(kind.query, kind.plural)} {kind.query} with {attrs}"
    return f"{rng.choice(_OPENERS)} {head}{_option_text(rng, options)}"


def _price_upper(rng: random.Random, price: float) -> float | None:
    above = [p for p in PRICE_RANGE if p > price][:4]
    if len(above) < 2:
        return None
    return sorted(rng.sample(above, 2))[1]


def generate_goals(products: Iterable[Product], seed: int = 0) -> list[Goal]:
    """One goal per product that has a price bound (WebShop's rule), in catalogue order."""
    kinds = {k.query: k for k in PRODUCT_TYPES}
    rng = random.Random(f"lifemem-webshop-goals:{seed}")
    goals: list[Goal] = []
    for p in products:
        kind = kinds[p.query]
        k = min(len(p.attributes), rng.choice((1, 2, 2, 3)))
        chosen = set(rng.sample(p.attributes, k))
        attributes = tuple(a for a in p.attributes if a in chosen)
        options = tuple((name, rng.choice(values)) for name, values in p.options)
        upper = _price_upper(rng, p.price)
        text = _instruction(rng, kind, attributes, options)
        if upper is None:
            continue
        goals.append(
            Goal(
                asin=p.asin,
                instruction=f"{text}{PRICE_CLAUSE}{upper:.2f} dollars",
                attributes=attributes,
                options=options,
                price_upper=upper,
                query=p.query,
                category=p.category,
                product_category=p.product_category,
                name=p.title,
                name_nouns=p.nouns,
            )
        )
    return goals


def request_text(instruction: str) -> str:
    """The instruction without its price clause: what a shopper would type first."""
    return instruction.split(PRICE_CLAUSE, 1)[0].strip()


def search_words(instruction: str) -> str:
    """The request's content words (no stop words, no opener): the gold agent's query."""
    words = _TOKEN.findall(request_text(instruction).lower().replace("'s ", " "))
    filler = _STOP | {"i", "need", "am", "looking", "m", "find", "me", "want", "can", "you", "would", "like", "some"}
    return " ".join(w for w in words if w not in filler)


# --------------------------------------------------------------------------- search


def _stem(token: str) -> str:
    if len(token) > 3 and token.endswith("s") and not token.endswith(("ss", "us", "is")):
        return token[:-1]
    return token


def analyze(text: str) -> list[str]:
    """Lower case word tokens without stop words, plural ``s`` removed."""
    return [_stem(t) for t in _TOKEN.findall(text.lower().replace("'s ", " ")) if t not in _STOP]


class SearchEngine:
    """BM25 (k1=0.9, b=0.4, pyserini's defaults) over WebShop's indexed text of each product.

    Each word's BM25 weight in each product that holds it depends only on the catalogue, so it
    is computed once here (per word: the products' positions and their weights, as arrays); a
    search adds up its words' weights in a dense score array. The sums and the order are the
    ones a product-by-product loop gives (the same floating-point operations, in query order),
    at a cost that grows with the matching products rather than with Python's per-item loop:
    a catalogue of 30,000 products ranks every goal in seconds."""

    def __init__(self, products: Sequence[Product], k1: float = 0.9, b: float = 0.4) -> None:
        self.products = list(products)
        self.k1, self.b = k1, b
        postings: dict[str, tuple[list[int], list[int]]] = {}  # word -> (products, counts)
        lengths: list[int] = []
        for i, p in enumerate(self.products):
            option_text = ", and ".join(f"{name}: {', '.join(values)}" for name, values in p.options)
            tokens = analyze(" ".join([p.title, p.description, p.bullets[0] if p.bullets else "", option_text]))
            lengths.append(len(tokens))
            for tok, n in Counter(tokens).items():
                docs, counts = postings.setdefault(tok, ([], []))
                docs.append(i)
                counts.append(n)
        self.avg_len = sum(lengths) / max(1, len(lengths))
        # k1 * (1 - b + b * length / avg_len) per product, in the loop's order of operations
        norms = k1 * (1 - b + b * np.asarray(lengths, dtype=np.float64) / self.avg_len)
        n = len(self.products)
        self.weights: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # word -> (products, BM25 weights)
        for tok, (docs, counts) in postings.items():
            at = np.asarray(docs, dtype=np.int64)
            tf = np.asarray(counts, dtype=np.float64)
            idf = math.log(1 + (n - len(docs) + 0.5) / (len(docs) + 0.5))
            self.weights[tok] = (at, idf * tf * (k1 + 1) / (tf + norms[at]))

    def search(self, query: str, k: int = SEARCH_RETURN_N) -> list[Product]:
        """The ``k`` best products for ``query`` (score, then catalogue order); [] when no word matches."""
        scores = np.zeros(len(self.products), dtype=np.float64)
        for tok in dict.fromkeys(analyze(query)[:MAX_QUERY_TOKENS]):
            got = self.weights.get(tok)
            if got is not None:
                docs, weights = got
                scores[docs] += weights  # a word's products are distinct: one addition each
        # every weight is > 0 (idf > 0, tf > 0): the products that matched a word are those scoring > 0
        return [self.products[doc] for doc in _top(np.flatnonzero(scores > 0), scores, k)]


def _top(docs: np.ndarray, scores: np.ndarray, k: int) -> list[int]:
    """The ``k`` of ``docs`` (ascending) with the highest ``scores``, ties in ``docs`` order."""
    if k <= 0 or docs.size == 0:
        return []
    got = -scores[docs]
    if docs.size > k:  # only the products that score at least the k-th best can be among the top k
        keep = got <= np.partition(got, k - 1)[k - 1]
        docs, got = docs[keep], got[keep]
    return [int(d) for d in docs[np.argsort(got, kind="stable")[:k]]]
