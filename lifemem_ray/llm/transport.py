"""Decisions from an LLM behind any OpenAI-compatible chat-completions server.

:class:`LLMClient` is the transport: bounded concurrency, a hard per-call
timeout, retries with backoff on transient errors, JSON extraction and per-op
usage counters. :class:`LLMDecider` implements :class:`~lifemem_ray.core.decisions.Decider`
on top of it and validates every answer against what was asked: an answer may
only name the item keys and cluster ids that the prompt offered, and a text it
writes for the memory to store (a description, a skill) must pass the provenance
rule of :mod:`lifemem_ray.llm.provenance` (counted as ``refused_generated`` when it
does not). Anything else becomes ``None`` (the engine then falls back to the
offline policy), never an exception and never a stored error string.

The engine calls synchronously, possibly from inside a running event loop (Ray
async actors), so coroutines run on a private event-loop thread owned by the
client; ``asyncio.run`` in the caller's thread would fail there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import email.utils
import json
import logging
import os
import random
import re
import threading
import time
from typing import Any, Awaitable, Callable, Coroutine, Sequence, TypeVar
from urllib.parse import urlparse

import openai

from lifemem_ray.llm import lexicon
from lifemem_ray.core.metrics import MetricsSink
from lifemem_ray.llm.llm_metrics import LLMMetrics
from lifemem_ray.llm.llm_config import LLMConfig
from lifemem_ray.core.decisions import Assignment, AssignRequest, ClusterView, Groups
from lifemem_ray.core.model import Trajectory
from lifemem_ray.core.errors import AnswerError, GeneratedTextRefused, UsageError
from lifemem_ray.llm.prompts import DESCRIPTION_MAX_CHARS, GROUP_LABEL_MAX_CHARS, MEMORY_OPERATIONS, OPERATIONS, SKILL_MAX_CHARS, Prompt, assign_prompt, describe_prompt, distil_prompt, partition_prompt, split_prompt
from lifemem_ray.llm.provenance import Provenance, from_trajectories, refusal

__all__ = [
    "AnswerError",
    "LLMClient",
    "LLMDecider",
    "clean_text",
    "extract_json",
    "merge_usage",
    "schema_errors",
    "usage_refusals",
    "usage_totals",
]

log = logging.getLogger(__name__)

T = TypeVar("T")
Checked = tuple[T | None, list[str]]  # (value or None, problems found): what an answer checker returns

PLACEHOLDER_API_KEY = "sk-local"  # local servers want some key; they do not check it
DEFAULT_BASE_URL = "https://api.openai.com/v1"
RETRYABLE_STATUS = frozenset({408, 429})  # plus every 5xx
# Operations whose failed call leaves one decision to the offline policy (assign counts per item).
CALL_FALLBACKS = frozenset(MEMORY_OPERATIONS) - {"assign"}


# --------------------------------------------------------------------------- answers: JSON


_FENCE = re.compile(r"```[ \t]*(?:json|JSON)?[ \t]*\n?(.*?)```", re.DOTALL)
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)


def extract_json(text: str | None) -> dict[str, Any]:
    """The answer's JSON object: fences and surrounding prose are tolerated, nothing else."""
    if text is None or not text.strip():
        raise AnswerError("empty answer")
    text = _THINK.sub("", text).strip()
    candidates = [m.group(1).strip() for m in _FENCE.finditer(text)] + [text]
    for candidate in candidates:
        try:
            # strict=False: raw newlines/tabs inside strings, as llama.cpp's grammar-constrained
            # answers contain, are kept rather than rejecting an otherwise valid answer.
            value = json.loads(candidate, strict=False)
        except ValueError:
            value = _first_object(candidate)
        if isinstance(value, dict):
            return value
    raise AnswerError(f"no JSON object in the answer: {_snippet(text)}")


def _first_object(text: str) -> dict[str, Any] | None:
    """The first balanced ``{...}`` that parses as a JSON object, scanning strings correctly."""
    start = text.find("{")
    while start != -1:
        depth, in_string, escaped = 0, False, False
        for i in range(start, len(text)):
            ch = text[i]
            if in_string:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    in_string = False
            elif ch == '"':
                in_string = True
            elif ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    try:
                        value = json.loads(text[start : i + 1], strict=False)
                    except ValueError:
                        break
                    if isinstance(value, dict):
                        return value
                    break
        start = text.find("{", start + 1)
    return None


def _snippet(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= limit else text[:limit] + "...")


# --------------------------------------------------------------------------- answers: schema


_TYPES: dict[str, Callable[[Any], bool]] = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


def schema_errors(value: Any, schema: dict[str, Any], path: str = "$") -> list[str]:
    """Violations of the JSON-schema subset our prompts use (type, properties, required,
    additionalProperties, items, enum, min/maxItems, min/maxLength, minimum/maximum).

    Hand-written so the project needs no jsonschema dependency; an unknown
    keyword is a programming error, not silently ignored.
    """
    known = {"type", "properties", "required", "additionalProperties", "items", "enum", "minItems",
             "maxItems", "minLength", "maxLength", "minimum", "maximum", "description"}
    unknown = set(schema) - known
    if unknown:
        raise ValueError(f"schema_errors: unsupported schema keyword(s) {sorted(unknown)} at {path}")
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else list(kinds)
        if not any(_TYPES[k](value) for k in kinds):
            return [f"{path}: expected {'/'.join(kinds)}, got {type(value).__name__}"]
    errors: list[str] = []
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} is not one of the allowed values")
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            errors.append(f"{path}: shorter than {schema['minLength']} characters")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append(f"{path}: longer than {schema['maxLength']} characters")
    if _TYPES["number"](value):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{path}: below {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{path}: above {schema['maximum']}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            errors.append(f"{path}: fewer than {schema['minItems']} entries")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errors.append(f"{path}: more than {schema['maxItems']} entries")
        if "items" in schema:
            for i, item in enumerate(value):
                errors += schema_errors(item, schema["items"], f"{path}[{i}]")
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        for name in schema.get("required", ()):
            if name not in value:
                errors.append(f"{path}: missing '{name}'")
        for name, item in value.items():
            if name in properties:
                errors += schema_errors(item, properties[name], f"{path}.{name}")
            elif schema.get("additionalProperties") is False:
                errors.append(f"{path}: unexpected '{name}'")
    return errors


# --------------------------------------------------------------------------- answers: texts


# Texts that are an error report or a refusal, not a description or a skill (the reference
# implementation stored "OpenAI API error" as a cluster summary).
_ERROR_TEXT = re.compile(  # unambiguous anywhere in the text
    r"(openai api error|traceback \(most recent call last\)|error code:? ?\d{3}\b|"
    r"\{\s*[\"']error[\"']\s*:|<html|</?trajectory\b|</?item\b|</?cluster\b)",
    re.IGNORECASE,
)
_REFUSAL = re.compile(  # an error report or refusal when it opens the text
    r"^\W*(i cannot|i can't|i can not|i'm sorry|i am sorry|sorry\b|as an ai|i'm unable|i am unable|"
    r"unable to|i won't|i will not|error\s*(?::|\d|$)|\w*error:|api error|internal server error|"
    r"rate limit|request timed out|timed out|exception\b|connection error|service unavailable|bad gateway|"
    r"n/?a\W*$|none\W*$|null\W*$|todo\b|\.\.\.\W*$)",
    re.IGNORECASE,
)
_PLACEHOLDER = re.compile(r"^\W*<[^<>]*>\W*$")


class _Refusal(str):
    """A problem that is a refused generated text (:class:`GeneratedTextRefused`): counted
    apart from other invalid answers, as ``refused_generated``."""


def _problem(exc: AnswerError, prefix: str = "") -> str:
    """An answer checker's problem for ``exc``, marked when it is a refusal."""
    text = prefix + str(exc)
    return _Refusal(text) if isinstance(exc, GeneratedTextRefused) else text


def clean_text(
    value: Any,
    what: str,
    max_chars: int,
    *,
    one_line: bool = True,
    min_chars: int = 8,
    forbidden: Sequence[str] = (),
    provenance: Provenance | None = None,
) -> str:
    """A model-written text, trimmed; :class:`AnswerError` when it is empty, too long,
    an error message or refusal, a placeholder, or names something forbidden.

    ``provenance``: the text is generated text the memory will store and serve to other
    agents (skills, descriptions), and these are the trajectories it was generated from:
    every token of it that is not plain English prose must occur in them, and it may hold
    no instruction aimed at the operator (:func:`lifemem_ray.llm.provenance.refusal`); else
    :class:`GeneratedTextRefused`."""
    if not isinstance(value, str):
        raise AnswerError(f"{what}: expected a string, got {type(value).__name__}")
    if one_line:
        text = " ".join(value.split())
    else:
        lines = [" ".join(line.split()) for line in value.replace("\r\n", "\n").split("\n")]
        text = "\n".join(line for line in lines if line)
    if len(text) < min_chars:
        raise AnswerError(f"{what}: too short ({text!r})")
    if len(text) > max_chars:
        raise AnswerError(f"{what}: longer than {max_chars} characters")
    # Per line: a copied answer-format template ("- <rule>\n- <rule>\n- <rule>") is a placeholder too.
    if _ERROR_TEXT.search(text) or _REFUSAL.search(text) or any(_PLACEHOLDER.match(line) for line in text.split("\n")):
        raise AnswerError(f"{what}: looks like an error message, refusal or placeholder: {_snippet(text, 80)}")
    reason = refusal(text, provenance) if provenance is not None else None
    if reason:
        raise GeneratedTextRefused(f"{what}: {reason}")
    for word in forbidden:
        if re.search(r"(?<![A-Za-z0-9])" + re.escape(word) + r"(?![A-Za-z0-9])", text, re.IGNORECASE):
            raise AnswerError(f"{what}: mentions the environment-specific name {word!r}")
    return text


# --------------------------------------------------------------------------- answers: per operation


def check_assign(
    data: dict[str, Any], requests: Sequence[AssignRequest], schema: dict[str, Any]
) -> Checked[dict[int, Assignment | None]]:
    """Per-item validation: a bad item costs only that item, the others are kept. A new
    cluster's description must draw on that item's own trajectory (its provenance)."""
    top = schema_errors(data, {"type": "object", "required": ["assignments"],
                               "properties": {"assignments": {"type": "array"}}})
    if top:
        return None, top
    item_schema = schema["properties"]["assignments"]["items"]
    by_key = {r.key: r for r in requests}
    result: dict[int, Assignment | None] = {r.key: None for r in requests}
    problems: list[str] = []
    seen: dict[int, int] = {}
    for i, entry in enumerate(data["assignments"]):
        key = entry.get("item") if isinstance(entry, dict) else None
        if not (isinstance(key, int) and not isinstance(key, bool) and key in by_key):
            problems.append(f"$.assignments[{i}]: item {key!r} was not asked")
            continue
        seen[key] = seen.get(key, 0) + 1
        if seen[key] > 1:
            problems.append(f"item {key}: answered more than once")
            continue
        errors = schema_errors(entry, item_schema, f"$.assignments[{i}]")
        if errors:
            problems += errors
            continue
        try:
            result[key] = _one_assignment(entry, by_key[key])
        except AnswerError as exc:
            problems.append(_problem(exc, f"item {key}: "))
    for key, count in seen.items():
        if count > 1:
            result[key] = None
    missing = [k for k in by_key if k not in seen]
    if missing:
        problems.append(f"items {missing}: not answered")
    if all(v is None for v in result.values()):
        return None, problems
    return result, problems


def _one_assignment(entry: dict[str, Any], request: AssignRequest) -> Assignment:
    allowed = {c.cluster.id for c in request.candidates}
    if entry["decision"] == "join":
        cluster_id = entry.get("cluster_id")
        if cluster_id is None:
            raise AnswerError("decision 'join' without a cluster_id")
        if cluster_id not in allowed:
            raise AnswerError(f"cluster_id {cluster_id} is not among this item's candidates {sorted(allowed)}")
        return Assignment(cluster_id=cluster_id)
    label = entry.get("new_group")
    label = clean_text(label, "new_group", GROUP_LABEL_MAX_CHARS, min_chars=1) if label is not None else None
    description = entry.get("description")
    if description is not None:
        source = from_trajectories([request.trajectory], "the item's trajectory")
        description = clean_text(description, "description", DESCRIPTION_MAX_CHARS, provenance=source)
    return Assignment(cluster_id=None, new_group=label, description=description)


def check_groups(data: dict[str, Any], members: Sequence[Trajectory], schema: dict[str, Any]) -> Checked[tuple[list[int], list[str]]]:
    """Groups must cover keys 0..n-1 (``members``' positions) exactly once; labels are the
    groups' answer order. A group's description must draw on that group's own members."""
    errors = schema_errors(data, schema)
    if errors:
        return None, errors
    labels: list[int | None] = [None] * len(members)
    descriptions: list[str] = []
    try:
        for g, group in enumerate(data["groups"]):
            for key in group["items"]:
                if labels[key] is not None:
                    raise AnswerError(f"trajectory key {key} is in more than one group")
                labels[key] = g
            mine = [members[key] for key in group["items"]]
            source = from_trajectories(mine, f"group {g}'s {_count(len(mine), 'member trajectory', 'member trajectories')}")
            descriptions.append(clean_text(group["description"], f"groups[{g}].description", DESCRIPTION_MAX_CHARS,
                                           provenance=source))
    except AnswerError as exc:
        return None, [_problem(exc)]
    missing = [k for k, label in enumerate(labels) if label is None]
    if missing:
        return None, [f"trajectory keys {missing} are in no group"]
    return ([int(label) for label in labels], descriptions), []  # type: ignore[arg-type]


def check_description(data: dict[str, Any], schema: dict[str, Any], source: Provenance) -> Checked[str]:
    """A cluster description drawing on ``source`` (the example trajectories it was asked about)."""
    errors = schema_errors(data, schema)
    if errors:
        return None, errors
    try:
        return clean_text(data["description"], "description", DESCRIPTION_MAX_CHARS, provenance=source), []
    except AnswerError as exc:
        return None, [_problem(exc)]


def check_skill(data: dict[str, Any], schema: dict[str, Any], forbidden: Sequence[str], source: Provenance) -> Checked[str]:
    """A skill drawing on ``source`` (the member trajectories it was distilled from), naming
    none of ``forbidden`` (environment names, ids)."""
    errors = schema_errors(data, schema)
    if errors:
        return None, errors
    try:
        text = clean_text(data["skill"], "skill", SKILL_MAX_CHARS, one_line=False, min_chars=20,
                          forbidden=forbidden, provenance=source)
    except AnswerError as exc:
        return None, [_problem(exc)]
    return text, []


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


# --------------------------------------------------------------------------- transport


def usage_totals(usage: dict[str, dict[str, Any]]) -> tuple[int, int]:
    """(calls, tokens) of a per-operation usage table (``LLMClient.usage()``, or the one a
    store keeps): what every stats report sums."""
    calls = sum(int(v.get("calls", 0)) for v in usage.values())
    tokens = sum(int(v.get("prompt_tokens", 0)) + int(v.get("completion_tokens", 0)) for v in usage.values())
    return calls, tokens


def merge_usage(*tables: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per-operation usage tables (a deployment's shards' and coordinator's) added up."""
    out: dict[str, dict[str, float]] = {}
    for table in tables:
        for op, values in table.items():
            slot = out.setdefault(op, {})
            for key, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    slot[key] = slot.get(key, 0) + value
    return out


def usage_refusals(usage: dict[str, dict[str, Any]]) -> int:
    """Generated texts refused by the provenance rule, over every operation of a usage table."""
    return sum(int(v.get("refused_generated", 0)) for v in usage.values())


class _LoopThread:
    """A private event loop in a daemon thread: sync callers submit coroutines to it."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.thread.start()
        self._ready.wait()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        if threading.current_thread() is self.thread:
            coro.close()
            raise UsageError(
                "LLMClient: a blocking call from the client's own event-loop thread would deadlock; use arun() there"
            )
        if self.loop.is_closed() or not self.loop.is_running():
            coro.close()
            raise UsageError("LLMClient: used after close()")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive() and not self.loop.is_closed():
            self.loop.close()


@dataclasses.dataclass
class _OpStats:
    calls: int = 0  # logical calls (one prompt each), however many attempts
    retries: int = 0  # extra attempts after transient errors
    adjusted: int = 0  # extra attempts after dropping a parameter the server rejected
    failures: int = 0  # calls that yielded no valid answer at all
    invalid: int = 0  # answers received that were not entirely valid
    refused_generated: int = 0  # generated texts refused by the provenance rule (their answers count as invalid too)
    items: int = 0  # assign: items asked
    items_invalid: int = 0  # assign: items left without a valid answer
    prompt_tokens: int = 0
    completion_tokens: int = 0
    tokens_estimated: int = 0  # calls whose token counts were estimated (chars / 4): no usage in the answer
    latency_s: float = 0.0  # summed wall time of calls, retries and backoff included


class _Transient(Exception):
    def __init__(self, reason: str, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after


class LLMClient:
    """An OpenAI-compatible chat client with our own retry policy and usage counters.

    Retries (up to ``config.max_retries``) on 408/429/5xx, timeouts and connection
    errors with exponential backoff and jitter, honouring ``Retry-After`` (capped).
    Other 4xx are not retried, except that a request parameter the server names as
    unsupported (``temperature``, ``max_tokens``, ``response_format`` or its
    ``schema`` key) is dropped once per model and the call repeated.
    """

    def __init__(
        self,
        config: LLMConfig,
        *,
        send_schema: bool | None = None,
        backoff_base_s: float | None = None,
        backoff_max_s: float | None = None,
        retry_after_max_s: float | None = None,
        client: openai.AsyncOpenAI | None = None,
        metrics: MetricsSink | None = None,
    ) -> None:
        """``metrics``: where calls, tokens, fallbacks and refusals are recorded (none: nowhere).
        ``send_schema``: put the JSON schema into ``response_format={"type": "json_object"}``
        (llama.cpp constrains decoding with it; vLLM ignores it; OpenAI rejects it with
        ``Unknown parameter: 'response_format.schema'``). None: all servers but OpenAI's.
        The backoff settings default to the config's (``llm.backoff_base_s`` ...)."""
        backoff_base_s = config.backoff_base_s if backoff_base_s is None else backoff_base_s
        backoff_max_s = config.backoff_max_s if backoff_max_s is None else backoff_max_s
        retry_after_max_s = config.retry_after_max_s if retry_after_max_s is None else retry_after_max_s
        config.validate()
        if not config.model:
            raise ValueError("LLMClient: llm.model is empty; name the model the server serves")
        if backoff_base_s < 0 or backoff_max_s < 0 or retry_after_max_s < 0:
            raise ValueError("LLMClient: backoff_base_s, backoff_max_s and retry_after_max_s must be >= 0")
        self.config = config
        self.base_url = config.base_url or os.environ.get("OPENAI_BASE_URL") or DEFAULT_BASE_URL
        host = (urlparse(self.base_url).hostname or "").lower()
        self._openai_host = host == "api.openai.com" or host.endswith(".openai.azure.com")
        api_key = config.api_key or os.environ.get("OPENAI_API_KEY") or ""
        if not api_key:
            if self._openai_host:
                log.warning("LLMClient: no API key (llm.api_key or OPENAI_API_KEY) for %s; calls will fail", self.base_url)
            api_key = PLACEHOLDER_API_KEY
        self.send_schema = (not self._openai_host) if send_schema is None else send_schema
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.retry_after_max_s = retry_after_max_s
        self.metrics = LLMMetrics(metrics)
        self._stats = {op: _OpStats() for op in OPERATIONS}
        self._stats_lock = threading.Lock()
        self._dropped: dict[str, set[str]] = {}  # model -> request adjustments learnt from errors
        self._random = random.Random()
        self._closed = False
        # The HTTP timeout is a backstop; the binding per-call limit is asyncio.timeout(timeout_s).
        self._client = client or openai.AsyncOpenAI(
            api_key=api_key, base_url=self.base_url, max_retries=0, timeout=config.timeout_s + 5.0
        )
        self._semaphore = asyncio.Semaphore(config.concurrency)
        self._loop = _LoopThread(f"lifemem-llm-{id(self):x}")

    # -- running coroutines ------------------------------------------------------------

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine on the client's loop and wait: works from any thread, even one
        with a running event loop (which is blocked meanwhile; prefer :meth:`arun` there)."""
        return self._loop.submit(coro).result()

    def arun(self, coro: Coroutine[Any, Any, T]) -> Awaitable[T]:
        """Run a coroutine on the client's loop, awaitable from any other event loop."""
        return asyncio.wrap_future(self._loop.submit(coro))

    # -- one logical call --------------------------------------------------------------

    def request(self, prompt: Prompt, model: str, check: Callable[[dict[str, Any]], Checked[T]]) -> T | None:
        """Synchronous :meth:`arequest`."""
        return self.run(self.arequest(prompt, model, check))

    async def arequest(self, prompt: Prompt, model: str, check: Callable[[dict[str, Any]], Checked[T]]) -> T | None:
        """Send ``prompt``, parse the answer and validate it with ``check``.

        ``check(data)`` returns ``(value, problems)``: value None means no usable
        answer; problems (even with a value, e.g. some items invalid) mark the answer
        as invalid in the counters. Returns None on any failure, after a warning.
        """
        if asyncio.get_running_loop() is not self._loop.loop:
            raise UsageError("LLMClient.arequest: must run on the client's loop; use request(), run() or arun()")
        op = prompt.op
        if op not in self._stats:
            raise ValueError(f"LLMClient.arequest: unknown operation {op!r}; known: {', '.join(OPERATIONS)}")
        started = time.monotonic()
        self._count(op, calls=1)
        self.metrics.count_call(op)
        try:
            content = await self._complete(prompt, model)
        finally:
            self._count(op, latency_s=time.monotonic() - started)
        if content is None:
            self._failed(op)
            return None
        try:
            value, problems = check(extract_json(content))
        except AnswerError as exc:
            value, problems = None, [str(exc)]
        if problems:
            self._count(op, invalid=1)
            log.warning("LLM %s (%s): invalid answer: %s; answer: %s", op, model, "; ".join(problems[:5]), _snippet(content))
        refused = sum(isinstance(p, _Refusal) for p in problems)
        if refused:
            self._count(op, refused_generated=refused)
            self.metrics.count_refusals(op, refused)
        if value is None:
            self._failed(op)
        return value

    async def _complete(self, prompt: Prompt, model: str) -> str | None:
        """The answer text, or None when the call failed for good (logged)."""
        op = prompt.op
        attempt = 0
        while True:
            params = self._params(prompt, model)
            try:
                async with self._semaphore:
                    async with asyncio.timeout(self.config.timeout_s):
                        response = await self._client.chat.completions.create(**params)
                return self._answer(op, prompt, response)
            except (TimeoutError, openai.APITimeoutError):
                failure: _Transient | str = _Transient(f"timed out after {self.config.timeout_s:g} s")
            except openai.APIConnectionError as exc:
                failure = _Transient(f"connection error: {exc}")
            except openai.APIStatusError as exc:
                adjustment = self._adjustment(params, exc)
                if adjustment is not None:
                    self._dropped.setdefault(model, set()).add(adjustment)
                    self._count(op, adjusted=1)
                    log.warning("LLM %s (%s): server rejected a parameter (HTTP %d: %s); retrying with %s",
                                op, model, exc.status_code, _snippet(exc.message, 200), adjustment)
                    continue
                if exc.status_code in RETRYABLE_STATUS or exc.status_code >= 500:
                    failure = _Transient(f"HTTP {exc.status_code}: {_snippet(exc.message, 200)}", _retry_after(exc.response))
                else:
                    failure = f"HTTP {exc.status_code}: {_snippet(exc.message, 200)} (not retried)"
            except openai.APIError as exc:  # e.g. a 200 whose body is not a chat completion
                failure = f"{type(exc).__name__}: {_snippet(str(exc), 200)}"
            if isinstance(failure, str):
                log.warning("LLM %s (%s): call failed: %s", op, model, failure)
                return None
            attempt += 1
            if attempt > self.config.max_retries:
                log.warning("LLM %s (%s): giving up after %d attempts: %s", op, model, attempt, failure.reason)
                return None
            delay = self._delay(attempt, failure.retry_after)
            log.info("LLM %s (%s): %s; retry %d/%d in %.2f s",
                     op, model, failure.reason, attempt, self.config.max_retries, delay)
            self._count(op, retries=1)
            await asyncio.sleep(delay)

    def _answer(self, op: str, prompt: Prompt, response: Any) -> str:
        choices = getattr(response, "choices", None) or []
        message = getattr(choices[0], "message", None) if choices else None
        content = getattr(message, "content", None) or ""
        usage = getattr(response, "usage", None)
        prompt_tokens = getattr(usage, "prompt_tokens", None)
        completion_tokens = getattr(usage, "completion_tokens", None)
        if isinstance(prompt_tokens, int) and isinstance(completion_tokens, int):
            prompt_tokens, completion_tokens = max(0, prompt_tokens), max(0, completion_tokens)
            self._count(op, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)
        else:
            prompt_tokens = sum(len(m["content"]) for m in prompt.messages) // 4
            completion_tokens = len(content) // 4
            self._count(op, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, tokens_estimated=1)
        self.metrics.count_tokens(op, prompt_tokens, completion_tokens)
        if choices and getattr(choices[0], "finish_reason", None) == "length":
            log.warning("LLM %s: answer cut at llm.max_answer_tokens=%d (reasoning models spend part of it on "
                        "hidden reasoning; raise it if answers come back empty or truncated)",
                        op, self.config.max_answer_tokens)
        return content

    def _params(self, prompt: Prompt, model: str) -> dict[str, Any]:
        dropped = self._dropped.get(model, set())
        params: dict[str, Any] = {"model": model, "messages": prompt.messages}
        if "temperature" not in dropped:
            params["temperature"] = self.config.temperature
        tokens_key = "max_completion_tokens" if self._openai_host or "max_tokens" in dropped else "max_tokens"
        params[tokens_key] = self.config.max_answer_tokens
        fmt = self.config.response_format
        if fmt == "json_schema" and "json_schema" in dropped:
            fmt = "json_object"
        if fmt == "json_object" and "json_object" in dropped:
            fmt = "none"
        if fmt == "json_schema":
            params["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": f"lifemem_{prompt.op}", "schema": prompt.schema, "strict": False},
            }
        elif fmt == "json_object":
            response_format: dict[str, Any] = {"type": "json_object"}
            if self.send_schema and "schema" not in dropped:
                response_format["schema"] = prompt.schema
            params["response_format"] = response_format
        return params

    @staticmethod
    def _adjustment(params: dict[str, Any], exc: openai.APIStatusError) -> str | None:
        """What to drop from ``params`` (as sent) when the server rejected one of them;
        None for any other error.

        Servers disagree on what they accept: OpenAI's reasoning models reject
        ``temperature`` and ``max_tokens``, OpenAI rejects ``response_format.schema``,
        llama-cpp-python answers 500 to ``json_schema``. Every adjustment removes
        something from the request, so they cannot loop.
        """
        if exc.status_code not in (400, 422, 500):
            return None
        param = str(getattr(exc, "param", None) or "").lower()
        message = f"{param} {exc.message}".lower()
        if exc.status_code != 500:
            if "max_tokens" in params and ("max_tokens" in param or "max_completion_tokens" in message):
                return "max_tokens"
            if "temperature" in params and "temperature" in message:
                return "temperature"
        response_format = params.get("response_format")
        if response_format and ("response_format" in message or "json_schema" in message or "'schema'" in message):
            if "schema" in response_format and ("schema" in param or "'schema'" in message):
                return "schema"
            return response_format["type"]  # json_schema -> json_object -> no response_format
        return None

    def _delay(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return min(max(retry_after, 0.0), self.retry_after_max_s)
        ceiling = min(self.backoff_max_s, self.backoff_base_s * 2 ** (attempt - 1))
        return ceiling / 2 + self._random.uniform(0, ceiling / 2)

    # -- counters ----------------------------------------------------------------------

    def _count(self, op: str, **increments: float) -> None:
        with self._stats_lock:
            stats = self._stats[op]
            for name, amount in increments.items():
                setattr(stats, name, getattr(stats, name) + amount)

    def _failed(self, op: str) -> None:
        """A call without a usable answer: counted, and a fallback where the offline policy decides instead."""
        self._count(op, failures=1)
        if op in CALL_FALLBACKS:
            self.metrics.count_fallbacks(op)

    def record(self, op: str, **increments: float) -> None:
        """Add to an operation's counters (the decider counts items this way)."""
        if op not in self._stats:
            raise ValueError(f"LLMClient.record: unknown operation {op!r}")
        self._count(op, **increments)

    def usage(self) -> dict[str, dict[str, float]]:
        """Per operation: calls, retries, adjusted, failures, invalid, refused_generated, items,
        items_invalid, prompt_tokens, completion_tokens, tokens_estimated, latency_s."""
        with self._stats_lock:
            return {op: dataclasses.asdict(stats) for op, stats in self._stats.items()}

    # -- lifetime ----------------------------------------------------------------------

    def close(self) -> None:
        """Close the HTTP client and stop the loop thread; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.run(self._shutdown())
        except RuntimeError:
            pass
        finally:
            self._loop.stop()

    async def _shutdown(self) -> None:
        """Cancel calls still in flight (their callers get CancelledError), then close HTTP."""
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        await self._client.close()

    def __enter__(self) -> "LLMClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _retry_after(response: Any) -> float | None:
    """Seconds from ``retry-after-ms`` / ``Retry-After`` (seconds or an HTTP date)."""
    headers = getattr(response, "headers", None)
    if headers is None:
        return None
    for header, divisor in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        raw = headers.get(header)
        if raw is None:
            continue
        try:
            return float(raw) / divisor
        except ValueError:
            pass
    raw = headers.get("retry-after")
    if raw:
        try:
            when = email.utils.parsedate_to_datetime(raw)
        except (TypeError, ValueError):
            return None
        return max(0.0, when.timestamp() - time.time())
    return None


# --------------------------------------------------------------------------- the decider


class LLMDecider:
    """:class:`~lifemem_ray.core.decisions.Decider` backed by :class:`LLMClient`.

    assign and describe use ``llm.model``; partition, split and distil use
    ``llm.strong_model`` (or ``llm.model``), as in the paper. Methods never raise
    because an LLM failed: they return None (per item for assign) and count it.
    They do raise on programming errors (duplicate keys, too few members).
    """

    name = "llm"

    def __init__(self, config: LLMConfig, client: LLMClient | None = None, *,
                 prompt_char_budget: int | None = None, **client_options: Any) -> None:
        """``client_options`` go to :class:`LLMClient` when no client is given.
        ``prompt_char_budget`` caps the trajectory text of one multi-trajectory prompt
        (default: ``llm.prompt_char_budget``)."""
        prompt_char_budget = config.prompt_char_budget if prompt_char_budget is None else prompt_char_budget
        if prompt_char_budget <= 0:
            raise ValueError("LLMDecider: prompt_char_budget must be > 0")
        self.config = config
        self.client = client or LLMClient(config, **client_options)
        self.prompt_char_budget = prompt_char_budget
        lexicon.size()  # load the provenance rule's lexicon now: a missing package fails here, not mid-ingest

    @property
    def model(self) -> str:
        return self.config.model

    @property
    def strong_model(self) -> str:
        return self.config.strong_model or self.config.model

    # -- assign ------------------------------------------------------------------------

    def assign(self, requests: Sequence[AssignRequest]) -> list[Assignment | None]:
        """Batches of ``llm.items_per_call`` items of one tenant each, all batches in flight at once."""
        return self.client.run(self._assign(requests))

    async def assign_async(self, requests: Sequence[AssignRequest]) -> list[Assignment | None]:
        """:meth:`assign` for callers inside an event loop: awaits without blocking it."""
        return await self.client.arun(self._assign(requests))

    async def _assign(self, requests: Sequence[AssignRequest]) -> list[Assignment | None]:
        keys = [r.key for r in requests]
        if len(set(keys)) != len(keys):
            raise ValueError(f"LLMDecider.assign: duplicate request keys {sorted(k for k in set(keys) if keys.count(k) > 1)}")
        if not requests:
            return []
        size = self.config.items_per_call
        by_tenant: dict[str, list[AssignRequest]] = {}
        for r in requests:  # one prompt never holds two tenants' trajectories or clusters
            by_tenant.setdefault(r.trajectory.tenant, []).append(r)
        chunks = [group[i : i + size] for group in by_tenant.values() for i in range(0, len(group), size)]
        answers = await asyncio.gather(*(self._assign_chunk(i, chunk) for i, chunk in enumerate(chunks)))
        merged: dict[int, Assignment | None] = {}
        for answer in answers:
            merged.update(answer)
        return [merged.get(r.key) for r in requests]

    async def _assign_chunk(self, index: int, chunk: list[AssignRequest]) -> dict[int, Assignment | None]:
        prompt = assign_prompt(chunk, self.config.max_item_chars)
        answer = await self.client.arequest(prompt, self.model, lambda data: check_assign(data, chunk, prompt.schema))
        answer = answer or {}
        result: dict[int, Assignment | None] = {}
        for request in chunk:
            assignment = answer.get(request.key)
            if assignment is not None and assignment.cluster_id is None:
                # new_group labels join items of one answer only: make them unique across calls.
                label = assignment.new_group or f"item-{request.key}"
                assignment = dataclasses.replace(assignment, new_group=f"llm{index}:{label}")
            result[request.key] = assignment
        invalid = sum(v is None for v in result.values())
        self.client.record("assign", items=len(chunk), items_invalid=invalid)
        self.client.metrics.count_fallbacks("assign", invalid)  # the offline policy places these items
        return result

    # -- partition / split -------------------------------------------------------------

    def partition(self, trajectories: Sequence[Trajectory]) -> Groups | None:
        """Group labels per trajectory (0.. in answer order) and one description per group."""
        if not trajectories:
            return [], []
        prompt = partition_prompt(trajectories, self.config.max_item_chars, self.prompt_char_budget)
        return self.client.request(prompt, self.strong_model, lambda data: check_groups(data, trajectories, prompt.schema))

    def split(self, cluster: ClusterView, members: Sequence[Trajectory], max_parts: int) -> Groups | None:
        """Child labels per member (0.. in answer order, at least 2 groups) and their descriptions."""
        prompt = split_prompt(cluster, members, max_parts, self.config.max_item_chars, self.prompt_char_budget)
        return self.client.request(prompt, self.strong_model, lambda data: check_groups(data, members, prompt.schema))

    # -- describe / distil -------------------------------------------------------------

    def describe(self, cluster: ClusterView) -> str | None:
        """One sentence for the cluster, drawing on its example trajectories only (the
        description shown beside them is generated text, not evidence)."""
        prompt = describe_prompt(cluster, self.config.max_item_chars, self.prompt_char_budget)
        source = from_trajectories(
            cluster.examples, f"the cluster's {_count(len(cluster.examples), 'example trajectory', 'example trajectories')}")
        return self.client.request(prompt, self.model, lambda data: check_description(data, prompt.schema, source))

    def distil(self, cluster: ClusterView, members: Sequence[Trajectory]) -> str | None:
        """A skill for the cluster, drawing on ``members`` (the sample it is distilled from)."""
        prompt = distil_prompt(cluster, members, self.config.max_item_chars, self.prompt_char_budget)
        forbidden = sorted({e for e in [t.env for t in members] + list(cluster.envs) if len(e) >= 4}
                           | {t.id for t in members if len(t.id) >= 6})
        source = from_trajectories(
            members, f"the cluster's {_count(len(members), 'member trajectory', 'member trajectories')}")
        return self.client.request(prompt, self.strong_model, lambda data: check_skill(data, prompt.schema, forbidden, source))

    # -- bookkeeping -------------------------------------------------------------------

    def usage(self) -> dict[str, dict[str, float]]:
        """The memory's operations only (an agent sharing the client counts under ``act``)."""
        return {op: v for op, v in self.client.usage().items() if op in MEMORY_OPERATIONS}

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> "LLMDecider":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
