"""Mind2Web's released trajectories read as offline steps, the cleaned pages' elements, and
Mind2Web's step scoring.

The records (the LifeMem training set's ``train_mind2web.jsonl``) are chat transcripts in the
Synapse / Mind2Web format: the task field has ``Website:``, ``Domain:``, ``Subdomain:`` and
``Task:`` lines; each user turn holds ``Observation: `<html>...` `` (the cleaned, pruned page of
one step; the first also repeats ``Task: ...`` and ``Trajectory:``) and the assistant turn after
it the gold action, ``Action: `CLICK [id]` ([tag] text -> CLICK)``, with ``TYPE [id] [text]`` and
``SELECT [id] [option]`` the other operations; the part in parentheses is Mind2Web's
``action_reprs`` string, which later steps' prompts list as "Previous actions". ``messages``
may be a list or the Python repr of one (read with :func:`ast.literal_eval`, never ``eval``).

Scoring follows Mind2Web's ``ActionEvaluatorMultiChoice`` (``src/action_prediction/metric.py``):
element accuracy is the predicted element being the gold one; the operation string is
``"<OP> <value>"`` stripped (``"CLICK"``, ``"TYPE Boston"``, ``"SELECT Pickup"``); operation F1
is the F1 of the two strings' *sets* of whitespace tokens (case-sensitive); a step succeeds
when the element is right and the operation F1 is 1. One normalisation is added: the released
values write every ``:`` as a space (``SELECT [..] [5 00 PM]`` for the option ``5:00 PM``), so
``:`` becomes a space on both sides before the tokens are compared.
"""

from __future__ import annotations

import ast
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

from lifemem_ray.core.errors import TaskError
from lifemem_ray.lab.envs.shared_data import find_data_file, json_lines

__all__ = [
    "PATH_ENV_VAR",
    "Action",
    "Element",
    "StepRecord",
    "load_steps",
    "operation_f1",
    "operation_string",
    "page_elements",
    "parse_action",
    "parse_messages",
    "resolve_path",
    "score_action",
]

PATH_ENV_VAR = "LIFEMEM_MIND2WEB"
_RELATIVE = Path("data") / "lifemem-trainset" / "mind2web.jsonl"

MAX_PAGE_CHARS = 16_000  # a step's page kept (the released pages have at most 1,777)
MAX_MESSAGES_CHARS = 4_000_000  # a ``messages`` string parsed with literal_eval
MAX_STEPS_PER_RECORD = 200
MAX_ELEMENTS = 60  # elements with an id read from one page (the released pages have at most 3)
MAX_OPTIONS = 100  # options read from one element
MAX_ACTION_CHARS = 1000  # a longer action is refused unread
MAX_PREVIOUS_CHARS = 300  # one previous-action line kept

_OPS = ("CLICK", "TYPE", "SELECT")
_ACTION = re.compile(r"\b(CLICK|TYPE|SELECT)\s*\[\s*(\d{1,12})\s*\](?:[ \t]*\[([^\n]*?)\](?=\s|`|\)|$))?", re.I)
_RECORDED = re.compile(r"^\s*Action:\s*`([^`]*)`\s*(?:\((.*)\))?\s*$", re.S)
_OBSERVATION = "Observation: `"
_TAG = re.compile(r"<(/?)([A-Za-z][\w-]*)([^<>]*)>")
_ID_ATTR = re.compile(r"(?:^|\s)id=(\d{1,12})(?=[\s/]|$)")
# input types that take no text (the cleaned page keeps an input's type as its first attribute word)
_NO_TEXT = frozenset({"checkbox", "radio", "submit", "button", "image", "reset", "file", "hidden", "range", "color"})
_TEXT_TAGS = frozenset({"textarea", "label"})  # a label stands for the input it wraps (pruned by the cleaner)


class Action(NamedTuple):
    """One parsed action: operation (upper case), element id, value ('' for CLICK)."""

    op: str
    element: str
    value: str


@dataclass(frozen=True)
class Element:
    """An element of a cleaned page that has an id: its tag, options (a select, or a label
    wrapping an id-less select) and whether text can be typed into it."""

    id: str
    tag: str
    options: tuple[str, ...]
    typeable: bool


@dataclass(frozen=True)
class StepRecord:
    """One step of one released trajectory: the offline protocol's unit."""

    source_line: int
    step: int  # 0-based
    n_steps: int
    website: str
    domain: str
    subdomain: str
    task: str
    page: str  # the cleaned HTML, cut at MAX_PAGE_CHARS
    previous: tuple[str, ...]  # the earlier steps' action_reprs, oldest first
    gold: str  # e.g. "TYPE [6068] [Boston]"
    gold_repr: str  # e.g. "[searchbox]  Find a location -> TYPE: Boston"


# --------------------------------------------------------------------------- actions and scoring


def parse_action(text: Any) -> Action | None:
    """The first ``CLICK [id]`` / ``TYPE [id] [text]`` / ``SELECT [id] [option]`` in ``text``
    (an ``Action:`` label, backticks or a trailing description around it are ignored); None
    when there is none or ``text`` is not a string of at most MAX_ACTION_CHARS characters."""
    if not isinstance(text, str) or len(text) > MAX_ACTION_CHARS:
        return None
    m = _ACTION.search(text)
    if m is None:
        return None
    return Action(m.group(1).upper(), str(int(m.group(2))), (m.group(3) or "").strip())


def operation_string(op: str, value: str) -> str:
    """Mind2Web's operation string, ``"<OP> <value>"`` stripped, with ``:`` as a space."""
    return f"{op} {value}".strip().replace(":", " ")


def operation_f1(pred: str, gold: str) -> float:
    """Mind2Web's ``calculate_f1``: F1 of the two strings' sets of whitespace tokens."""
    p, g = set(pred.split()), set(gold.split())
    if not p and not g:
        return 1.0
    tp = len(p & g)
    if tp == 0:
        return 0.0
    precision, recall = tp / len(p), tp / len(g)
    return 2 * precision * recall / (precision + recall)


def score_action(pred: Action, gold: Action) -> tuple[bool, float, bool]:
    """(element correct, operation F1, step success) of ``pred`` against ``gold``."""
    element = pred.element == gold.element
    f1 = operation_f1(operation_string(pred.op, pred.value), operation_string(gold.op, gold.value))
    return element, f1, element and f1 == 1.0


# --------------------------------------------------------------------------- pages


def page_elements(html: str) -> list[Element]:
    """The page's elements with an id, in page order (at most MAX_ELEMENTS). An ``<option>``'s
    text goes to the nearest enclosing element with an id."""
    elements: dict[str, tuple[str, list[str], bool]] = {}
    stack: list[tuple[str, str | None]] = []  # (tag, id) of open elements
    option_owner: str | None = None
    option_text: list[str] | None = None
    pos = 0
    for m in _TAG.finditer(html):
        if option_text is not None:
            option_text.append(html[pos : m.start()])
        pos = m.end()
        closing, tag, attrs = m.group(1) == "/", m.group(2).lower(), m.group(3)
        if closing:
            if tag == "option" and option_text is not None:
                _add_option(elements, option_owner, option_text)
                option_text = None
            for i in range(len(stack) - 1, -1, -1):
                if stack[i][0] == tag:
                    del stack[i:]
                    break
            continue
        ident = _ID_ATTR.search(attrs)
        if ident is not None and ident.group(1) not in elements and len(elements) < MAX_ELEMENTS:
            words = _ID_ATTR.sub(" ", attrs).split()
            first = words[0].lower() if words else ""
            typeable = tag in _TEXT_TAGS or (tag == "input" and first not in _NO_TEXT)
            elements[ident.group(1)] = (tag, [], typeable)
        if tag == "option":
            if option_text is not None:  # an unclosed option ends at the next one
                _add_option(elements, option_owner, option_text)
            option_owner = next((eid for _, eid in reversed(stack) if eid is not None), None)
            option_text = []
        elif not attrs.rstrip().endswith("/"):
            stack.append((tag, ident.group(1) if ident is not None else None))
    return [Element(eid, tag, tuple(opts), typeable) for eid, (tag, opts, typeable) in elements.items()]


def _add_option(elements: dict[str, tuple[str, list[str], bool]], owner: str | None, text: list[str]) -> None:
    value = " ".join("".join(text).split())
    if owner is not None and owner in elements and value:
        options = elements[owner][1]
        if value not in options and len(options) < MAX_OPTIONS:
            options.append(value)


# --------------------------------------------------------------------------- records


def resolve_path(path: str | os.PathLike[str] | None) -> Path:
    """The argument, else $LIFEMEM_MIND2WEB, else the shared data folder (the one rule of
    :mod:`lifemem_ray.lab.envs.shared_data`); EnvUnavailable names them."""
    return find_data_file("Mind2WebEnv", path, PATH_ENV_VAR, _RELATIVE, "the LifeMem training set's mind2web.jsonl")


def parse_messages(value: Any, where: str) -> list[dict[str, str]]:
    """A record's ``messages``: a list, or its Python repr (or JSON) as a string."""
    if isinstance(value, str):
        if len(value) > MAX_MESSAGES_CHARS:
            raise TaskError(f"messages string over {MAX_MESSAGES_CHARS} characters", where=where)
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                raise TaskError("messages is a string that is neither a Python list nor JSON", where=where) from None
    if not isinstance(value, list) or not value:
        raise TaskError("messages must be a non-empty list of {role, content}", where=where)
    out = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) or not isinstance(msg.get("content"), str):
            raise TaskError(f"message {i} must be an object with string role and content", where=where)
        out.append({"role": msg["role"], "content": msg["content"]})
    return out


def _header(task: str, where: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    for line in task.splitlines():
        key, sep, rest = line.partition(":")
        if sep and key.strip() in ("Website", "Domain", "Subdomain", "Task") and key.strip() not in fields:
            fields[key.strip()] = rest.strip()
    missing = [k for k in ("Website", "Domain", "Task") if not fields.get(k)]
    if missing:
        raise TaskError(f"task field lacks line(s) {', '.join(k + ':' for k in missing)}", where=where)
    fields.setdefault("Subdomain", "")
    return fields


def _page(content: str, where: str) -> str:
    start = content.find(_OBSERVATION)
    if start < 0:
        raise TaskError("no 'Observation: `<html>...`' in the user turn", where=where)
    html = content[start + len(_OBSERVATION) :].rstrip()
    html = html[:-1] if html.endswith("`") else html
    if len(html) > MAX_PAGE_CHARS:
        html = html[:MAX_PAGE_CHARS] + f" ... [page cut at {MAX_PAGE_CHARS} characters]"
    return html


def record_steps(row: Any, where: str, source_line: int) -> list[StepRecord]:
    """The steps of one record (a user turn with the page, then the assistant's gold action)."""
    if not isinstance(row, dict) or not isinstance(row.get("task"), str):
        raise TaskError("expected an object with a string 'task'", where=where)
    head = _header(row["task"], where)
    messages = parse_messages(row.get("messages"), where)
    pairs = []
    for i in range(0, len(messages) - 1, 2):
        user, agent = messages[i], messages[i + 1]
        if user["role"] != "user" or agent["role"] != "assistant":
            raise TaskError(f"messages {i}-{i + 1} are not a user turn then an assistant turn", where=where)
        m = _RECORDED.match(agent["content"])
        gold = parse_action(m.group(1)) if m else None
        if m is None or gold is None:
            raise TaskError(f"message {i + 1} is not 'Action: `CLICK|TYPE|SELECT [id] ...`'", where=where)
        desc = (m.group(2) or f"{gold.op} {gold.value}".strip()).replace("\n", " ").strip()
        pairs.append((_page(user["content"], f"{where}: message {i}"), m.group(1).strip(), desc[:MAX_PREVIOUS_CHARS]))
    if not pairs:
        raise TaskError("no step (a user turn with a page followed by an assistant action)", where=where)
    if len(pairs) > MAX_STEPS_PER_RECORD:
        raise TaskError(f"{len(pairs)} steps, over {MAX_STEPS_PER_RECORD}", where=where)
    return [
        StepRecord(
            source_line=source_line,
            step=k,
            n_steps=len(pairs),
            website=head["Website"],
            domain=head["Domain"],
            subdomain=head["Subdomain"],
            task=head["Task"],
            page=page,
            previous=tuple(d for _, _, d in pairs[:k]),
            gold=gold,
            gold_repr=desc,
        )
        for k, (page, gold, desc) in enumerate(pairs)
    ]


class _Cache:
    """Steps read per (path, size, mtime), shared by every environment instance on purpose."""

    steps: ClassVar[dict[tuple[str, int, int], list[StepRecord]]] = {}


def load_steps(path: Path) -> list[StepRecord]:
    """Every step of every record of a mind2web JSONL file, in file order (cached)."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _Cache.steps:
        steps: list[StepRecord] = []
        for lineno, where, row in json_lines(path):
            source = row.get("source_line", lineno - 1) if isinstance(row, dict) else lineno - 1
            steps += record_steps(row, where, source if isinstance(source, int) else lineno - 1)
        if not steps:
            raise TaskError(f"{path}: no Mind2Web records")
        _Cache.steps[key] = steps
    return _Cache.steps[key]
