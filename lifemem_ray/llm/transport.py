"""The transport to any OpenAI-compatible chat-completions server: :class:`LLMClient`, with
bounded concurrency, a hard per-call timeout, retries with backoff on transient errors, JSON
extraction and per-operation usage counters.

The engine calls synchronously, possibly from inside a running event loop (Ray async actors),
so coroutines run on a private event-loop thread owned by the client; ``asyncio.run`` in the
caller's thread would fail there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import email.utils
import logging
import os
import random
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar
from urllib.parse import urlparse

import openai

from lifemem_ray.core.errors import AnswerError, ConfigError, InvalidArgumentError, UsageError
from lifemem_ray.core.metrics import MetricsSink
from lifemem_ray.llm.answers import Checked, RefusalProblem, extract_json, snippet
from lifemem_ray.llm.llm_config import LLMConfig
from lifemem_ray.llm.llm_metrics import LLMMetrics
from lifemem_ray.llm.prompts import MEMORY_OPERATIONS, OPERATIONS, Prompt

__all__ = ["LLMClient", "merge_usage", "usage_refusals", "usage_totals"]

log = logging.getLogger(__name__)

T = TypeVar("T")


PLACEHOLDER_API_KEY = "sk-local"  # local servers want some key; they do not check it
DEFAULT_BASE_URL = "https://api.openai.com/v1"
RETRYABLE_STATUS = frozenset({408, 429})  # plus every 5xx
# Operations whose failed call leaves one decision to the offline policy (assign counts per item).
CALL_FALLBACKS = frozenset(MEMORY_OPERATIONS) - {"assign"}


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
                "a blocking call from the client's own event-loop thread would deadlock; use arun() there",
                where="LLMClient",
            )
        if self.loop.is_closed() or not self.loop.is_running():
            coro.close()
            raise UsageError("used after close()", where="LLMClient")
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
        config.checked()
        if not config.model:
            raise ConfigError("llm.model is empty; name the model the server serves", where="LLMClient")
        if backoff_base_s < 0 or backoff_max_s < 0 or retry_after_max_s < 0:
            raise InvalidArgumentError(
                "backoff_base_s, backoff_max_s and retry_after_max_s must be >= 0", where="LLMClient"
            )
        self.config = config
        self.base_url = config.base_url or os.environ.get("OPENAI_BASE_URL") or DEFAULT_BASE_URL
        host = (urlparse(self.base_url).hostname or "").lower()
        self._openai_host = host == "api.openai.com" or host.endswith(".openai.azure.com")
        api_key = config.api_key or os.environ.get("OPENAI_API_KEY") or ""
        if not api_key:
            if self._openai_host:
                log.warning(
                    "LLMClient: no API key (llm.api_key or OPENAI_API_KEY) for %s; calls will fail", self.base_url
                )
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
            raise UsageError(
                "must run on the client's loop; use request(), run() or arun()", where="LLMClient.arequest"
            )
        op = prompt.op
        if op not in self._stats:
            raise InvalidArgumentError(
                f"unknown operation {op!r}; known: {', '.join(OPERATIONS)}", where="LLMClient.arequest"
            )
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
            log.warning(
                "LLM %s (%s): invalid answer: %s; answer: %s", op, model, "; ".join(problems[:5]), snippet(content)
            )
        refused = sum(isinstance(p, RefusalProblem) for p in problems)
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
                    log.warning(
                        "LLM %s (%s): server rejected a parameter (HTTP %d: %s); retrying with %s",
                        op,
                        model,
                        exc.status_code,
                        snippet(exc.message, 200),
                        adjustment,
                    )
                    continue
                if exc.status_code in RETRYABLE_STATUS or exc.status_code >= 500:
                    failure = _Transient(
                        f"HTTP {exc.status_code}: {snippet(exc.message, 200)}", _retry_after(exc.response)
                    )
                else:
                    failure = f"HTTP {exc.status_code}: {snippet(exc.message, 200)} (not retried)"
            except openai.APIError as exc:  # e.g. a 200 whose body is not a chat completion
                failure = f"{type(exc).__name__}: {snippet(str(exc), 200)}"
            if isinstance(failure, str):
                log.warning("LLM %s (%s): call failed: %s", op, model, failure)
                return None
            attempt += 1
            if attempt > self.config.max_retries:
                log.warning("LLM %s (%s): giving up after %d attempts: %s", op, model, attempt, failure.reason)
                return None
            delay = self._delay(attempt, failure.retry_after)
            log.info(
                "LLM %s (%s): %s; retry %d/%d in %.2f s",
                op,
                model,
                failure.reason,
                attempt,
                self.config.max_retries,
                delay,
            )
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
            log.warning(
                "LLM %s: answer cut at llm.max_answer_tokens=%d (reasoning models spend part of it on "
                "hidden reasoning; raise it if answers come back empty or truncated)",
                op,
                self.config.max_answer_tokens,
            )
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
            raise InvalidArgumentError(f"unknown operation {op!r}", where="LLMClient.record")
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

    def __enter__(self) -> LLMClient:
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
