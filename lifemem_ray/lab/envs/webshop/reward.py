"""WebShop's reward for a purchase, after ``web_agent_site/engine/goal.py`` (princeton-nlp/WebShop).

``get_reward`` there scores the bought product against the goal::

    reward = (n_attribute_matches + n_option_matches + [price <= price_upper])
             / (len(goal attributes) + len(goal options) + 1)  * r_type

* attributes (``get_attribute_reward``): a goal attribute matches when one of the product's
  attributes has a fuzzy token-set ratio > 85 with it, else when it occurs (lower case) in the
  product's title, bullet points (Features) or description;
* options (``get_option_reward``): a goal option matches when one of the chosen options, both
  through ``normalize_color`` (the first colour word of ``COLOR_SET`` it contains), has a fuzzy
  token-set ratio > 85 with it;
* price: the product's price (one draw in its price range) is at most the goal's upper bound;
* type (``get_type_reward``): 1.0 when the query matches (the same WebShop ``query``), the
  ``product_category`` paths share two levels, or the title noun overlap is over 0.2; else 0.5;
  0.1 when the noun overlap is under 0.1, and 0.0 when it is 0.

Where this follows the original and where it simplifies:

* the fuzzy ratio is thefuzz's ``token_set_ratio`` (full processing: ASCII only, non-word
  characters to spaces, lower case; the score rounded to an integer) computed exactly here, its
  Indel ratio from a longest common subsequence (inputs cut at :data:`MAX_MATCH_CHARS`);
* the title nouns are not parsed by spaCy: the generated catalogue records, for each title,
  the nouns it put into it (brand, model code, the product type's nouns);
* reviews are empty in WebShop's release (its ratings read ``N.A.``), as they are here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from lifemem_ray.lab.envs.webshop.catalogue import Goal, Product

__all__ = [
    "COLOR_SET",
    "FUZZY_THRESHOLD",
    "attribute_reward",
    "fuzzy_match",
    "get_reward",
    "normalize_color",
    "option_reward",
    "token_set_ratio",
    "type_reward",
]

FUZZY_THRESHOLD = 85  # goal.py: ``score > 85``
MAX_MATCH_CHARS = 200  # a processed string is cut here: the LCS is quadratic

# web_agent_site/engine/normalize.py, in its order (the first one contained wins).
# fmt: off
COLOR_SET = (
    "alabaster", "apricot", "aqua", "ash", "asphalt", "azure", "banana", "beige", "black", "blue", "blush",
    "bordeaux", "bronze", "brown", "burgundy", "camel", "camo", "caramel", "champagne", "charcoal", "cheetah",
    "chestnut", "chocolate", "christmas", "coffee", "cognac", "copper", "coral", "cranberry", "cream",
    "crystal", "dark", "denim", "eggplant", "elephant", "espresso", "fuchsia", "gold", "granite", "grape",
    "graphite", "grass", "gray", "green", "grey", "heather", "indigo", "ivory", "ivy", "khaki", "lavender",
    "lemon", "leopard", "light", "lilac", "lime", "magenta", "maroon", "mauve", "merlot", "midnight", "mint",
    "mocha", "multicolor", "mushroom", "mustard", "natural", "navy", "nude", "olive", "orange", "peach",
    "pewter", "pink", "plum", "purple", "rainbow", "red", "rose", "royal", "rust", "sand", "sapphire",
    "seashell", "silver", "skull", "slate", "steel", "stone", "stonewash", "sunflower", "tan", "taupe", "teal",
    "tiger", "turquoise", "violet", "walnut", "wheat", "white", "wine", "yellow",
)
# fmt: on

_NON_WORD = re.compile(r"\W", re.UNICODE)


def normalize_color(text: str) -> str:
    """WebShop's ``normalize_color``: the first colour of COLOR_SET the text contains, else the text."""
    for color in COLOR_SET:
        if color in text:
            return color
    return text


def _process(text: str) -> str:
    """thefuzz's ``full_process``: ASCII only, non-word characters to spaces, lower case, stripped."""
    text = text.encode("ascii", "ignore").decode("ascii")
    return _NON_WORD.sub(" ", text).lower().strip()[:MAX_MATCH_CHARS]


def _lcs(a: str, b: str) -> int:
    """Length of the longest common subsequence (one row of the dynamic programme at a time)."""
    if len(a) < len(b):
        a, b = b, a
    row = [0] * (len(b) + 1)
    for ch in a:
        prev_diag = 0
        for j, other in enumerate(b, 1):
            keep = row[j]
            row[j] = prev_diag + 1 if ch == other else max(row[j], row[j - 1])
            prev_diag = keep
    return row[len(b)]


def _ratio(a: str, b: str) -> float:
    """rapidfuzz's ``fuzz.ratio``: the normalised Indel similarity, 0-100."""
    total = len(a) + len(b)
    return 100.0 if total == 0 else 100.0 * 2 * _lcs(a, b) / total


def token_set_ratio(s1: str, s2: str) -> int:
    """thefuzz's ``token_set_ratio`` with full processing (rounded to an integer, as thefuzz does)."""
    a, b = set(_process(s1).split()), set(_process(s2).split())
    if not a or not b:
        return 0
    common = sorted(a & b)
    diff_ab, diff_ba = " ".join(sorted(a - b)), " ".join(sorted(b - a))
    if common and (not diff_ab or not diff_ba):
        return 100  # one token set holds the other
    sect = " ".join(common)
    t1 = f"{sect} {diff_ab}".strip()
    t2 = f"{sect} {diff_ba}".strip()
    scores = [_ratio(t1, t2)]
    if sect:
        scores += [_ratio(sect, t1), _ratio(sect, t2)]
    return round(max(scores))


def fuzzy_match(a: str, b: str) -> bool:
    """WebShop's match test: token-set ratio over 85."""
    return token_set_ratio(a, b) > FUZZY_THRESHOLD


def type_reward(product: Product, goal: Goal) -> dict[str, Any]:
    """``get_type_reward``: query, category-path and title-noun agreement."""
    query_match = product.query == goal.query
    bought_path = {x.strip() for x in product.product_category.split("›")}
    goal_path = {x.strip() for x in goal.product_category.split("›")}
    category_match = len(bought_path & goal_path) >= 2
    wanted = list(goal.name_nouns)
    title_score = 0.2 if not wanted else len(set(product.nouns) & set(wanted)) / len(wanted)
    r_type = 1.0
    if not (query_match or category_match or title_score > 0.2):
        r_type = 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return {"r_type": r_type, "query_match": query_match, "category_match": category_match, "title_score": title_score}


def attribute_reward(product: Product, goal: Goal) -> tuple[float, int]:
    """``get_attribute_reward``: (fraction of goal attributes matched, how many)."""
    title, bullets, description = product.title.lower(), " ".join(product.bullets).lower(), product.description.lower()
    matches = 0
    for wanted in goal.attributes:
        if any(fuzzy_match(have, wanted) for have in product.attributes) or (
            wanted in title or wanted in bullets or wanted in description
        ):
            matches += 1
    return (matches / len(goal.attributes) if goal.attributes else 0.0), matches


def option_reward(chosen: Iterable[str], wanted: Iterable[str]) -> tuple[float | None, int]:
    """``get_option_reward``: (fraction of goal options matched or None without any, how many)."""
    chosen_n = [normalize_color(o) for o in chosen]
    wanted_n = [normalize_color(o) for o in wanted]
    matches = sum(1 for g in wanted_n if any(fuzzy_match(p, g) for p in chosen_n))
    return (matches / len(wanted_n) if wanted_n else None), matches


def get_reward(product: Product, goal: Goal, price: float, options: Mapping[str, str]) -> tuple[float, dict[str, Any]]:
    """``get_reward`` (verbose): the reward in [0, 1] and its parts."""
    r_type = type_reward(product, goal)
    r_price = price <= goal.price_upper
    r_att, n_att = attribute_reward(product, goal)
    wanted = [value for _, value in goal.options]
    r_option, n_opt = option_reward(options.values(), wanted)
    denominator = len(goal.attributes) + len(wanted) + 1
    reward = (n_att + n_opt + int(r_price)) / denominator * r_type["r_type"]
    info: dict[str, Any] = {
        **r_type,
        "r_att": r_att,
        "w_att": len(goal.attributes) / denominator,
        "r_price": r_price,
        "w_price": 1 / denominator,
    }
    if r_option is not None:
        info["r_option"] = r_option
        info["w_option"] = len(wanted) / denominator
    return reward, info
