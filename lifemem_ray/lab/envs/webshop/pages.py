"""WebShop's pages as text, laid out as the released LifeMem WebShop trajectories show them.

The layouts (``trainset/train_webshop.jsonl`` of BITHLP/LifeMem, the observations of
WebShop's text mode as ReAct prints them):

* search page: ``[Search]`` (the first page also shows ``WebShop`` and the instruction);
* results: ``[Back to Search]``, ``Page N (Total results: T)``, ``[< Prev]`` from page 2 on,
  ``[Next >]`` always (as WebShop's results template), a blank line, then per product
  ``[ASIN]`` / title / price tag blocks separated by blank lines; a product visited since the
  last search page reads ``[clicked button] ASIN [clicked button_]``;
* item page: ``[Back to Search]``, ``[< Prev]``, each option name followed by its values as
  ``  [value]`` (``  [clicked button] value [clicked button_]`` once chosen), the title,
  ``Price: ...``, ``Rating: N.A.``, ``[Description]``, ``[Features]``, ``[Reviews]``, ``[Buy Now]``;
* sub pages: ``[Back to Search]``, ``[< Prev]`` then the description, the bullet points
  (`` text `` lines) or the reviews (none in WebShop's release).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence

from lifemem_ray.lab.envs.webshop.catalogue import Product

__all__ = [
    "BACK_TO_SEARCH",
    "BUY_NOW",
    "NEXT_PAGE",
    "PREV_PAGE",
    "SUB_PAGES",
    "done_page",
    "item_page",
    "results_page",
    "search_page",
    "sub_page",
]

BACK_TO_SEARCH, NEXT_PAGE, PREV_PAGE, BUY_NOW = "Back to Search", "Next >", "< Prev", "Buy Now"
SUB_PAGES = ("Description", "Features", "Reviews")  # WebShop's ACTION_TO_TEMPLATE (Attributes hidden)


def _button(text: str, clicked: bool = False) -> str:
    return f"[clicked button] {text} [clicked button_]" if clicked else f"[{text}]"


def search_page(instruction: str | None = None) -> str:
    """The search page; with ``instruction``, as the episode's first page shows it."""
    head = f"WebShop\nInstruction:\n{instruction}\n" if instruction is not None else ""
    return f"{head}[Search]\n"


def results_page(products: Sequence[Product], page: int, total: int, visited: Collection[str]) -> str:
    """One page of search results (the products of that page only)."""
    lines = [_button(BACK_TO_SEARCH), f"Page {page} (Total results: {total})"]
    if page > 1:
        lines.append(_button(PREV_PAGE))
    lines += [_button(NEXT_PAGE), ""]
    for p in products:
        lines += [_button(p.asin, p.asin in visited), p.title, p.price_tag, ""]
    return "\n".join(lines[:-1]) + "\n"  # no blank line after the last block


def item_page(product: Product, chosen: Mapping[str, str]) -> str:
    """A product's page with its options; ``chosen``: option name -> the value clicked."""
    lines = [_button(BACK_TO_SEARCH), _button(PREV_PAGE)]
    for name, values in product.options:
        lines.append(name)
        lines += [f"  {_button(v, chosen.get(name) == v)}" for v in values]
    lines += [product.title, f"Price: {product.price_tag}", "Rating: N.A."]
    lines += [_button(b) for b in (*SUB_PAGES, BUY_NOW)]
    return "\n".join(lines) + "\n"


def sub_page(product: Product, which: str) -> str:
    """The Description, Features or Reviews page of a product."""
    head = f"{_button(BACK_TO_SEARCH)}\n{_button(PREV_PAGE)}\n"
    if which == "Description":
        return f"{head}{product.description}\n"
    if which == "Features":
        return head + "".join(f" {b} \n" for b in product.bullets)
    return head  # Reviews: WebShop's release has none


def done_page(product: Product, chosen: Mapping[str, str], reward: float) -> str:
    """What ``click[Buy Now]`` shows: the purchase and WebShop's score."""
    return (
        "Thank you for shopping with us!\n"
        f"Purchased: {product.asin} with options {json.dumps(dict(chosen), ensure_ascii=False)}\n"
        f"Your score (min 0.0, max 1.0): {reward:.4f}\n"
    )
