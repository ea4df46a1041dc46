"""WebShopEnv: WebShop's actions, pages and reward over a generated catalogue (tiny records built
here; the released LifeMem WebShop trajectories, when present, for the page layouts)."""

from __future__ import annotations

import itertools
import json
import os
import re
from dataclasses import replace
from pathlib import Path

import pytest

from lifemem_ray.core.errors import InvalidArgumentError
from lifemem_ray.lab.agents import make_agent
from lifemem_ray.lab.envs import Task, TaskError, make_env
from lifemem_ray.lab.envs.base import EnvStateError
from lifemem_ray.lab.envs.webshop.catalogue import (
    PRICE_CLAUSE,
    Goal,
    Product,
    SearchEngine,
    generate_goals,
    generate_products,
    search_words,
)
from lifemem_ray.lab.envs.webshop.env import MAX_ACTION_CHARS, WebShopEnv
from lifemem_ray.lab.envs.webshop.pages import item_page, results_page, search_page, sub_page
from lifemem_ray.lab.envs.webshop.product_types import CATEGORIES, PRODUCT_TYPES
from lifemem_ray.lab.envs.webshop.reward import (
    _ratio,
    attribute_reward,
    fuzzy_match,
    get_reward,
    normalize_color,
    token_set_ratio,
)
from lifemem_ray.lab.episode import EpisodeLimits, run_episode

SHARED = Path(os.environ.get("LIFEMEM_SHARED_DIR", Path(__file__).resolve().parents[4] / "shared"))
RELEASED = SHARED / "data" / "lifemem-trainset" / "webshop.jsonl"


@pytest.fixture(scope="module")
def env():
    e = WebShopEnv()
    try:
        yield e
    finally:
        e.close()


# --------------------------------------------------------------------------- a tiny catalogue


def _product(asin: str, **kw) -> Product:
    base = {
        "asin": asin,
        "title": "Kalo AB12 USB Flash Drive, High Speed",
        "category": "electronics",
        "query": "usb flash drive",
        "product_category": "Electronics › Computers & Accessories › Data Storage › USB Flash Drives",
        "nouns": ("kalo", "ab12", "usb", "flash", "drive"),
        "attributes": ("high speed", "metal casing"),
        "options": (("size", ("16gb", "32gb", "64gb")), ("color", ("black", "navy blue"))),
        "pricing": (12.5,),
        "price": 12.5,
        "bullets": ("High speed: built for everyday use", "Metal casing: a customer favourite"),
        "description": "Brand Name: Kalo. Highlights: high speed, metal casing.",
    }
    return Product(**{**base, **kw})


DRIVE = _product("B0AAAAAAAA")
GOAL = Goal(
    asin=DRIVE.asin,
    instruction="i need a high speed usb flash drive that is 32gb and black, and price lower than 30.00 dollars",
    attributes=("high speed",),
    options=(("size", "32gb"), ("color", "black")),
    price_upper=30.0,
    query=DRIVE.query,
    category=DRIVE.category,
    product_category=DRIVE.product_category,
    name=DRIVE.title,
    name_nouns=DRIVE.nouns,
)


def test_fuzzy_ratio_is_thefuzz_token_set_ratio():
    # values thefuzz / rapidfuzz give (rapidfuzz's documented examples, and hand-checked ones)
    assert _ratio("this is a test", "this is a test!") == pytest.approx(96.5517, abs=1e-3)
    assert token_set_ratio("fuzzy was a bear", "fuzzy fuzzy was a bear") == 100
    assert token_set_ratio("x-large", "large") == 100  # a token subset: WebShop's own looseness
    assert token_set_ratio("32 gb", "32gb") == 89
    assert token_set_ratio("charging pad", "charging stand") == 85  # not a match: the test is > 85
    assert token_set_ratio("", "anything") == 0
    assert fuzzy_match("High-Speed", "high speed") and not fuzzy_match("16gb", "64gb")
    assert normalize_color("navy blue") == "blue" and normalize_color("jet black") == "black"
    assert normalize_color("sandalwood") == "sand" and normalize_color("32gb") == "32gb"


def test_reward_formula_cases():
    full, info = get_reward(DRIVE, GOAL, DRIVE.price, {"size": "32gb", "color": "black"})
    assert full == 1.0 and info["r_type"] == 1.0 and info["r_option"] == 1.0 and info["r_price"]
    # one of two options wrong: (1 attribute + 1 option + price) / (1 + 2 + 1)
    wrong_opt, _ = get_reward(DRIVE, GOAL, DRIVE.price, {"size": "64gb", "color": "black"})
    assert wrong_opt == pytest.approx(3 / 4)
    # no option chosen at all
    assert get_reward(DRIVE, GOAL, DRIVE.price, {})[0] == pytest.approx(2 / 4)
    # over the price bound
    over, info = get_reward(DRIVE, GOAL, 31.0, {"size": "32gb", "color": "black"})
    assert over == pytest.approx(3 / 4) and info["r_price"] is False
    # a colour variant normalises to the goal's colour (WebShop's normalize_color)
    navy = replace(GOAL, options=(("color", "blue"),))
    assert get_reward(DRIVE, navy, DRIVE.price, {"color": "navy blue"})[0] == 1.0
    # missing attribute: found neither in the attributes nor in the texts
    casing = replace(GOAL, attributes=("high speed", "password protection"))
    assert attribute_reward(DRIVE, casing) == (0.5, 1)
    assert get_reward(DRIVE, casing, DRIVE.price, {"size": "32gb", "color": "black"})[0] == pytest.approx(4 / 5)
    # an attribute found only in the text counts (WebShop looks at title, features, description)
    texty = _product("B0CCCCCCCC", attributes=(), bullets=("Metal casing for a long life",))
    assert attribute_reward(texty, replace(GOAL, attributes=("metal casing",))) == (1.0, 1)


def test_reward_type_cases():
    opts = {"size": "32gb", "color": "black"}
    # another brand of the same type: shares the type nouns and the query
    other = _product(
        "B0BBBBBBBB", nouns=("lomi", "zz90", "usb", "flash", "drive"), title="Lomi ZZ90 USB Flash Drive, High Speed"
    )
    assert get_reward(other, GOAL, other.price, opts)[0] == 1.0
    # a different type with no noun in common: r_type 0
    cable = _product(
        "B0DDDDDDDD",
        query="hdmi cable",
        product_category="Electronics › Television & Video › Accessories › Cables › HDMI Cables",
        nouns=("vizen", "kq1", "hdmi", "cable"),
        title="Vizen KQ1 HDMI Cable, High Speed",
    )
    reward, info = get_reward(cable, GOAL, cable.price, opts)
    assert reward == 0.0 and info["r_type"] == 0.0 and info["title_score"] == 0.0
    # one noun of five in common (0.2, not over 0.2) and nothing else: r_type 0.5
    odd = replace(cable, nouns=("vizen", "kq1", "drive"), product_category="Toys › Games")
    reward, info = get_reward(odd, GOAL, odd.price, opts)
    assert info["r_type"] == 0.5 and reward == pytest.approx(0.5)
    # the same path (two levels shared) keeps r_type at 1 despite the weak noun overlap
    reward, info = get_reward(replace(odd, product_category=DRIVE.product_category), GOAL, odd.price, opts)
    assert info["category_match"] and info["r_type"] == 1.0


# --------------------------------------------------------------------------- the catalogue


def test_catalogue_is_deterministic_and_consistent():
    products = generate_products(seed=3, per_type=5)
    assert products == generate_products(seed=3, per_type=5) and products != generate_products(seed=4, per_type=5)
    assert len({p.asin for p in products}) == len(products) == 5 * len(PRODUCT_TYPES)
    assert all(re.fullmatch(r"B0[A-Z0-9]{8}", p.asin) for p in products)
    assert set(CATEGORIES) == {"beauty", "electronics", "fashion", "food", "furniture"}
    kinds = {k.query: k for k in PRODUCT_TYPES}
    for p in products:
        values = [v for _, vs in p.options for v in vs]
        assert len(values) == len(set(values)), p.asin  # an option value names one option
        assert p.pricing[0] <= p.price <= p.pricing[-1]
        for lacking in set(kinds[p.query].attributes) - set(p.attributes):  # its text names only its own
            assert attribute_reward(p, replace(GOAL, attributes=(lacking,)))[1] == 0, (p.asin, lacking)
    for k in PRODUCT_TYPES:  # a goal's option or attribute picks out one value of a pool
        for _, pool in k.options:
            for a, b in itertools.combinations(pool, 2):
                assert not fuzzy_match(normalize_color(a), normalize_color(b)), (k.query, a, b)
        for a, b in itertools.combinations(k.attributes, 2):
            assert not fuzzy_match(a, b) and a not in b and b not in a, (k.query, a, b)
    goals = generate_goals(products, seed=3)
    by_asin = {p.asin: p for p in products}
    for g in goals:
        p = by_asin[g.asin]
        assert g.instruction.endswith(f"{PRICE_CLAUSE}{g.price_upper:.2f} dollars")
        assert g.price_upper > p.price and g.price_upper % 10 == 0 and g.price_upper - p.price <= 40
        assert set(g.attributes) <= set(p.attributes) and all(a in g.instruction for a in g.attributes)
        assert dict(g.options).keys() == dict(p.options).keys() and all(v in g.instruction for _, v in g.options)
        assert get_reward(p, g, p.price, dict(g.options))[0] == 1.0


def test_search_ranks_matching_products_first():
    products = generate_products(seed=0, per_type=4)
    engine = SearchEngine(products)
    hits = engine.search("wireless earbuds noise cancelling")
    assert 0 < len(hits) <= 50 and hits[0].query == "wireless earbuds"
    assert engine.search("zzzz qqqq") == [] and engine.search("") == []
    assert search_words("i'm looking for some men's lounge pants in size xl, and price lower than 40.00 dollars") == (
        "men lounge pants size xl"
    )


def _bm25_product_by_product(engine: SearchEngine, query: str, k: int = 50) -> list[str]:
    """WebShop's BM25 as a loop over each word's products (what SearchEngine computed before it
    kept each word's weights as arrays): the reference its answers must equal, ties included."""
    from collections import Counter
    from math import log

    from lifemem_ray.lab.envs.webshop.catalogue import MAX_QUERY_TOKENS, analyze

    postings: dict[str, list[tuple[int, int]]] = {}
    lengths = []
    for i, p in enumerate(engine.products):
        option_text = ", and ".join(f"{name}: {', '.join(values)}" for name, values in p.options)
        tokens = analyze(" ".join([p.title, p.description, p.bullets[0] if p.bullets else "", option_text]))
        lengths.append(len(tokens))
        for tok, n in Counter(tokens).items():
            postings.setdefault(tok, []).append((i, n))
    avg, n_docs, k1, b = sum(lengths) / len(lengths), len(engine.products), engine.k1, engine.b
    scores: dict[int, float] = {}
    for tok in dict.fromkeys(analyze(query)[:MAX_QUERY_TOKENS]):
        post = postings.get(tok, [])
        if post:
            idf = log(1 + (n_docs - len(post) + 0.5) / (len(post) + 0.5))
            for doc, tf in post:
                norm = k1 * (1 - b + b * lengths[doc] / avg)
                scores[doc] = scores.get(doc, 0.0) + idf * tf * (k1 + 1) / (tf + norm)
    return [engine.products[d].asin for d, _ in sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))[:k]]


def test_search_answers_what_bm25_product_by_product_answers(env):
    engine = env.catalogue.engine
    queries = [search_words(t.instruction) for t in env.tasks("train", limit=60) + env.tasks("test", limit=20)]
    queries += ["usb", "gluten free", "black", "size xl black", "zzzz qqqq", "", "the and of"]  # ties, none, stop words
    for query in queries:
        assert [p.asin for p in engine.search(query)] == _bm25_product_by_product(engine, query), query
    assert [p.asin for p in engine.search("black", k=7)] == _bm25_product_by_product(engine, "black", 7)
    assert engine.search("black", k=0) == []


@pytest.mark.slow  # about 7 s of CPU to build 30,000 products, then 30 gold episodes (it took 10 minutes)
def test_a_catalogue_of_1000_products_a_type_builds_and_serves_its_goals():
    """Issue 32.9: products_per_type=1000, the top of its range, builds (it took minutes: each
    goal's search looped over every matching product in Python) and its goals are reachable."""
    big = WebShopEnv(products_per_type=1000)
    products = big.catalogue.products
    assert len(products) == 1000 * len(PRODUCT_TYPES)  # asins unique: one record each
    train, test = big.tasks("train"), big.tasks("test")
    assert len(train) + len(test) == len(big.catalogue.goals) > 5_000
    assert {t.payload["asin"] for t in train}.isdisjoint({t.payload["asin"] for t in test})
    gold = make_agent("gold")
    for task in train[:15] + test[:15]:
        actions = big.gold_actions(task)
        assert actions is not None and actions[0] == f"search[{search_words(task.instruction)}]"
        result = run_episode(big, gold, task, trajectory_id=f"gold/{task.id}")
        assert result.success and result.reward == 1.0, task.id


# --------------------------------------------------------------------------- tasks and splits


def test_tasks_split_by_goal(env):
    train, test = env.tasks("train"), env.tasks("test")
    assert len(train) > 400 and len(test) > 150
    assert {t.id for t in train}.isdisjoint({t.id for t in test})
    assert {t.payload["asin"] for t in train}.isdisjoint({t.payload["asin"] for t in test})
    assert {t.instruction for t in train}.isdisjoint({t.instruction for t in test})
    assert {t.metadata["task_type"] for t in train} == {t.metadata["task_type"] for t in test} == set(CATEGORIES)
    assert all(t.env == "webshop" and t.split == s for s, ts in (("train", train), ("test", test)) for t in ts)
    assert [t.id for t in WebShopEnv().tasks("test")] == [t.id for t in test]  # deterministic
    assert len({t.metadata["task_type"] for t in env.tasks("train", limit=20)}) == 5  # a prefix mixes them
    assert env.tasks("test", limit=5, seed=7) != test[:5] and len(env.tasks("test", limit=5, seed=7)) == 5
    capped = WebShopEnv(n_train=7, n_test=3)
    assert len(capped.tasks("train")) == 7 and len(capped.tasks("test")) == 3
    assert capped.tasks("test") == test[:3]
    with pytest.raises(InvalidArgumentError):
        env.tasks("dev")
    bad_options = (
        {"max_steps": 0},
        {"max_steps": 1001},
        {"products_per_type": 1},
        {"products_per_type": 1001},
        {"test_fraction": 1.0},
        {"n_test": -1},
        {"seed": "x"},
    )
    for bad in bad_options:
        with pytest.raises(InvalidArgumentError):
            WebShopEnv(**bad)


def test_gold_succeeds_on_every_task_of_both_splits(env):
    gold = make_agent("gold")
    paged = 0
    for task in env.tasks("train") + env.tasks("test"):
        actions = env.gold_actions(task)
        paged += "click[Next >]" in actions
        result = run_episode(env, gold, task, trajectory_id=f"gold/{task.id}")
        assert result.success and result.reward == 1.0, task.id
        assert result.steps == len(actions) <= env.max_steps
    assert paged > 0  # some targets sit on a later results page: the gold path pages to them


def test_random_agent_mostly_fails(env):
    tasks = env.tasks("test")
    agent = make_agent("random")
    results = [run_episode(env, agent, t, trajectory_id=f"random/{t.id}") for t in tasks]
    rate = sum(r.success for r in results) / len(results)
    assert rate < 0.15  # measured 0.056 (12 of 216)
    assert sum(r.reward for r in results) / len(results) < 0.5  # measured 0.30


# --------------------------------------------------------------------------- the protocol


def _goto_item(env: WebShopEnv, task: Task) -> list[str]:
    gold = env.gold_actions(task)
    env.reset(task)
    for action in gold[: gold.index(f"click[{task.payload['asin']}]") + 1]:
        env.step(action)
    return gold


def test_navigation_follows_webshop(env):
    task = next(t for t in env.tasks("test") if len(t.payload["options"]) == 2)
    obs, info = env.reset(task)
    assert obs == f"WebShop\nInstruction:\n{task.instruction}\n[Search]\n"
    assert info["valid_actions"] == [
        f"search[{task.instruction.split(PRICE_CLAUSE)[0]}]",
        f"search[{search_words(task.instruction)}]",
    ]
    asin = task.payload["asin"]
    gold = _goto_item(env, task)
    first = task.payload["options"][0][1]
    step = env.step(f"CLICK[{first.upper()}]")  # WebShop lower-cases what is clicked
    assert f"  [clicked button] {first} [clicked button_]\n" in step.observation
    assert f"click[{first}]" in step.info["valid_actions"] and "click[Buy Now]" in step.info["valid_actions"]
    sub = env.step("click[Features]")
    assert sub.info["valid_actions"] == ["click[Back to Search]", "click[< Prev]"]
    assert env.step("click[< Prev]").observation.count("[clicked button]") == 1  # options kept
    results = env.step("click[< Prev]").observation  # back to the results: options cleared
    assert f"[clicked button] {asin} [clicked button_]" in results and "Page " in results
    env.step(f"click[{asin}]")
    assert "[clicked button]" not in env.step("click[Reviews]").observation
    assert env.step("think[which one?]").observation == "OK."
    back = env.step("click[Back to Search]")
    assert back.observation == "[Search]\n" and back.info["valid_actions"][1].startswith("search[")
    for action in gold[: gold.index(f"click[{asin}]")]:
        page = env.step(action).observation
    assert f"\n[{asin}]\n" in page  # Back to Search cleared the visited products
    n = gold.count("click[Next >]") + 1  # the results page the target is on
    later = env.step("click[Next >]").observation
    assert later.startswith(f"[Back to Search]\nPage {n + 1} (Total results: 50)\n[< Prev]\n[Next >]\n\n[")


def test_invalid_actions_are_observations_and_the_step_limit_ends(env):
    task = env.tasks("test")[0]
    env.reset(task)
    cases = {
        "buy it": "Invalid action",
        "click[Buy Now]": "nothing to click named",
        "click[]": "needs an argument",
        "search[x" * 200: f"longer than {MAX_ACTION_CHARS}",
    }
    for action, said in cases.items():
        step = env.step(action)
        assert said in step.observation and not step.done and step.reward == 0.0
        assert len(step.observation) < 400
    env.step(f"search[{search_words(task.instruction)}]")
    step = env.step("search[anything else]")
    assert "no search bar on this page" in step.observation and not step.done
    assert "Invalid action" in env.step(123).observation  # type: ignore[arg-type]
    for _ in range(env.max_steps - 7):
        step = env.step("think[hmm]")
    assert step.done and step.info["success"] is False and step.info["score"] == 0.0
    assert step.info["valid_actions"] == [] and "Step limit (15)" in step.observation
    with pytest.raises(EnvStateError):
        env.step("click[Back to Search]")


def test_bad_tasks_and_states_are_refused():
    env = WebShopEnv()
    with pytest.raises(EnvStateError):
        env.step("search[x]")
    task = env.tasks("test")[0]
    with pytest.raises(TaskError):
        env.reset(replace(task, env="websearch"))
    with pytest.raises(TaskError):
        env.reset(replace(task, payload={"asin": task.payload["asin"]}))
    with pytest.raises(TaskError):
        env.reset(replace(task, payload={**task.payload, "asin": "B0ZZZZZZZZ"}))
    with pytest.raises(TaskError):
        env.reset("webshop-1")  # type: ignore[arg-type]
    env.close()
    env.close()


def test_buy_now_scores_the_purchase(env):
    task = next(t for t in env.tasks("train") if t.payload["options"])
    _goto_item(env, task)
    done = env.step("click[Buy Now]")  # no option chosen: partial reward, not a success
    n_attr, n_opt = len(task.payload["attributes"]), len(task.payload["options"])
    assert done.done and done.reward == pytest.approx((n_attr + 1) / (n_attr + n_opt + 1))
    assert done.info["success"] is False and done.info["score"] == done.reward
    assert done.info["purchased"] == task.payload["asin"] and done.info["options"] == {}
    assert done.observation.startswith("Thank you for shopping with us!\nPurchased: ")


# --------------------------------------------------------------------------- page layouts

_PRICE = r"\$\d+(?:\.\d+)?(?: to \$\d+(?:\.\d+)?)?"
_ASIN = r"(?:\[[A-Z0-9]{10}\]|\[clicked button\] [A-Z0-9]{10} \[clicked button_\])"
_OPTION = r"  (?:\[[^\n]*\]|\[clicked button\] [^\n]* \[clicked button_\])\n"
LAYOUTS = {
    "search": re.compile(r"\[Search\]\n"),
    "results": re.compile(
        r"\[Back to Search\]\nPage \d+ \(Total results: \d+\)\n(?:\[< Prev\]\n)?\[Next >\]\n"
        rf"(?:\n{_ASIN}\n[^\n]*\n{_PRICE}\n)*"
    ),
    "item": re.compile(
        rf"\[Back to Search\]\n\[< Prev\]\n(?:[^\n\[ ][^\n]*\n(?:{_OPTION})+)*[^\n]*\nPrice: {_PRICE}\n"
        r"Rating: N\.A\.\n\[Description\]\n\[Features\]\n\[Reviews\]\n\[Buy Now\]\n"
    ),
    "features": re.compile(r"\[Back to Search\]\n\[< Prev\]\n(?: [^\n]* \n)*"),
    "description": re.compile(r"\[Back to Search\]\n\[< Prev\]\n[^\n]*\n"),
}


def _layouts(text: str) -> list[str]:
    return [name for name, pattern in LAYOUTS.items() if pattern.fullmatch(text)]


def test_pages_have_the_released_layouts():
    assert _layouts(search_page()) == ["search"]
    assert _layouts(results_page([DRIVE, _product("B0BBBBBBBB", pricing=(3.0, 4.5))], 2, 50, {"B0BBBBBBBB"})) == [
        "results"
    ]
    assert _layouts(results_page([], 6, 50, set())) == ["results"]
    assert _layouts(item_page(DRIVE, {"size": "32gb"})) == ["item"]
    assert _layouts(item_page(_product("B0CCCCCCCC", options=()), {})) == ["item"]
    assert _layouts(sub_page(DRIVE, "Features")) == ["features"]
    assert _layouts(sub_page(DRIVE, "Description")) == ["description"]
    assert results_page([DRIVE], 1, 1, set()) == (
        "[Back to Search]\nPage 1 (Total results: 1)\n[Next >]\n\n"
        "[B0AAAAAAAA]\nKalo AB12 USB Flash Drive, High Speed\n$12.5\n"
    )


def test_every_page_of_an_episode_has_a_released_layout(env):
    task = next(t for t in env.tasks("test") if t.payload["options"])
    gold = _goto_item(env, task)
    pages = [env.step(a).observation for a in ("click[Description]", "click[< Prev]", "click[Features]")]
    pages += [env.step(a).observation for a in ("click[< Prev]", gold[-2], "click[< Prev]", "click[Back to Search]")]
    kinds = [_layouts(p) for p in pages]
    assert kinds == [["description"], ["item"], ["features"], ["item"], ["item"], ["results"], ["search"]]


@pytest.mark.skipif(not RELEASED.is_file(), reason="the shared LifeMem trainset is absent")
def test_released_observations_and_actions_fit_the_protocol():
    rows = [json.loads(line) for line in RELEASED.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert len(rows) == 39
    buttons = {"Back to Search", "Next >", "< Prev", "Description", "Features", "Reviews", "Buy Now"}
    seen_kinds: set[str] = set()
    for row in rows:
        for m in row["messages"]:
            if m["role"] == "assistant":  # roles inverted in the release: pages
                kinds = _layouts(m["content"])
                assert len(kinds) == 1, m["content"][:200]
                seen_kinds.update(kinds)
            else:
                action = m["content"].strip().splitlines()[-1]
                verb, arg = re.fullmatch(r"(search|click)\[(.*)\]", action).groups()  # type: ignore[union-attr]
                assert verb == "search" or arg in buttons or re.fullmatch(r"B[0-9A-Z]{9}", arg) or arg == arg.lower()
    assert seen_kinds == set(LAYOUTS)


# --------------------------------------------------------------------------- registry and agents


def test_registry_builds_it_and_react_agent_runs_it():
    from support.openai_stub import OpenAIStub, Reply

    from lifemem_ray.lab.agents import ReActAgent
    from lifemem_ray.llm.llm_config import LLMConfig

    env = make_env("webshop", n_train=5, n_test=5)
    assert isinstance(env, WebShopEnv) and len(env.tasks("test")) == 5
    task = env.tasks("test")[0]
    gold = env.gold_actions(task)
    assert gold is not None
    script = [{"thought": "search off the list", "action": "search[anything]"}]  # refused: not listed
    script += [{"thought": "t", "action": a.lower() if a.startswith("click[B") else a} for a in gold]
    replies = iter(script)
    with OpenAIStub(responder=lambda r: Reply.json(next(replies))) as stub:
        config = LLMConfig(backend="openai", base_url=stub.base_url, model="stub", timeout_s=10, max_retries=1)
        agent = ReActAgent(config)
        try:
            result = run_episode(env, agent, task, trajectory_id="react", limits=EpisodeLimits(max_steps=15))
        finally:
            agent.close()
        prompt = stub.requests[-1]["messages"][1]["content"]
    # the refused answer became the agent's no-op, which the environment answers as invalid
    assert result.success and [s.action for s in result.trajectory.steps] == ["invalid_action", *gold]
    assert result.trajectory.steps[0].observation.startswith("Invalid action")
    assert "- click[Buy Now]" in prompt  # the item page's clickables, listed
    assert "Current observation:\n<observation>[Back to Search]\n[< Prev]\n" in prompt  # the page, fenced as data
    env.close()
