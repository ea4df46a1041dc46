"""WebShop (Yao et al., 2022) over a generated catalogue: search, result pages, item pages, Buy Now.

WebShop's catalogue of scraped Amazon products is not installable here, so the products come
from :mod:`lifemem_ray.lab.envs.webshop.catalogue` (seeded templates in WebShop's five
categories, with WebShop's record fields); everything an agent meets follows WebShop's text
environment (``web_agent_site/envs/web_agent_text_env.py``):

* actions: ``search[keywords]`` on the search page; ``click[X]`` for a button, a product's
  ASIN or an option value on the page (case-insensitive, as WebShop lower-cases both);
* pages (:mod:`lifemem_ray.lab.envs.webshop.pages`), laid out as the released LifeMem WebShop
  trajectories show them: the search page; results, 10 per page of the top 50 (``[Next >]``
  always shown, ``[< Prev]`` from page 2); item pages with options, Description, Features,
  Reviews and Buy Now; ``< Prev`` goes from a sub page back to the item (options kept), from an
  item back to its results page (options cleared), and from a results page to the page before;
  ``Back to Search`` clears the session (visited products and chosen options);
* the episode ends at ``click[Buy Now]`` with WebShop's reward
  (:mod:`lifemem_ray.lab.envs.webshop.reward`: attributes, options, price, type);
  ``info["success"]`` is reward == 1 (WebShop's success rate), ``info["score"]`` the reward;
* ``info["valid_actions"]``: WebShop's ``get_available_actions``: the page's clickables, and on
  the search page two queries read off the instruction (its request as written, and its content
  words), since a list of actions cannot hold free text; any other ``search[...]`` works too.

Differences from WebShop's text environment: ``search[...]`` is refused off the search page
(WebShop's action list has no search bar there; its step function would search anyway); an
invalid action gets an observation saying so (WebShop silently shows the same page again);
``think[...]`` answers ``OK.`` as in ReAct's WebShop prompts. Tasks are split by goal: train
and test goals target disjoint products.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from lifemem_ray.core.errors import InvalidArgumentError
from lifemem_ray.lab.envs.base import Environment, EnvStateError, StepResult, Task, TaskError, check_task, select_tasks
from lifemem_ray.lab.envs.webshop.catalogue import (
    Goal,
    Product,
    SearchEngine,
    generate_goals,
    generate_products,
    request_text,
    search_words,
)
from lifemem_ray.lab.envs.webshop.pages import (
    BACK_TO_SEARCH,
    BUY_NOW,
    NEXT_PAGE,
    PREV_PAGE,
    SUB_PAGES,
    done_page,
    item_page,
    results_page,
    search_page,
    sub_page,
)
from lifemem_ray.lab.envs.webshop.reward import get_reward

__all__ = ["Catalogue", "WebShopEnv"]

PRODUCT_WINDOW = 10  # WebShop's results per page
MAX_ACTION_CHARS = 500
MAX_ECHO = 120
_ACTION = re.compile(r"\b(search|click|think)\s*\[(.*)\]", re.I | re.S)


@dataclass(frozen=True)
class Catalogue:
    """Products, their search engine and the reachable goals of one (seed, size); shared."""

    products: dict[str, Product]
    engine: SearchEngine
    goals: list[Goal]

    _cache: ClassVar[dict[tuple[int, int], Catalogue]] = {}

    @classmethod
    def build(cls, seed: int, per_type: int) -> Catalogue:
        """The catalogue for ``seed`` and ``per_type`` products per type (cached per process)."""
        key = (seed, per_type)
        if key not in cls._cache:
            products = generate_products(seed, per_type)
            engine = SearchEngine(products)
            found: dict[str, list[str]] = {}  # gold query -> its results: goals of one type share many queries
            goals = [g for g in generate_goals(products, seed) if _rank(engine, g, found) is not None]
            cls._cache[key] = cls({p.asin: p for p in products}, engine, goals)
        return cls._cache[key]


def _rank(engine: SearchEngine, goal: Goal, found: dict[str, list[str]] | None = None) -> int | None:
    """Where the goal's product ranks for the gold query (0-based), None past the top 50;
    ``found`` keeps each query's results for the next goal with the same query."""
    query = search_words(goal.instruction)
    asins = None if found is None else found.get(query)
    if asins is None:
        asins = [p.asin for p in engine.search(query)]
        if found is not None:
            found[query] = asins
    return asins.index(goal.asin) if goal.asin in asins else None


def _cut(text: str) -> str:
    return text if len(text) <= MAX_ECHO else text[:MAX_ECHO] + "..."


class WebShopEnv(Environment):
    """WebShop's shopping episodes over a generated catalogue; environment name ``webshop``.

    Options: ``seed`` (catalogue, goals and split), ``products_per_type`` (30 product types),
    ``test_fraction`` of the goals held out, ``n_train`` / ``n_test`` (caps on the splits,
    None: all), ``max_steps`` (15, WebShop's usual episode limit).
    """

    name = "webshop"

    def __init__(
        self,
        seed: int = 0,
        products_per_type: int = 24,
        test_fraction: float = 0.3,
        n_train: int | None = None,
        n_test: int | None = None,
        max_steps: int = 15,
    ) -> None:
        for label, value, low, high in (
            ("products_per_type", products_per_type, 2, 1000),
            ("max_steps", max_steps, 1, 1000),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise InvalidArgumentError(
                    f"{label} must be an integer in {low}..{high}, got {value!r}", where="WebShopEnv"
                )
        for label, cap in (("n_train", n_train), ("n_test", n_test)):
            if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
                raise InvalidArgumentError(f"{label} must be None or an integer >= 0, got {cap!r}", where="WebShopEnv")
        if isinstance(test_fraction, bool) or not isinstance(test_fraction, (int, float)) or not 0 < test_fraction < 1:
            raise InvalidArgumentError(f"test_fraction must be in (0, 1), got {test_fraction!r}", where="WebShopEnv")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise InvalidArgumentError(f"seed must be an integer, got {seed!r}", where="WebShopEnv")
        self.seed, self.max_steps = seed, max_steps
        self.catalogue = Catalogue.build(seed, products_per_type)
        goals = list(self.catalogue.goals)
        random.Random(f"lifemem-webshop-split:{seed}").shuffle(goals)  # every prefix mixes the categories
        n_test_all = round(test_fraction * len(goals))
        caps = {"train": n_train, "test": n_test}
        self._tasks: dict[str, list[Task]] = {}
        for split, part in (("test", goals[:n_test_all]), ("train", goals[n_test_all:])):
            cap = caps[split]
            self._tasks[split] = [self._task(g, split) for g in part[: len(part) if cap is None else cap]]
        self._task_now: Task | None = None
        self._goal: Goal | None = None
        self._done = True
        self._steps = 0
        self._reset_session()

    def _task(self, goal: Goal, split: str) -> Task:
        return Task(
            env=self.name,
            id=f"webshop-{goal.asin}",
            instruction=goal.instruction,
            split=split,
            payload=goal.to_payload(),
            metadata={
                "task_type": goal.category,
                "product_type": goal.query,
                "n_attributes": len(goal.attributes),
                "n_options": len(goal.options),
            },
        )

    def _reset_session(self) -> None:
        """WebShop's session after the search page: nothing searched, visited or chosen."""
        self._page = "search"  # search | results | item | sub | done
        self._results: list[Product] = []
        self._page_no = 1
        self._product: Product | None = None
        self._chosen: dict[str, str] = {}
        self._visited: set[str] = set()
        self._sub = ""

    # -- tasks ------------------------------------------------------------------------------

    def tasks(self, split: str = "train", limit: int | None = None, seed: int = 0) -> list[Task]:
        """The split's goals in a fixed seeded order for ``seed=0``, else shuffled by ``seed``."""
        return select_tasks("WebShopEnv", self._tasks, split, limit, seed)

    def gold_actions(self, task: Task) -> list[str] | None:
        """Search the instruction's content words, page to the target, choose the goal's options, buy."""
        goal = Goal.from_payload(task.instruction, task.payload)
        rank = _rank(self.catalogue.engine, goal)
        if rank is None:
            return None
        return [
            f"search[{search_words(goal.instruction)}]",
            *[f"click[{NEXT_PAGE}]"] * (rank // PRODUCT_WINDOW),
            f"click[{goal.asin}]",
            *[f"click[{value}]" for _, value in goal.options],
            f"click[{BUY_NOW}]",
        ]

    # -- episodes ---------------------------------------------------------------------------

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Start a goal on the search page; the observation shows the instruction."""
        check_task("WebShopEnv", task, self.name)
        goal = Goal.from_payload(task.instruction, task.payload)
        if goal.asin not in self.catalogue.products:
            raise TaskError(
                f"task {task.id!r} targets {goal.asin}, which this catalogue (seed {self.seed}) "
                "lacks; build the environment with the options its tasks came from",
                where="WebShopEnv.reset",
            )
        self._task_now, self._goal, self._done, self._steps = task, goal, False, 0
        self._reset_session()
        return search_page(task.instruction), self._info()

    def _info(self, **extra: Any) -> dict[str, Any]:
        instruction = self._goal.instruction if self._goal is not None else ""
        valid = [] if self._done else self.valid_actions()
        return {"instruction": instruction, "valid_actions": valid, "success": None, **extra}

    def _clickables(self) -> dict[str, tuple[str, str]]:
        """Lower-case label -> (kind, label as shown) of what the current page lets one click."""
        labels: list[tuple[str, str]] = []
        if self._page == "results":
            labels += [("back", BACK_TO_SEARCH)] + ([("prev", PREV_PAGE)] if self._page_no > 1 else [])
            labels += [("next", NEXT_PAGE)] + [("product", p.asin) for p in self._shown()]
        elif self._page == "item" and self._product is not None:
            labels += [("back", BACK_TO_SEARCH), ("prev", PREV_PAGE)]
            labels += [("option", v) for _, values in self._product.options for v in values]
            labels += [("sub", s) for s in SUB_PAGES] + [("buy", BUY_NOW)]
        elif self._page == "sub":
            labels += [("back", BACK_TO_SEARCH), ("prev", PREV_PAGE)]
        return {label.lower(): (kind, label) for kind, label in labels}

    def valid_actions(self) -> list[str]:
        """The clickables as ``click[...]``; on the search page, two queries from the instruction."""
        if self._page == "search" and self._goal is not None:
            queries = dict.fromkeys(
                [request_text(self._goal.instruction).lower(), search_words(self._goal.instruction)]
            )
            return [f"search[{q}]" for q in queries if q]
        return [f"click[{label}]" for _, label in self._clickables().values()]

    def _shown(self) -> list[Product]:
        start = (self._page_no - 1) * PRODUCT_WINDOW
        return self._results[start : start + PRODUCT_WINDOW]

    def _render(self) -> str:
        if self._page == "results":
            return results_page(self._shown(), self._page_no, len(self._results), self._visited)
        if self._page == "item" and self._product is not None:
            return item_page(self._product, self._chosen)
        if self._page == "sub" and self._product is not None:
            return sub_page(self._product, self._sub)
        return search_page()

    def step(self, action: str) -> StepResult:
        """One search or click (or think); anything else is an invalid action, and a step."""
        if self._task_now is None or self._goal is None:
            raise EnvStateError("no episode running; call reset(task) first", where="WebShopEnv.step")
        if self._done:
            raise EnvStateError(
                f"episode of task {self._task_now.id!r} is over; call reset(task)", where="WebShopEnv.step"
            )
        self._steps += 1
        extra: dict[str, Any] = {}
        reward = 0.0
        if not isinstance(action, str):
            obs = f"Invalid action: expected text, got {type(action).__name__}."
        elif len(action) > MAX_ACTION_CHARS:
            obs = f"Invalid action: longer than {MAX_ACTION_CHARS} characters; use search[keywords] or click[button]."
        else:
            obs, reward, extra = self._act(action)
        if not self._done and self._steps >= self.max_steps:
            self._done = True
            extra.update(success=False, score=0.0)
            obs += f"\nStep limit ({self.max_steps}) reached without a purchase."
        info = self._info(**extra)
        info["page"] = self._page
        return StepResult(obs, reward, self._done, info)

    def _act(self, action: str) -> tuple[str, float, dict[str, Any]]:
        m = _ACTION.search(action)
        if m is None:
            return f"Invalid action: {_cut(action)!r}. Use search[keywords] or click[button].", 0.0, {}
        verb, arg = m.group(1).lower(), m.group(2).strip()
        if verb == "think":
            return "OK.", 0.0, {}
        if not arg:
            return f"Invalid action: {verb}[...] needs an argument.", 0.0, {}
        if verb == "search":
            if self._page != "search":
                return "Invalid action: there is no search bar on this page; click[Back to Search] first.", 0.0, {}
            self._results = self.catalogue.engine.search(arg.lower())
            self._page, self._page_no, self._product, self._chosen = "results", 1, None, {}
            return self._render(), 0.0, {}
        target = self._clickables().get(arg.lower())
        if target is None:
            return f"Invalid action: nothing to click named {_cut(arg)!r} on this page.", 0.0, {}
        return self._click(*target)

    def _click(self, kind: str, label: str) -> tuple[str, float, dict[str, Any]]:
        if kind == "back":
            self._reset_session()
        elif kind == "next":
            self._page_no += 1
        elif kind == "prev" and self._page == "results":
            self._page_no -= 1
        elif kind == "prev" and self._page == "item":
            self._page, self._product, self._chosen = "results", None, {}  # WebShop re-renders the results
        elif kind == "prev":
            self._page = "item"
        elif kind == "product":
            self._product = self.catalogue.products[label]
            self._page, self._chosen = "item", {}
            self._visited.add(label)
        elif kind == "option" and self._product is not None:
            self._chosen[self._product.option_values()[label]] = label
        elif kind == "sub":
            self._page, self._sub = "sub", label
        elif kind == "buy" and self._product is not None and self._goal is not None:
            return self._buy(self._product, self._goal)
        return self._render(), 0.0, {}

    def _buy(self, product: Product, goal: Goal) -> tuple[str, float, dict[str, Any]]:
        reward, parts = get_reward(product, goal, product.price, self._chosen)
        self._page, self._done = "done", True
        success = abs(reward - 1.0) < 1e-9
        extra = {"success": success, "score": reward, "reward_info": parts, "purchased": product.asin}
        extra["options"] = dict(self._chosen)
        return done_page(product, self._chosen, reward), reward, extra

    def close(self) -> None:
        """Nothing is held but the (shared, cached) catalogue."""
        self._task_now, self._goal, self._done = None, None, True
        self._reset_session()
