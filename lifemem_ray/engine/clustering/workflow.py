"""What a trajectory *does*: abstract action tokens and a structural workflow vector.

LifeMem clusters by functional workflow, not by topic. Without an LLM the offline
policy compares trajectories by the shape of their action sequence: each step's
action is reduced to a *token* (its verb or tool name, arguments dropped), each
token to an environment-invariant *category*, and the sequence to a hashed bag of
unigrams and bigrams. The cosine of two workflow vectors is the structural
similarity; the mean resultant length of a cluster's vectors measures how coherent
its workflow is.

Tokens (:func:`action_tokens`, one or more per step, lower case):

* ``Name[arg]`` / ``Action N: Name[arg]`` -> ``name`` (hotpotqa ``search``, ``lookup``,
  ``finish``; toolqa ``loaddb``, ``sqlinterpreter``, ``filterdb``, ``getvalue``,
  ``calculate``); WebShop ``click[...]`` keeps key targets as suffixes:
  ``click:buy`` (Buy Now), ``click:next``, ``click:prev``, ``click:back`` (Back to
  Search), ``click:info`` (Description / Features / Reviews / Attributes); any other
  target (product ids, options) is plain ``click``.
* ``[Api(...)]`` and ``Api(...)`` -> ``api`` (apibank ``toolsearcher``, ``finish``, ...).
* a JSON call ``{"name": "get_order_details", ...}`` -> ``get_order_details``.
* ``Action: Operation`` + a SQL block -> ``sql:<statement kind>`` (``select``, ``insert``,
  ``update``, ``delete``, ``create``, ...; ``with`` counts as ``select``; else
  ``sql:other``); ``Action: Answer`` -> ``answer``.
* ```CLICK [id]``` (mind2web) -> ``click`` / ``type`` / ``select``.
* code with ``agent.f(...)`` calls (miniwob) -> one token per call, in order:
  ``click_xpath``, ``type``, ``press``, ... (at most 16 per step).
* plain text: a short acknowledgement (``OK.``) -> ``ack``; prose (a sentence, several
  lines, or more than 12 words; e.g. taubench's final reply) -> ``respond``; else
  the first word, letters only (scienceworld ``open``, ``look``, ``wait1`` -> ``wait``);
  a movement verb with a direction (``move east``) -> ``go``; ``open`` / ``close`` of
  anything but a door (``open fridge 1``) -> ``open:obj`` / ``close:obj``.
* no action (a thought-only turn) -> ``think``; nothing usable -> ``other``.

Categories (:func:`canonical_token`), chosen so that the same functional move gets
the same name in every environment:

==========  ==================================================================
SEARCH      find candidates by keywords: search, toolsearcher, find_*, *search*
INSPECT     read what is already at hand: lookup, look, examine, read, inventory,
            use (a thermometer), get_*, list_*, check_*, click:info
NAVIGATE    move without choosing: go (move east), open / close a door, teleport,
            scroll, press, movemouse, click:back / click:next / click:prev
INPUT       enter free text: type, fill
SELECT      choose an element or object: click, click_xpath, click_option,
            select, focus
MANIPULATE  handle a physical object: pick, take, put, place, move (an object),
            drop, pour, open:obj / close:obj
QUERY       structured data retrieval: sql:select, sqlinterpreter, loaddb,
            filterdb, getvalue, query_*
MODIFY      change state: sql:insert / update / delete / create ..., cancel_*,
            modify_*, exchange_*, return_*, update_*, add_*, set_*, mix, heat,
            cool, clean, slice, cook, activate, deactivate
COMPUTE     calculate, *calculat*, compute
ANSWER      give the result: finish, answer, respond, submit
COMMIT      an irreversible transaction: click:buy, buy, book_*, reserve_*,
            schedule_*, rent_*, request_*, create_*, pay*
THINK       a turn with no action
OTHER       ack, wait, anything unknown
==========  ==================================================================

Token features (:func:`workflow_features`; :mod:`lifemem_ray.engine.clustering.steps` adds the abstract
steps' frames and argument roles to them): raw-token unigrams (weighted ``1 + ln(count)``),
bigrams over the run-collapsed sequence (start ``^`` and end ``$`` markers) and a
self-loop flag per repeated token, and the same over categories at 0.6 weight, so
a repeated loop does not dominate. Vectors are signed feature hashes (blake2b,
stable across processes), L2-normalised. Signed hashing keeps inner products
unbiased, so unrelated workflows may score slightly below 0: clip at 0 where a
[0, 1] similarity is needed.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from functools import lru_cache

import numpy as np

from lifemem_ray.core.errors import InvalidArgumentError
from lifemem_ray.core.model import Trajectory

__all__ = [
    "CATEGORIES",
    "action_tokens",
    "canonical_token",
    "hashed_vector",
    "step_tokens",
    "workflow_features",
    "workflow_summary",
    "workflow_vector",
    "workflow_vectors",
]

CATEGORIES = (
    "SEARCH", "INSPECT", "NAVIGATE", "INPUT", "SELECT", "MANIPULATE", "QUERY",
    "MODIFY", "COMPUTE", "ANSWER", "COMMIT", "THINK", "OTHER",
)  # fmt: skip

MAX_ACTION_CHARS = 2000  # per-step work is bounded: only the head of an action is read
SQL_LOOKAHEAD_CHARS = 400  # the statement follows "Action: Operation" closely
MAX_TOKENS_PER_STEP = 16
MAX_TOKEN_CHARS = 48
DEFAULT_DIM = 256
CANONICAL_WEIGHT = 0.6  # category features relative to raw-token features
LOOP_WEIGHT = 0.5  # "this token repeats" feature, whatever the number of repeats

# --------------------------------------------------------------------------- tokens

_LABEL = re.compile(r"[ \t\r\n]*(?:\*\*)?Action[ \t]*\d*[ \t]*:(?:\*\*)?[ \t\r\n]*")
_KEYWORD = re.compile(r"(Operation|(?:Final[ \t]+)?Answer)\b", re.I)
_SQL_FENCED = re.compile(r"```[ \t]*(?:sql|mysql|sqlite|postgresql)?[ \t]*\n?[ \t\r\n]*([A-Za-z]+)", re.I)
_SQL_BARE = re.compile(
    r"^[ \t]*(select|insert|update|delete|with|create|drop|alter|replace|truncate|show|describe|pragma)\b",
    re.I | re.M,
)
# "Operation: UPDATE ..." on one line (how a skill's step names a statement).
_SQL_INLINE = re.compile(
    r"^[ \t]*Operation[ \t]*:?[ \t]*(select|insert|update|delete|with|create|drop|alter|replace|truncate|show|describe|pragma)\b",
    re.I,
)
_AGENT_CALL = re.compile(r"\bagent\.([A-Za-z_]\w{0,47})\s*\(")
_CALL = re.compile(r"([A-Za-z_][\w.]{0,95})[ \t]*[\[(]")
_BRACKET_CALL = re.compile(r"\[[ \t]*([A-Za-z_][\w.]{0,95})[ \t]*\(")
_BACKTICK_WORD = re.compile(r"`+[ \t]*([A-Za-z_]+)")
_JSON_NAME = re.compile(r'"(?:name|tool|tool_name|function|action)"\s*:\s*"([A-Za-z_][\w.\-]{0,95})"')
_CLICK_TARGET = re.compile(r"click\[([^\]\n]{0,60})\]", re.I)
_LETTERS = re.compile(r"[^\W\d_]+")
_NON_ALNUM = re.compile(r"[^a-z ]+")

_SQL_KINDS = {
    "select": "select", "with": "select", "show": "show", "describe": "describe", "desc": "describe",
    "explain": "explain", "pragma": "pragma", "insert": "insert", "update": "update", "delete": "delete",
    "create": "create", "drop": "drop", "alter": "alter", "replace": "replace", "truncate": "truncate",
    "merge": "merge",
}  # fmt: skip
_CLICK_SUFFIX = {
    "buy now": "click:buy", "buy": "click:buy", "next": "click:next", "prev": "click:prev",
    "previous": "click:prev", "back to search": "click:back", "back": "click:back",
    "description": "click:info", "features": "click:info", "reviews": "click:info", "attributes": "click:info",
}  # fmt: skip
_ACKS = frozenset({"ok", "okay", "sure", "understood", "got it", "yes", "alright", "noted", "ok sure"})
_MOVE_VERBS = frozenset({"move", "go", "walk", "run", "head", "travel"})
DIRECTION_WORDS = frozenset(
    [
        "north",
        "south",
        "east",
        "west",
        "up",
        "down",
        "northeast",
        "northwest",
        "southeast",
        "southwest",
        "left",
        "right",
        "forward",
        "backward",
    ]
)
_DOOR = re.compile(r"\b(?:door|gate|doorway|hatch)\b", re.I)
_PROSE_STARTS = frozenset(
    [
        "i",
        "i'm",
        "i've",
        "i'll",
        "i'd",
        "we",
        "we've",
        "we'll",
        "you",
        "your",
        "the",
        "this",
        "that",
        "these",
        "it",
        "it's",
        "here",
        "there",
        "thank",
        "thanks",
        "sorry",
        "hello",
        "hi",
        "dear",
        "unfortunately",
        "great",
        "please",
        "based",
        "according",
        "since",
        "as",
        "to",
        "in",
        "my",
        "our",
    ]
)


def action_tokens(traj: Trajectory) -> list[str]:
    """Ordered abstract action tokens of a trajectory: one or more per step."""
    out: list[str] = []
    for step in traj.steps:
        out.extend(step_tokens(step.action))
    return out


def step_tokens(action: str) -> tuple[str, ...]:
    """Tokens of one action text; robust to any input, bounded work per call."""
    if not action or not action.strip():
        return ("think",)
    return _step_tokens_cached(action[:MAX_ACTION_CHARS])


@lru_cache(maxsize=8192)
def _step_tokens_cached(s: str) -> tuple[str, ...]:
    m = _LABEL.match(s)
    if m:
        s = s[m.end() :]
    if not s:
        return ("other",)
    head = s[0]

    m = _KEYWORD.match(s)
    if m:
        if m.group(1).lower() == "operation":
            return (_sql_token(s[:SQL_LOOKAHEAD_CHARS]),)
        return ("answer",)
    if s.startswith("```") or ("agent." in s and _AGENT_CALL.search(s)):
        return _code_tokens(s)
    if head == "{":
        m = _JSON_NAME.search(s)
        return (_name(m.group(1)),) if m else ("call",)
    if head == "[":
        m = _BRACKET_CALL.match(s)
        if m:
            return (_name(m.group(1)),)
    elif head == "`":
        m = _BACKTICK_WORD.match(s)
        if m:
            return (_name(m.group(1)),)
    m = _CALL.match(s)
    if m:
        name = _name(m.group(1))
        if name == "click":
            return (_click_token(s),)
        return (name,)
    return (_plain_token(s),)


def _name(raw: str) -> str:
    """A tool/verb name as a token: last dotted segment, lower case, bounded length."""
    name = raw.rsplit(".", 1)[-1].lower()[:MAX_TOKEN_CHARS]
    return name or "other"


def _sql_token(s: str) -> str:
    m = _SQL_FENCED.search(s) or _SQL_BARE.search(s) or _SQL_INLINE.search(s)
    if not m:
        return "sql:other"
    return "sql:" + _SQL_KINDS.get(m.group(1).lower(), "other")


def _code_tokens(s: str) -> tuple[str, ...]:
    calls = _AGENT_CALL.findall(s, 0, MAX_ACTION_CHARS)
    if calls:
        return tuple(_name(c) for c in calls[:MAX_TOKENS_PER_STEP])
    m = _SQL_BARE.search(s)
    if m:
        return (_sql_token(s),)
    body = s.strip("`").lstrip()
    if body[:6].lower().startswith(("python", "py\n", "js\n", "bash")):
        body = body.split("\n", 1)[-1].lstrip()
    m = _CALL.match(body)
    if m:
        return (_name(m.group(1)),)
    return ("code",)


def _click_token(s: str) -> str:
    m = _CLICK_TARGET.match(s)
    if not m:
        return "click"
    target = " ".join(_NON_ALNUM.sub(" ", m.group(1).lower()).split())
    return _CLICK_SUFFIX.get(target, "click")


def _plain_token(s: str) -> str:
    stripped = s.strip()
    words = stripped.split(None, 13)
    if not words:
        return "other"
    short = " ".join(_NON_ALNUM.sub(" ", stripped[:40].lower()).split())
    if len(words) <= 3 and short in _ACKS:
        return "ack"
    first = words[0].lower()
    if len(words) > 12 or stripped[-1] in ".!?" or "\n" in stripped or first.strip(",.:;!?\"'*") in _PROSE_STARTS:
        return "respond"
    m = _LETTERS.search(first)
    if not m:
        return "other"
    verb = m.group(0)[:MAX_TOKEN_CHARS]
    second = words[1].lower().strip(",.:;!?\"'") if len(words) > 1 else ""
    if verb in _MOVE_VERBS and second in DIRECTION_WORDS:
        return "go"  # move east, walk north: navigation, not moving an object
    if verb in ("open", "close") and len(words) > 1 and not _DOOR.search(stripped):
        return verb + ":obj"  # open fridge 1: a container, not a way
    return verb


# --------------------------------------------------------------------------- categories

_EXACT: dict[str, str] = {
    # SEARCH
    "search": "SEARCH", "toolsearcher": "SEARCH", "find": "SEARCH", "locate": "SEARCH",
    # INSPECT
    "lookup": "INSPECT", "look": "INSPECT", "examine": "INSPECT", "read": "INSPECT", "inventory": "INSPECT",
    "inspect": "INSPECT", "view": "INSPECT", "check": "INSPECT", "use": "INSPECT", "click:info": "INSPECT",
    # NAVIGATE
    "go": "NAVIGATE", "goto": "NAVIGATE", "open": "NAVIGATE", "close": "NAVIGATE", "teleport": "NAVIGATE",
    "scroll": "NAVIGATE", "press": "NAVIGATE", "hover": "NAVIGATE", "movemouse": "NAVIGATE",
    "navigate": "NAVIGATE", "back": "NAVIGATE", "click:back": "NAVIGATE", "click:next": "NAVIGATE",
    "click:prev": "NAVIGATE", "enter": "NAVIGATE",
    # INPUT
    "type": "INPUT", "fill": "INPUT", "input": "INPUT", "type_text": "INPUT",
    # SELECT
    "click": "SELECT", "click_xpath": "SELECT", "click_option": "SELECT", "click_element": "SELECT",
    "select": "SELECT", "choose": "SELECT", "focus": "SELECT", "tap": "SELECT",
    # MANIPULATE
    "pick": "MANIPULATE", "take": "MANIPULATE", "put": "MANIPULATE", "place": "MANIPULATE", "move": "MANIPULATE",
    "drop": "MANIPULATE", "pour": "MANIPULATE", "grab": "MANIPULATE", "open:obj": "MANIPULATE",
    "close:obj": "MANIPULATE",
    # QUERY
    "sqlinterpreter": "QUERY", "loaddb": "QUERY", "filterdb": "QUERY", "getvalue": "QUERY",
    "sql:select": "QUERY", "sql:show": "QUERY", "sql:describe": "QUERY", "sql:explain": "QUERY",
    "sql:pragma": "QUERY", "sql:other": "QUERY",
    # MODIFY
    "sql:insert": "MODIFY", "sql:update": "MODIFY", "sql:delete": "MODIFY", "sql:create": "MODIFY",
    "sql:drop": "MODIFY", "sql:alter": "MODIFY", "sql:replace": "MODIFY", "sql:truncate": "MODIFY",
    "sql:merge": "MODIFY", "mix": "MODIFY", "activate": "MODIFY", "deactivate": "MODIFY", "connect": "MODIFY",
    "disconnect": "MODIFY", "heat": "MODIFY", "cool": "MODIFY", "clean": "MODIFY", "toggle": "MODIFY",
    "slice": "MODIFY", "chop": "MODIFY", "dice": "MODIFY", "cook": "MODIFY", "prepare": "MODIFY",
    # COMPUTE
    "calculate": "COMPUTE", "calculator": "COMPUTE", "compute": "COMPUTE", "eval": "COMPUTE",
    # ANSWER
    "finish": "ANSWER", "answer": "ANSWER", "respond": "ANSWER", "submit": "ANSWER",
    "final_answer": "ANSWER", "reply": "ANSWER",
    # COMMIT
    "click:buy": "COMMIT", "buy": "COMMIT", "purchase": "COMMIT", "book": "COMMIT", "checkout": "COMMIT",
    "pay": "COMMIT", "order": "COMMIT",
    # THINK / OTHER
    "think": "THINK", "ack": "OTHER", "wait": "OTHER", "call": "OTHER", "code": "OTHER", "other": "OTHER",
}  # fmt: skip

_SUBSTRINGS: tuple[tuple[str, str], ...] = (
    ("search", "SEARCH"),
    ("calculat", "COMPUTE"),
    ("lookup", "INSPECT"),
)
_PREFIXES: tuple[tuple[str, str], ...] = (
    ("sql:", "QUERY"),
    ("click", "SELECT"),
    ("make_payment", "COMMIT"), ("book", "COMMIT"), ("buy", "COMMIT"), ("purchase", "COMMIT"),
    ("reserve", "COMMIT"), ("schedule", "COMMIT"), ("register", "COMMIT"), ("rent", "COMMIT"),
    ("request", "COMMIT"), ("create", "COMMIT"), ("submit_", "COMMIT"), ("pay", "COMMIT"),
    ("checkout", "COMMIT"), ("place_order", "COMMIT"),
    ("cancel", "MODIFY"), ("modify", "MODIFY"), ("exchange", "MODIFY"), ("return", "MODIFY"),
    ("update", "MODIFY"), ("delete", "MODIFY"), ("remove", "MODIFY"), ("add", "MODIFY"), ("set", "MODIFY"),
    ("change", "MODIFY"), ("edit", "MODIFY"), ("log_", "MODIFY"), ("record", "MODIFY"), ("save", "MODIFY"),
    ("share", "MODIFY"), ("insert", "MODIFY"), ("transfer", "MODIFY"), ("send", "MODIFY"),
    ("upload", "MODIFY"), ("write", "MODIFY"), ("enable", "MODIFY"), ("disable", "MODIFY"),
    ("query", "QUERY"), ("filter", "QUERY"), ("load", "QUERY"), ("sql", "QUERY"),
    ("find", "SEARCH"), ("locate", "SEARCH"),
    ("get", "INSPECT"), ("list", "INSPECT"), ("check", "INSPECT"), ("fetch", "INSPECT"),
    ("retrieve", "INSPECT"), ("read", "INSPECT"), ("view", "INSPECT"), ("show", "INSPECT"),
    ("describe", "INSPECT"), ("examine", "INSPECT"), ("inspect", "INSPECT"), ("look", "INSPECT"),
    ("verify", "INSPECT"),
    ("go_", "NAVIGATE"), ("goto", "NAVIGATE"), ("navigate", "NAVIGATE"), ("open", "NAVIGATE"),
    ("scroll", "NAVIGATE"), ("press", "NAVIGATE"), ("hover", "NAVIGATE"),
    ("type", "INPUT"), ("fill", "INPUT"), ("input", "INPUT"),
    ("select", "SELECT"), ("choose", "SELECT"), ("pick", "MANIPULATE"),
    ("finish", "ANSWER"), ("answer", "ANSWER"), ("respond", "ANSWER"), ("reply", "ANSWER"),
    ("final", "ANSWER"),
    ("compute", "COMPUTE"), ("calc", "COMPUTE"),
)  # fmt: skip


@lru_cache(maxsize=16384)
def canonical_token(token: str) -> str:
    """The environment-invariant category of a token (one of :data:`CATEGORIES`)."""
    cat = _EXACT.get(token)
    if cat is not None:
        return cat
    for sub, cat in _SUBSTRINGS:
        if sub in token:
            return cat
    for prefix, cat in _PREFIXES:
        if token.startswith(prefix):
            return cat
    return "OTHER"


# --------------------------------------------------------------------------- features and vectors


def workflow_features(tokens: Sequence[str]) -> dict[str, float]:
    """Bag-of-structure features of a token sequence, for hashing into a vector.

    For raw tokens (``t``) and their categories (``c``): unigrams weighted
    ``1 + ln(count)``; bigrams over the run-collapsed sequence with ``^``/``$``
    markers, so ``search x2 -> finish`` and ``search x4 -> finish`` share every
    bigram; and a self-loop feature ``L`` (half weight) per token that repeats.
    Category features are scaled by CANONICAL_WEIGHT: they let workflows of
    different environments align without drowning the environment's own tools.
    """
    counts: Counter[str] = Counter()
    if tokens:
        cats = [canonical_token(t) for t in tokens]
        for prefix, seq in (("t", tokens), ("c", cats)):
            counts.update(f"{prefix}1:{x}" for x in seq)
            runs = [x for i, x in enumerate(seq) if i == 0 or seq[i - 1] != x]
            counts.update(f"{prefix}2:{a}>{b}" for a, b in zip(["^", *runs], [*runs, "$"], strict=True))
            counts.update(f"{prefix}L:{x}" for i, x in enumerate(seq) if i and seq[i - 1] == x)
    out: dict[str, float] = {}
    for feat, n in counts.items():
        w = 1.0 + math.log(n) if feat[1] != "L" else LOOP_WEIGHT
        out[feat] = w * CANONICAL_WEIGHT if feat[0] == "c" else w
    return out


@lru_cache(maxsize=65536)
def _feature_hash(feature: str) -> int:
    return int.from_bytes(hashlib.blake2b(feature.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def _empty_vector(dim: int) -> np.ndarray:
    h = _feature_hash("__empty_workflow__")
    v = np.zeros(dim, dtype=np.float32)
    v[h % dim] = 1.0
    return v


def workflow_vector(tokens: Sequence[str], dim: int = DEFAULT_DIM) -> np.ndarray:
    """A float32 unit vector of the token workflow; the empty workflow has its own fixed vector."""
    return hashed_vector(workflow_features(tokens), dim)


def hashed_vector(features: dict[str, float], dim: int = DEFAULT_DIM) -> np.ndarray:
    """Signed feature hashing of weighted features into a float32 unit vector (no features:
    the empty workflow's fixed vector)."""
    if dim < 2:
        raise InvalidArgumentError(f"must be at least 2, got {dim}", where="dim")
    idx = np.empty(len(features), dtype=np.int64)
    val = np.empty(len(features), dtype=np.float64)
    for i, (feat, w) in enumerate(features.items()):
        h = _feature_hash(feat)
        idx[i] = h % dim
        val[i] = -w if (h >> 63) & 1 else w
    v = np.bincount(idx, weights=val, minlength=dim)
    norm = float(np.linalg.norm(v))
    if norm == 0.0:
        return _empty_vector(dim)
    return (v / norm).astype(np.float32)


def workflow_vectors(trajs: Iterable[Trajectory], dim: int = DEFAULT_DIM) -> np.ndarray:
    """Workflow vectors of several trajectories, shape (n, dim), float32."""
    rows = [workflow_vector(action_tokens(t), dim) for t in trajs]
    if not rows:
        return np.zeros((0, dim), dtype=np.float32)
    return np.stack(rows)


def workflow_summary(tokens: Sequence[str], max_runs: int = 16) -> str:
    """Readable form, runs collapsed: ``search -> click x3 -> click:buy``; long ones elided."""
    runs: list[list] = []
    for t in tokens:
        if runs and runs[-1][0] == t:
            runs[-1][1] += 1
        else:
            runs.append([t, 1])
    parts = [t if n == 1 else f"{t} x{n}" for t, n in runs]
    if not parts:
        return "(empty)"
    if len(parts) > max_runs > 2:
        hidden = len(parts) - (max_runs - 1)
        parts = [*parts[: max_runs - 2], f"... ({hidden} more)", *parts[-1:]]
    return " -> ".join(parts)
