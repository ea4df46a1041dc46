"""Abstract steps: one action as a verb frame whose arguments are reduced to roles.

Two trajectories follow the same workflow when they do the same things to the same *kinds*
of things, whatever the objects are called: ``use thermometer on water`` and ``use
thermometer on orange juice`` are one step of one procedure once the substance is seen as
*the target named in the goal*. A step's frame keeps the verb and the shape of its
arguments (``use _ on _``, ``take _ from _``, ``book_flight(card_id, travel_date)``,
``sql:select+groupby+sum``); each argument slot gets a role:

* ``goal``: the argument's words all occur in the task's goal (the target, the destination);
* ``dir``: a compass or vertical direction (``move east``);
* ``id`` / ``number``: an identifier (digits inside a word, ``#W123``, ``card_6789``) or a number;
* ``lit``: anything else, with its head words kept (``lit:thermometer``, ``lit:red box``):
  the fixed tools and places of a procedure.

Every function takes untrusted text and does bounded work: only the head of an action
(:data:`lifemem_ray.engine.clustering.workflow.MAX_ACTION_CHARS`) is read, at most :data:`MAX_SLOTS` slots are
kept, and parsing a call never evaluates anything.

Example:

>>> goal = goal_words("Your task is to measure the temperature of water with a thermometer.")
>>> step = abstract_step("use thermometer in inventory on water", goal)
>>> step.frame, step.roles
('use _ in _ on _', ('goal', 'lit:inventory', 'goal'))
>>> abstract_step("move east", goal).roles, abstract_step("move east", goal).token
(('dir',), 'go')
"""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from lifemem_ray.core.errors import InvalidArgumentError
from lifemem_ray.core.model import Trajectory
from lifemem_ray.engine.clustering.workflow import (
    DEFAULT_DIM,
    DIRECTION_WORDS,
    MAX_ACTION_CHARS,
    action_tokens,
    hashed_vector,
    step_tokens,
    workflow_features,
)

__all__ = [
    "FEATURES_VERSION",
    "WORKFLOW_FEATURES",
    "AbstractStep",
    "abstract_step",
    "abstract_steps",
    "features_id",
    "featurize",
    "goal_words",
    "step_features",
]

MAX_SLOTS = 4
# Feature weights relative to the token features of lifemem_ray.engine.clustering.workflow (weight 1 per token unigram).
SHAPE_WEIGHT = 0.8  # frame + role kinds (use _ on _|lit,goal), unigrams and bigrams
KEY_WEIGHT = 0.5  # frame + roles with their literals (use _ on _|lit:thermometer,goal)
MAX_LITERAL_WORDS = 3
MAX_CALL_ARGS = 8
MAX_WORD_CHARS = 48
MAX_GOAL_CHARS = 2000

# Words with a digit (ids, numbers) first; anchored at a word's start, so a long word costs linear time.
_WORD = re.compile(r"(?<![\w#])#?[A-Za-z_]*\d[\w#.-]*|[a-z]+(?:/[a-z]+)?", re.I)
_ARTICLES = frozenset(["a", "an", "the", "some", "any", "this", "that", "my", "your", "its"])
_PARTICLES = frozenset(["up", "down", "around", "at", "on", "off", "out", "over"])
_PREPOSITIONS = frozenset(["to", "on", "in", "into", "onto", "from", "with", "at", "in/on", "inside", "under", "for"])
DIRECTIONS = DIRECTION_WORDS | {"n", "s", "e", "w"}  # and the one-letter forms of text games
_STOP = frozenset(
    [
        "a",
        "an",
        "the",
        "of",
        "to",
        "in",
        "on",
        "and",
        "or",
        "is",
        "are",
        "be",
        "it",
        "its",
        "your",
        "you",
        "task",
        "that",
        "this",
        "with",
        "for",
        "from",
        "at",
        "as",
        "by",
    ]
)
_ID = re.compile(r"^#?\w*\d[\w#.-]*$")
_NUMBER = re.compile(r"^\d+(?:\.\d+)?$")
_BRACKET = re.compile(r"^\s*(?:Action\s*\d*\s*:\s*)?([A-Za-z_]\w{0,47})\[(.*)\]\s*$", re.S)
_SQL_BODY = re.compile(r"```[ \t]*(?:sql|mysql|sqlite|postgresql)?[ \t]*\n?(.*?)(?:```|$)", re.S | re.I)
_SQL_CLAUSES = (
    ("join", re.compile(r"\bjoin\b", re.I)),
    ("where", re.compile(r"\bwhere\b", re.I)),
    ("groupby", re.compile(r"\bgroup\s+by\b", re.I)),
    ("having", re.compile(r"\bhaving\b", re.I)),
    ("orderby", re.compile(r"\border\s+by\b", re.I)),
    ("limit", re.compile(r"\blimit\b", re.I)),
    ("distinct", re.compile(r"\bdistinct\b", re.I)),
    ("subquery", re.compile(r"\(\s*select\b", re.I)),
    ("count", re.compile(r"\bcount\s*\(", re.I)),
    ("sum", re.compile(r"\bsum\s*\(", re.I)),
    ("avg", re.compile(r"\bavg\s*\(", re.I)),
    ("minmax", re.compile(r"\b(?:min|max)\s*\(", re.I)),
)


@dataclass(frozen=True, slots=True)
class AbstractStep:
    """An action as a workflow step: its token (see :func:`lifemem_ray.engine.clustering.workflow.step_tokens`),
    its frame, one role per argument slot and the slot's own words (for rendering skills).

    ``key``: frame and roles with literals kept, what a procedure step is identified by;
    ``shape``: frame and role kinds with literals dropped (``use _ on _|lit,goal``). Both are
    computed once, at construction."""

    token: str
    frame: str
    roles: tuple[str, ...] = ()
    phrases: tuple[str, ...] = ()
    key: str = field(init=False, compare=False)
    shape: str = field(init=False, compare=False)

    def __post_init__(self) -> None:
        if self.roles:
            object.__setattr__(self, "key", self.frame + "|" + ",".join(self.roles))
            object.__setattr__(self, "shape", self.frame + "|" + ",".join(r.partition(":")[0] for r in self.roles))
        else:
            object.__setattr__(self, "key", self.frame)
            object.__setattr__(self, "shape", self.frame)


def goal_words(goal: str) -> frozenset[str]:
    """The content words of a goal (lower case, numbers kept, stop words dropped)."""
    words = (w.lower() for w in _WORD.findall(goal[:MAX_GOAL_CHARS]))
    return frozenset(w for w in words if w not in _STOP)


def abstract_steps(actions: Sequence[str], goal: str) -> list[AbstractStep]:
    """The abstract steps of a trajectory's actions, relative to its goal."""
    words = goal_words(goal)
    return [abstract_step(a, words) for a in actions]


def abstract_step(action: str, goal: frozenset[str]) -> AbstractStep:
    """One action as an abstract step (roles relative to the goal's content words)."""
    token, frame, slots, phrases = _parse((action or "")[:MAX_ACTION_CHARS])
    return AbstractStep(token, frame, tuple(_slot_role(kind, value, goal) for kind, value in slots), phrases)


# A slot before the goal is known: ("phrase", words) takes its role from _role; ("value", text)
# a call's string value, whose role kind alone counts; ("number", text) is "goal" when the
# goal names it; ("fixed", role) is that role.
Slot = tuple[str, str]


@lru_cache(maxsize=65536)
def _parse(text: str) -> tuple[str, str, tuple[Slot, ...], tuple[str, ...]]:
    """The goal-independent part of an abstract step, cached (actions repeat across runs):
    token, frame, slots and the phrases a skill renders."""
    tokens = step_tokens(text)
    token = tokens[0]
    if len(tokens) > 1:  # a code block of several calls: the calls are the frame
        return token, "+".join(tokens[:MAX_SLOTS]), (), ()
    if token.startswith("sql:"):
        return token, _sql_frame(token, text), (), ()
    text = text.strip()
    call = _call_parts(text, token)
    if call is not None:
        return call
    m = _BRACKET.match(text)
    if m and m.group(1).lower() == token.split(":", 1)[0]:
        return token, f"{token}[_]", (("phrase", m.group(2)),), (_literal(m.group(2)),)
    if token in ("respond", "ack", "other", "think", "answer", "call", "code") or not text:
        return token, token, (), ()
    frame, phrases = _command_parts(text)
    return token, frame, tuple(("phrase", p) for p in phrases), tuple(_literal(p) for p in phrases)


def _slot_role(kind: str, value: str, goal: frozenset[str]) -> str:
    if kind == "phrase":
        return _role(value, goal)[0]
    if kind == "value":
        return _role(value, goal)[0].split(":", 1)[0]
    if kind == "number":
        return "goal" if value in goal else "number"
    return value


@lru_cache(maxsize=32768)
def _command_parts(text: str) -> tuple[str, tuple[str, ...]]:
    """A text command as its frame and slot phrases (goal-independent, so cached):
    ``use thermometer in inventory on water`` -> ``("use _ in _ on _", ("thermometer", "inventory", "water"))``."""
    words = [w.lower()[:MAX_WORD_CHARS] for w in _WORD.findall(text)][:24]
    if not words:
        return "other", ()
    verb = words[0]
    letters = re.match(r"[a-z]+", verb)
    pieces = [letters.group(0) if letters else verb]  # wait1 -> wait
    rest = words[1:]
    if rest and rest[0] in _PARTICLES:  # pick up, look around, focus on, look at
        pieces.append(rest.pop(0))
    slots: list[str] = []
    current: list[str] = []
    for w in rest:
        if w in _PREPOSITIONS and len(slots) < MAX_SLOTS - 1:
            if current:
                slots.append(" ".join(current))
                pieces.append("_")
                current = []
            pieces.append(w)
        else:
            current.append(w)
    if current:
        slots.append(" ".join(current))
        pieces.append("_")
    return " ".join(pieces), tuple(slots)


def _role(phrase: str, goal: frozenset[str]) -> tuple[str, str]:
    """(role, the phrase's words without articles or instance numbers)."""
    _, named, fixed = _phrase_words(phrase)
    if fixed is not None:
        return fixed
    if all(w in goal for w in named):
        return "goal", " ".join(named[-MAX_LITERAL_WORDS:])
    if len(named) == 1 and _ID.match(named[0]):
        return "id", named[0]
    literal = " ".join(named[-MAX_LITERAL_WORDS:])
    return "lit:" + literal, literal


@lru_cache(maxsize=65536)
def _phrase_words(phrase: str) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, str] | None]:
    """A phrase's content words, those that are not numbers, and its role when the goal cannot
    change it (none, number, dir): the goal-independent part of :func:`_role`, cached."""
    words = [w.lower()[:MAX_WORD_CHARS] for w in _WORD.findall(phrase[:200])]
    content = tuple(w for w in words if w not in _ARTICLES)
    if not content:
        return content, (), ("none", "")
    if all(_NUMBER.match(w) for w in content):
        return content, (), ("number", content[0])
    if len(content) == 1 and content[0] in DIRECTIONS:
        return content, (), ("dir", content[0])
    return content, tuple(w for w in content if not _NUMBER.match(w)), None


def _literal(phrase: str) -> str:
    words = [
        w.lower()[:MAX_WORD_CHARS]
        for w in _WORD.findall(phrase[:200])
        if w.lower() not in _ARTICLES and not _NUMBER.match(w)
    ]
    return " ".join(words[-MAX_LITERAL_WORDS:])


_CALL_START = re.compile(r"^\[?\s*[A-Za-z_][\w.]*\s*\(")


def _call_parts(text: str, token: str) -> tuple[str, str, tuple[Slot, ...], tuple[str, ...]] | None:
    """``name(k=v, ...)`` or a JSON call: the function with its argument names, each a slot."""
    if text.startswith("{") or ("{" in text and '"name"' in text):
        return _json_call(text, token)
    body = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    if not _CALL_START.match(body) or not body.rstrip().endswith(")"):
        return None
    try:
        node = ast.parse(body.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(node, ast.Call):
        return None
    args: list[tuple[str, Slot]] = []
    for kw in node.keywords[:MAX_CALL_ARGS]:
        if kw.arg is not None:
            args.append((kw.arg[:MAX_WORD_CHARS], _value_slot(kw.value)))
    for arg in node.args[: max(0, MAX_CALL_ARGS - len(args))]:
        args.append(("_", _value_slot(arg)))
    args.sort(key=lambda a: a[0])
    names = tuple(name for name, _ in args)
    return token, f"{token}({','.join(names)})", tuple(slot for _, slot in args), names


def _value_slot(node: ast.AST) -> Slot:
    if isinstance(node, ast.Constant):
        return _literal_slot(node.value)
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return "fixed", "list"
    if isinstance(node, ast.Dict):
        return "fixed", "object"
    return "fixed", "expr"


def _literal_slot(value: object) -> Slot:
    if isinstance(value, bool) or value is None:
        return "fixed", "flag"
    if isinstance(value, (int, float)):
        return "number", str(value)
    if isinstance(value, str):
        return "value", value[:200]
    return "fixed", "list" if isinstance(value, list) else "object"


def _json_call(text: str, token: str) -> tuple[str, str, tuple[Slot, ...], tuple[str, ...]] | None:
    start = text.find("{")
    if start < 0 or token in ("call", "other"):
        return None
    import json

    try:
        data = json.loads(text[start : text.rfind("}") + 1])
    except (ValueError, RecursionError):
        return None
    args = data.get("arguments") if isinstance(data, dict) else None
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            args = None
    if not isinstance(args, dict):
        return token, f"{token}()", (), ()
    keys = sorted(list(args)[:MAX_CALL_ARGS], key=str)
    names = tuple(str(k)[:MAX_WORD_CHARS] for k in keys)
    return token, f"{token}({','.join(names)})", tuple(_literal_slot(args[k]) for k in keys), names


def _sql_frame(token: str, text: str) -> str:
    m = _SQL_BODY.search(text)
    body = m.group(1) if m else text
    clauses = [name for name, pattern in _SQL_CLAUSES if pattern.search(body)]
    return "+".join([token, *clauses])


def step_features(steps: Sequence[AbstractStep]) -> dict[str, float]:
    """Features of abstract steps: shape unigrams (``1 + ln(count)``), shape bigrams over the
    run-collapsed sequence (with ``^``/``$``), and key unigrams of steps with arguments,
    weighted by SHAPE_WEIGHT and KEY_WEIGHT (see :func:`lifemem_ray.engine.clustering.workflow.workflow_features`
    for the token features)."""
    return _pair_features(tuple((s.shape, s.key if s.roles else "") for s in steps))


def _pair_features(pairs: tuple[tuple[str, str], ...]) -> dict[str, float]:
    counts: dict[str, int] = {}
    shapes = [shape for shape, _ in pairs]
    for shape in shapes:
        counts["s1:" + shape] = counts.get("s1:" + shape, 0) + 1
    runs = [x for i, x in enumerate(shapes) if i == 0 or shapes[i - 1] != x]
    for a, b in zip(["^", *runs], [*runs, "$"], strict=True):
        key = f"s2:{a}>{b}"
        counts[key] = counts.get(key, 0) + 1
    for _, key in pairs:
        if key:
            counts["k1:" + key] = counts.get("k1:" + key, 0) + 1
    out: dict[str, float] = {}
    for feat, n in counts.items():
        weight = KEY_WEIGHT if feat.startswith("k1:") else SHAPE_WEIGHT
        out[feat] = weight * (1.0 + math.log(n))
    return out


def _step_pair(action: str, goal: frozenset[str]) -> tuple[str, str]:
    """(shape, key or "" when the step has no arguments) of one action: what featurizing needs
    of an abstract step, without building one."""
    _, frame, slots, _ = _parse((action or "")[:MAX_ACTION_CHARS])
    if not slots:
        return frame, ""
    roles = [_slot_role(kind, value, goal) for kind, value in slots]
    return frame + "|" + ",".join(r.partition(":")[0] for r in roles), frame + "|" + ",".join(roles)


# --------------------------------------------------------------------------- featurizers

WORKFLOW_FEATURES = ("roles", "tokens")  # with abstract-step features, or token features alone
FEATURES_VERSION = 2  # bumped when tokens or features change: stores built before are recomputed


def features_id(kind: str) -> str:
    """What a store records as its featurizer (``roles-v2``)."""
    if kind not in WORKFLOW_FEATURES:
        raise InvalidArgumentError(f"workflow features: expected one of {', '.join(WORKFLOW_FEATURES)}, got {kind!r}")
    return f"{kind}-v{FEATURES_VERSION}"


def featurize(trajectory: Trajectory, kind: str = "roles", dim: int = DEFAULT_DIM) -> tuple[list[str], np.ndarray]:
    """A trajectory's action tokens and its workflow vector (float16-rounded, as stored, so that
    running sums equal a recomputation; read-only). Trajectories of one procedure reduce to
    the same token and step sequences, so vectors are cached by those."""
    if kind not in WORKFLOW_FEATURES:
        raise InvalidArgumentError(f"workflow features: expected one of {', '.join(WORKFLOW_FEATURES)}, got {kind!r}")
    tokens = action_tokens(trajectory)
    pairs: tuple[tuple[str, str], ...] = ()
    if kind == "roles" and trajectory.steps:
        goal = goal_words(trajectory.query_text)
        pairs = tuple(_step_pair(s.action, goal) for s in trajectory.steps)
    return tokens, _vector(tuple(tokens), pairs, dim)


@lru_cache(maxsize=65536)
def _vector(tokens: tuple[str, ...], pairs: tuple[tuple[str, str], ...], dim: int) -> np.ndarray:
    features = workflow_features(tokens)
    if pairs:
        features.update(_pair_features(pairs))
    vec = hashed_vector(features, dim).astype(np.float16).astype(np.float32)
    vec.setflags(write=False)
    return vec
