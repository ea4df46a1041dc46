"""The lifelong-learning protocol (paper sections 5.3-5.5, 6.1-6.3, appendix C and H).

Engine-level and Ray-free: the experiment's typed configuration, the task streams, the
train/test overlap check, the score tables with their bootstrap intervals and metrics, and
the reports. :mod:`lifemem_ray.actors.rollout.experiment` runs the protocol on rollout workers.

* Streams. ``similarity``: each environment's training tasks in a block, environments in
  the configured order (the paper's main setting). ``random``: all training tasks
  shuffled, cut into as many phases as there are environments. ``buffer``: the random
  order, but each environment's trajectories wait in a cache of ``buffer_size`` and go
  into the memory together as one batch (paper section 6.3).
* Table. After learning phase j, the test tasks of every environment seen so far are run
  without writing: s^i_{1..j} (a lower-triangular table for the similarity stream). The
  self-learn row: each environment learnt and evaluated alone, in a fresh memory.
  Evaluation-only environments (``eval_envs``: test tasks, no training) are run after the
  last phase: zero-shot transfer (section 6.2), reported as the gain over no memory.
* Metrics. OP = mean_i s^i_{1..N} (eq. 8); BwT = mean over i of
  (s^i_{1..N} - s^i_{learnt}) / s^i_{learnt} (eq. 9), where *learnt* is the row after the
  last phase holding environment i's training tasks (for the similarity stream the row where
  i is first seen, as in the paper; for the random and buffer streams an environment
  learnt until the last phase has no later learning and is left out, like the paper's
  i = N; further learning of the same environment is never counted as backward transfer).
  Terms with s^i_{learnt} = 0 are undefined and left out, their count reported. Transfer
  events: every evaluation of an environment after its *learnt* row against that row,
  ``improved`` / ``unchanged`` (within +-5 points, the paper's figure 3) / ``degraded``.
* Spread. Every cell, OP and BwT is computed on the table pooled over the seeds (each cell:
  the success rate over every seed's test episodes); its 95% interval is a percentile
  bootstrap that resamples the test tasks of each (seed, environment) with replacement, the
  same draw for every mode and row (paired), :data:`BOOTSTRAP_DEFAULT` times.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lifemem_ray.core.errors import InvalidArgumentError
from lifemem_ray.lab.envs.base import Task
from lifemem_ray.lab.experiment_config import (
    BOOTSTRAP_DEFAULT,
    MEMORY_AGENTS,
    MEMORY_MODES,
    RETRIEVING_MODES,
    STREAMS,
    ExperimentConfig,
)

__all__ = [
    "MEMORY_AGENTS",
    "MEMORY_MODES",
    "RETRIEVING_MODES",
    "ExperimentConfig",
    "Phase",
    "ScoreTable",
    "SeedResult",
    "build_stream",
    "learnt_rows",
    "metrics",
    "overlap",
    "render_markdown",
    "summarise",
    "transfer_events",
    "write_plots",
]

UNCHANGED_BAND = 5.0  # points (scores are 0-100)


# -- streams ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Phase:
    """One learning phase: tasks in stream order; after it, ``evaluate`` envs are tested."""

    index: int
    label: str  # the environment learnt (similarity) or "chunk k"
    tasks: tuple[Task, ...]
    evaluate: tuple[str, ...]


def build_stream(
    kind: str, train: Mapping[str, Sequence[Task]], env_order: Sequence[str], seed: int = 0
) -> list[Phase]:
    """The learning phases of a stream (``buffer`` has the random order; batching is the runner's)."""
    if kind not in STREAMS:
        raise InvalidArgumentError(f"must be one of {', '.join(STREAMS)}; got {kind!r}", where="stream")
    missing = [e for e in env_order if e not in train]
    if missing:
        raise InvalidArgumentError(f"no training tasks for {missing}", where="stream")
    if kind == "similarity":
        phases = []
        for j, env in enumerate(env_order):
            phases.append(Phase(j, env, tuple(train[env]), tuple(env_order[: j + 1])))
        return phases
    everything = [t for env in env_order for t in train[env]]
    random.Random(seed).shuffle(everything)
    n = len(env_order)
    bounds = [round(len(everything) * k / n) for k in range(n + 1)]
    phases, seen = [], []
    for j in range(n):
        chunk = everything[bounds[j] : bounds[j + 1]]
        for t in chunk:
            if t.env not in seen:
                seen.append(t.env)
        ordered = tuple(e for e in env_order if e in seen)
        phases.append(Phase(j, f"chunk {j + 1}", tuple(chunk), ordered))
    return phases


# -- the score table and its metrics ------------------------------------------------------


@dataclass
class ScoreTable:
    """s^i_{1..j}: ``rows[j][env]`` after learning phase j; ``self_learn[env]``. Scores 0-100."""

    envs: list[str]
    rows: list[dict[str, float]] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    self_learn: dict[str, float] = field(default_factory=dict)

    def add_row(self, label: str, scores: Mapping[str, float]) -> None:
        self.labels.append(label)
        self.rows.append(dict(scores))

    def first_seen(self, env: str) -> int | None:
        for j, row in enumerate(self.rows):
            if env in row:
                return j
        return None

    def to_dict(self) -> dict[str, Any]:
        return {"envs": self.envs, "labels": self.labels, "rows": self.rows, "self_learn": self.self_learn}


def learnt_rows(phases: Sequence[Phase]) -> dict[str, int]:
    """For each environment, the phase after which its training ends (the last phase holding
    one of its training tasks): the baseline row of its BwT term and transfer events."""
    rows: dict[str, int] = {}
    for phase in phases:
        for task in phase.tasks:
            rows[task.env] = phase.index
    return rows


def metrics(table: ScoreTable, learnt: Mapping[str, int] | None = None) -> dict[str, Any]:
    """OP (eq. 8) and BwT (eq. 9) of a table. ``learnt``: each environment's baseline row
    (:func:`learnt_rows`); by default the row where it was first seen (the similarity stream)."""
    if not table.rows:
        return {"op": None, "bwt": None, "bwt_terms": 0, "bwt_undefined": 0}
    last = table.rows[-1]
    finals = [last[e] for e in table.envs if e in last]
    op = sum(finals) / len(finals) if finals else None
    terms, undefined = [], 0
    for env in table.envs:
        j = table.first_seen(env) if learnt is None else learnt.get(env)
        if j is None or j >= len(table.rows) - 1 or env not in last or env not in table.rows[j]:
            continue  # learnt in the last phase: no later learning (the paper's i = N)
        base = table.rows[j][env]
        if base == 0:
            undefined += 1
            continue
        terms.append((last[env] - base) / base)
    bwt = 100.0 * sum(terms) / len(terms) if terms else None
    return {"op": op, "bwt": bwt, "bwt_terms": len(terms), "bwt_undefined": undefined}


def transfer_events(
    table: ScoreTable, band: float = UNCHANGED_BAND, learnt: Mapping[str, int] | None = None
) -> dict[str, int]:
    """Each later score of an environment against its score right after it was learnt."""
    counts = {"improved": 0, "unchanged": 0, "degraded": 0}
    for env in table.envs:
        j = table.first_seen(env) if learnt is None else learnt.get(env)
        if j is None or env not in table.rows[j]:
            continue
        base = table.rows[j][env]
        for row in table.rows[j + 1 :]:
            if env not in row:
                continue
            delta = row[env] - base
            counts["improved" if delta > band else "degraded" if delta < -band else "unchanged"] += 1
    return counts


# -- train/test overlap -------------------------------------------------------------------


def overlap(
    train: Sequence[Task], test: Sequence[Task], gold: Mapping[str, Sequence[str] | None]
) -> dict[str, list[str]]:
    """Test tasks that repeat a training task: ``gold`` (the same gold action sequence, so
    replaying a training run solves it) and ``goal`` (the same goal text). ``gold`` maps a
    task id to its gold actions (None: unknown). An environment whose training goals are all
    one text (a game whose goal never names the instance, such as TextWorldExpress's coin) has
    no goal overlap to speak of: ``goal`` is then empty and ``one_template`` lists its test
    tasks."""
    train_gold = {tuple(g) for t in train if (g := gold.get(t.id))}
    train_goals = {t.instruction.strip() for t in train}
    template = len(train_goals) == 1 and len(train) > 1
    out: dict[str, list[str]] = {"gold": [], "goal": [], "one_template": []}
    for t in test:
        g = gold.get(t.id)
        if g and tuple(g) in train_gold:
            out["gold"].append(t.id)
        if template:
            out["one_template"].append(t.id)
        elif t.instruction.strip() in train_goals:
            out["goal"].append(t.id)
    return out


# -- seeds, pooling and bootstrap intervals -----------------------------------------------


@dataclass
class SeedResult:
    """One seed's raw outcomes: 1/0 per test task, in the test tasks' order (the same order
    in every mode and row, which pairs the bootstrap draws).

    ``rows[mode][j][env]``: after phase j; ``self_learn[mode][env]``; ``zero_shot[mode][env]``
    (evaluation-only environments, after the last phase)."""

    seed: int
    labels: list[str]
    learnt: dict[str, int]
    rows: dict[str, list[dict[str, list[int]]]] = field(default_factory=dict)
    self_learn: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    zero_shot: dict[str, dict[str, list[int]]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _pool(results: Sequence[SeedResult], pick: Any, draws: Mapping[tuple[int, str], Any] | None) -> dict[str, float]:
    """Success (0-100) per environment over every seed's outcomes that ``pick(result)`` selects
    (a mapping env -> outcomes); ``draws`` resamples each (seed, env)'s task positions."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for r in results:
        for env, outcomes in (pick(r) or {}).items():
            if not outcomes:
                continue
            idx = draws.get((r.seed, env)) if draws is not None else None
            values = [outcomes[i] for i in idx] if idx is not None else outcomes
            sums[env] = sums.get(env, 0.0) + sum(values)
            counts[env] = counts.get(env, 0) + len(values)
    return {env: 100.0 * sums[env] / counts[env] for env in sums}


def _statistics(
    results: Sequence[SeedResult],
    modes: Sequence[str],
    envs: Sequence[str],
    draws: Mapping[tuple[int, str], Any] | None,
) -> dict[str, dict[str, Any]]:
    """Every mode's pooled table, OP, BwT and zero-shot scores (on one draw)."""
    first = results[0]
    out: dict[str, dict[str, Any]] = {}
    for mode in modes:
        table = ScoreTable(list(envs))
        # _pool calls its picker at once; the defaults bind this iteration's mode and row all the same.
        for j, label in enumerate(first.labels):
            table.add_row(label, _pool(results, lambda r, mode=mode, j=j: r.rows.get(mode, [{}] * (j + 1))[j], draws))
        table.self_learn = _pool(results, lambda r, mode=mode: r.self_learn.get(mode), draws)
        zero = _pool(results, lambda r, mode=mode: r.zero_shot.get(mode), draws)
        out[mode] = {"table": table, "metrics": metrics(table, first.learnt), "zero_shot": zero}
    if "none" in out:
        for mode in modes:
            base = out["none"]["zero_shot"]
            out[mode]["zero_shot_gain"] = {
                env: v - base[env] for env, v in out[mode]["zero_shot"].items() if env in base
            }
    return out


def summarise(
    results: Sequence[SeedResult],
    modes: Sequence[str],
    envs: Sequence[str],
    *,
    bootstrap: int = BOOTSTRAP_DEFAULT,
    seed: int = 0,
) -> dict[str, dict[str, Any]]:
    """Per mode: the pooled table (``table``), ``metrics`` (OP, BwT), ``transfer`` events,
    ``zero_shot`` and ``zero_shot_gain`` (over none), and ``ci``: a [low, high] 95% interval
    for every cell, OP, BwT and zero-shot figure (None where a draw left it undefined too
    often, or with ``bootstrap=0``)."""
    import numpy as np

    if not results:
        raise InvalidArgumentError("no seed results", where="summarise")
    point = _statistics(results, modes, envs, None)
    rng = np.random.default_rng(seed)
    sizes = {}
    for r in results:
        for mode_rows in list(r.rows.values())[:1]:
            for row in mode_rows:
                for env, outcomes in row.items():
                    sizes[(r.seed, env)] = len(outcomes)
        for per_env in list(r.zero_shot.values())[:1] + list(r.self_learn.values())[:1]:
            for env, outcomes in per_env.items():
                sizes.setdefault((r.seed, env), len(outcomes))
    samples: dict[str, dict[str, list[float]]] = {m: {} for m in modes}
    for _ in range(bootstrap):
        draws = {key: rng.integers(0, n, n) for key, n in sizes.items() if n}
        stats = _statistics(results, modes, envs, draws)
        for mode, st in stats.items():
            for key, value in _flat(st).items():
                if value is not None:
                    samples[mode].setdefault(key, []).append(value)
    summary: dict[str, dict[str, Any]] = {}
    for mode, st in point.items():
        ci = {}
        for key, value in _flat(st).items():
            got = samples[mode].get(key, [])
            ok = bootstrap and value is not None and len(got) >= 0.9 * bootstrap
            ci[key] = [float(np.percentile(got, 2.5)), float(np.percentile(got, 97.5))] if ok else None
        table: ScoreTable = st["table"]
        summary[mode] = {
            "table": table.to_dict(),
            "metrics": st["metrics"],
            "transfer": transfer_events(table, learnt=results[0].learnt),
            "zero_shot": st["zero_shot"],
            "zero_shot_gain": st.get("zero_shot_gain", {}),
            "ci": ci,
        }
    return summary


def _flat(st: Mapping[str, Any]) -> dict[str, float | None]:
    """The figures of one mode's statistics under stable keys: ``row/j/env``, ``self/env``,
    ``op``, ``bwt``, ``zero/env``, ``gain/env``."""
    table: ScoreTable = st["table"]
    flat: dict[str, float | None] = {"op": st["metrics"]["op"], "bwt": st["metrics"]["bwt"]}
    for j, row in enumerate(table.rows):
        for env, value in row.items():
            flat[f"row/{j}/{env}"] = value
    for env, value in table.self_learn.items():
        flat[f"self/{env}"] = value
    for env, value in st["zero_shot"].items():
        flat[f"zero/{env}"] = value
    for env, value in st.get("zero_shot_gain", {}).items():
        flat[f"gain/{env}"] = value
    return flat


# -- reports ------------------------------------------------------------------------------


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def _cell(value: float | None, ci: Sequence[float] | None, digits: int = 1) -> str:
    text = _fmt(value, digits)
    return f"{text} [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]" if ci and value is not None else text


def render_markdown(report: Mapping[str, Any]) -> str:
    """The run's tables: OP / BwT / transfer events and zero-shot gains per mode, each with
    its 95% interval; then per mode the lower-triangular table with the self-learn row."""
    cfg = report["config"]
    lines = [f"# Lifelong experiment `{cfg['name']}`", ""]
    learner = report.get("learner", {})
    lines.append(
        f"Stream **{cfg['stream']}**; agent **{cfg['agent']}**; learning agent **{learner.get('agent', cfg['learn_agent'])}** "
        f"({learner.get('collection', '')}); {cfg['train_tasks']} train / {cfg['test_tasks']} test tasks per environment; "
        f"seeds {', '.join(str(s) for s in report.get('seeds', [cfg['seed']]))}; cells are success rates (%) pooled "
        f"over the seeds, with a 95% bootstrap interval over test tasks ({cfg.get('bootstrap', 0)} resamples)."
    )
    if report.get("memory_settings"):
        lines.append(
            "Memory settings of this run: "
            + ", ".join(f"`{k} = {v}`" for k, v in report["memory_settings"].items())
            + "."
        )
    ov = report.get("overlap") or {}
    if ov:
        parts = [
            f"{env}: {v['gold']} same gold actions, {v['goal']} same goal"
            + (" (one goal template)" if v.get("one_template") else "")
            + (f", {v['dropped']} dropped" if v.get("dropped") else "")
            for env, v in ov.items()
        ]
        lines.append("Train/test overlap (test tasks repeating a training task): " + "; ".join(parts) + ".")
    lines.append("")
    zero_envs = list(cfg.get("eval_envs") or [])
    head = "| mode | OP | BwT (%) | improved | unchanged | degraded |" + "".join(
        f" zero-shot {e} (gain vs none) |" for e in zero_envs
    )
    lines.append(head)
    lines.append("|---|---:|---:|---:|---:|---:|" + "---:|" * len(zero_envs))
    for mode, res in report["modes"].items():
        m, t, ci = res["metrics"], res["transfer"], res.get("ci", {})
        row = f"| {mode} | {_cell(m['op'], ci.get('op'))} | {_cell(m['bwt'], ci.get('bwt'))} | {t['improved']} | {t['unchanged']} | {t['degraded']} |"
        for env in zero_envs:
            score, gain = res.get("zero_shot", {}).get(env), res.get("zero_shot_gain", {}).get(env)
            row += f" {_fmt(score, 1)} ({'+' if (gain or 0) >= 0 else ''}{_cell(gain, ci.get(f'gain/{env}'))}) |"
        lines.append(row)
    lines.append("")
    for mode, res in report["modes"].items():
        table, ci = res["table"], res.get("ci", {})
        envs = table["envs"]
        lines.append(f"## {mode}")
        lines.append("")
        lines.append("| after learning | " + " | ".join(envs) + " |")
        lines.append("|---|" + "---:|" * len(envs))
        for j, (label, row) in enumerate(zip(table["labels"], table["rows"], strict=True)):
            lines.append(
                f"| {label} | "
                + " | ".join(_cell(row[e], ci.get(f"row/{j}/{e}")) if e in row else "" for e in envs)
                + " |"
            )
        if table["self_learn"]:
            lines.append(
                "| *self-learn* | "
                + " | ".join(_cell(table["self_learn"].get(e), ci.get(f"self/{e}")) for e in envs)
                + " |"
            )
        lines.append("")
    if report.get("memory"):
        lines.append("## Memory at the end (the stream's memory, last seed)")
        lines.append("")
        mem = report["memory"]
        lines.append(
            f"{mem.get('trajectories', 0)} trajectories in {mem.get('clusters', 0)} clusters "
            f"({mem.get('mixed_env_clusters', 0)} with several environments), {mem.get('splits', 0)} splits."
        )
        lines.append("")
    return "\n".join(lines) + "\n"


def write_plots(report: Mapping[str, Any], directory: str | Path) -> list[Path]:
    """PNG plots: each mode's table as a heatmap; the LifeMem memory's cluster-size
    histogram (paper figure 5) and cluster types per environment (figure 6)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    modes = report["modes"]
    fig, axes = plt.subplots(
        1, len(modes), figsize=(5.0 * len(modes), 3.8), squeeze=False, gridspec_kw={"wspace": 0.55}
    )
    for ax, (mode, res) in zip(axes[0], modes.items(), strict=True):
        table = res["table"]
        envs, rows = table["envs"], table["rows"]
        grid = np.full((len(rows) + (1 if table["self_learn"] else 0), len(envs)), np.nan)
        for j, row in enumerate(rows):
            for i, env in enumerate(envs):
                if env in row:
                    grid[j, i] = row[env]
        labels = list(table["labels"])
        if table["self_learn"]:
            grid[-1] = [table["self_learn"].get(e, np.nan) for e in envs]
            labels.append("self-learn")
        im = ax.imshow(grid, vmin=0, vmax=100, cmap="viridis")
        for (j, i), value in np.ndenumerate(grid):
            if not np.isnan(value):
                ax.text(
                    i, j, f"{value:.0f}", ha="center", va="center", color="white" if value < 60 else "black", fontsize=8
                )
        ax.set_xticks(range(len(envs)), envs, rotation=45, ha="right", fontsize=7)
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        m = res["metrics"]
        ax.set_title(f"{mode}\nOP {_fmt(m['op'], 1)}, BwT {_fmt(m['bwt'], 1)}%", fontsize=9)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="success (%)")
    path = directory / "table_heatmap.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    written.append(path)

    memory = report.get("memory") or {}
    sizes = memory.get("cluster_sizes") or []
    if sizes:
        fig, ax = plt.subplots(figsize=(5, 3.2))
        bins = [1, 2, 3, 5, 10, 20, 50, 100, max(101, max(sizes) + 1)]
        ax.hist(sizes, bins=bins, color="#4477aa", edgecolor="white")
        ax.set_xscale("log")
        ax.set_xlabel("cluster size (trajectories)")
        ax.set_ylabel("clusters")
        ax.set_title(f"Cluster sizes ({len(sizes)} clusters)")
        path = directory / "cluster_sizes.png"
        fig.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    per_env = memory.get("clusters_per_env") or {}
    if per_env:
        fig, ax = plt.subplots(figsize=(5.5, 3.2))
        envs = list(per_env)
        single = [per_env[e]["single_env"] for e in envs]
        shared = [per_env[e]["shared"] for e in envs]
        ax.bar(envs, single, label="this environment only", color="#4477aa")
        ax.bar(envs, shared, bottom=single, label="shared with others", color="#ee6677")
        ax.set_ylabel("clusters")
        ax.set_title("Cluster types per environment")
        ax.tick_params(axis="x", rotation=45, labelsize=7)
        ax.legend(fontsize=7)
        path = directory / "cluster_types.png"
        fig.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written
