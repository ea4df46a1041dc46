"""The lifelong-learning protocol (paper sections 5.3-5.5, 6.3, appendix C and H).

Engine-level and Ray-free: the experiment's typed configuration, the task streams,
the score table and its metrics, and the reports. :mod:`lifemem_ray.actors.experiment`
runs the protocol on rollout workers.

* Streams. ``similarity``: each environment's training tasks in a block, environments in
  the configured order (the paper's main setting). ``random``: all training tasks
  shuffled, cut into as many phases as there are environments. ``buffer``: the random
  order, but each environment's trajectories wait in a cache of ``buffer_size`` and go
  into the memory together as one batch (paper section 6.3).
* Table. After learning phase j, the test tasks of every environment seen so far are run
  without writing: s^i_{1..j} (a lower-triangular table for the similarity stream). The
  self-learn row: each environment learnt and evaluated alone, in a fresh memory.
* Metrics. OP = mean_i s^i_{1..N} (eq. 8); BwT = mean over i < N of
  (s^i_{1..N} - s^i_{1..i}) / s^i_{1..i} (eq. 9; terms with s^i_{1..i} = 0 are undefined
  and left out, their count reported). Transfer events: every later evaluation of an
  environment against the one just after learning it, ``improved`` / ``unchanged``
  (within +-5 points, the paper's figure 3) / ``degraded``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from .config import ConfigError, _coerce, read_toml
from .envs.base import Task

__all__ = [
    "MEMORY_MODES",
    "ExperimentConfig",
    "Phase",
    "ScoreTable",
    "build_stream",
    "metrics",
    "render_markdown",
    "transfer_events",
    "write_plots",
]

STREAMS = ("similarity", "random", "buffer")
# none: no memory (ReAct). trajectory: top-k over the whole pool, no skills (Synapse-like).
# global-skills: one skill profile distilled over the whole unclustered pool, no exemplars
# (AutoSkill-like). lifemem: same-environment top-k plus their clusters' skills.
MEMORY_MODES = ("none", "trajectory", "global-skills", "lifemem")
UNCHANGED_BAND = 5.0  # points (scores are 0-100)


@dataclass
class ExperimentConfig:
    """One lifelong experiment, the ``[experiment]`` table of a run file."""

    name: str = "lifelong"
    envs: list[str] = field(default_factory=lambda: ["twx-coin", "twx-mapreader", "twx-twc", "twx-arithmetic"])
    train_tasks: int = 20  # per environment
    test_tasks: int = 10
    stream: str = "similarity"
    buffer_size: int = 5
    modes: list[str] = field(default_factory=lambda: ["none", "trajectory", "global-skills", "lifemem"])
    agent: str = "exemplar"  # evaluation (and, with learn_agent "same", learning) agent
    learn_agent: str = "noisy-gold"  # who acts while learning: same | gold | noisy-gold | exemplar | random | react
    self_learn: bool = True
    workers: int = 2
    worker_cpus: float = 0.5
    shards: int = 1
    seed: int = 0
    max_steps: int = 0  # 0: each environment's own limit
    step_timeout_s: float = 60.0
    episode_timeout_s: float = 600.0
    max_attempts: int = 3
    output: str = ""  # default: runs/<name>
    env_options: dict[str, dict[str, Any]] = field(default_factory=dict)

    def validate(self) -> "ExperimentConfig":
        from .agents import AGENTS

        if not self.envs:
            raise ConfigError("experiment.envs: name at least one environment")
        if len(set(self.envs)) != len(self.envs):
            raise ConfigError(f"experiment.envs: repeated names in {self.envs}")
        if self.stream not in STREAMS:
            raise ConfigError(f"experiment.stream: must be one of {', '.join(STREAMS)}; got {self.stream!r}")
        if not self.modes or any(m not in MEMORY_MODES for m in self.modes):
            raise ConfigError(f"experiment.modes: each must be one of {', '.join(MEMORY_MODES)}; got {self.modes}")
        for key in ("agent", "learn_agent"):
            value = getattr(self, key)
            if value not in AGENTS and not (key == "learn_agent" and value == "same"):
                raise ConfigError(f"experiment.{key}: unknown agent {value!r}; known: {', '.join(sorted(AGENTS))}")
        for key in ("train_tasks", "test_tasks", "buffer_size", "workers", "shards", "max_attempts"):
            if getattr(self, key) < 1:
                raise ConfigError(f"experiment.{key}: must be >= 1, got {getattr(self, key)}")
        if self.max_steps < 0 or self.step_timeout_s <= 0 or self.episode_timeout_s <= 0 or self.worker_cpus < 0:
            raise ConfigError("experiment: max_steps must be >= 0; step_timeout_s, episode_timeout_s > 0; worker_cpus >= 0")
        for name, options in self.env_options.items():
            if not isinstance(options, dict):
                raise ConfigError(f"experiment.env_options.{name}: must be a table of keyword options")
        return self

    @property
    def learner(self) -> str:
        return self.agent if self.learn_agent == "same" else self.learn_agent

    @property
    def output_dir(self) -> Path:
        return Path(self.output or f"runs/{self.name}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None, *, environ: Mapping[str, str] | None = None,
             overrides: Mapping[str, Any] | None = None) -> "ExperimentConfig":
        """Defaults < the file's ``[experiment]`` table < ``LIFEMEM_EXPERIMENT_*`` < overrides."""
        config = cls()
        if path is not None:
            path = Path(path)
            data = read_toml(path)
            table = data.get("experiment", {})
            if not isinstance(table, dict):
                raise ConfigError(f"{path}: 'experiment' must be a table")
            for key, value in table.items():
                config._set(key, value, str(path))
        env = os.environ if environ is None else environ
        for name, value in env.items():
            if name.startswith("LIFEMEM_EXPERIMENT_"):
                config._set(name[len("LIFEMEM_EXPERIMENT_"):].lower(), value, name)
        for key, value in (overrides or {}).items():
            config._set(key, value, "override")
        return config.validate()

    def _set(self, key: str, value: Any, source: str) -> None:
        fields = {f.name for f in dataclasses.fields(self)}
        if key not in fields:
            raise ConfigError(f"{source}: unknown setting 'experiment.{key}'; known: {', '.join(sorted(fields))}")
        current = getattr(self, key)
        if isinstance(current, list):
            if isinstance(value, str):
                value = [v.strip() for v in value.split(",") if v.strip()]
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ConfigError(f"{source}: experiment.{key}: expected a list of strings, got {value!r}")
        elif isinstance(current, dict):
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as exc:
                    raise ConfigError(f"{source}: experiment.{key}: expected a table (JSON in a variable): {exc}") from None
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: experiment.{key}: expected a table, got {value!r}")
        else:
            value = _coerce(value, type(current), f"{source}: experiment.{key}")
        setattr(self, key, value)


# -- streams ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Phase:
    """One learning phase: tasks in stream order; after it, ``evaluate`` envs are tested."""

    index: int
    label: str  # the environment learnt (similarity) or "chunk k"
    tasks: tuple[Task, ...]
    evaluate: tuple[str, ...]


def build_stream(kind: str, train: Mapping[str, Sequence[Task]], env_order: Sequence[str], seed: int = 0) -> list[Phase]:
    """The learning phases of a stream (``buffer`` has the random order; batching is the runner's)."""
    if kind not in STREAMS:
        raise ValueError(f"stream: must be one of {', '.join(STREAMS)}; got {kind!r}")
    missing = [e for e in env_order if e not in train]
    if missing:
        raise ValueError(f"stream: no training tasks for {missing}")
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
        chunk = everything[bounds[j]: bounds[j + 1]]
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


def metrics(table: ScoreTable) -> dict[str, Any]:
    """OP (eq. 8) and BwT (eq. 9) of a table; s^i_{1..i} is the row where env i was first seen."""
    if not table.rows:
        return {"op": None, "bwt": None, "bwt_terms": 0, "bwt_undefined": 0}
    last = table.rows[-1]
    finals = [last[e] for e in table.envs if e in last]
    op = sum(finals) / len(finals) if finals else None
    terms, undefined = [], 0
    for env in table.envs:
        j = table.first_seen(env)
        if j is None or j == len(table.rows) - 1 or env not in last:
            continue  # the last environment (i = N) has no later learning
        base = table.rows[j][env]
        if base == 0:
            undefined += 1
            continue
        terms.append((last[env] - base) / base)
    bwt = 100.0 * sum(terms) / len(terms) if terms else None
    return {"op": op, "bwt": bwt, "bwt_terms": len(terms), "bwt_undefined": undefined}


def transfer_events(table: ScoreTable, band: float = UNCHANGED_BAND) -> dict[str, int]:
    """Each later score of an environment against its score right after it was learnt."""
    counts = {"improved": 0, "unchanged": 0, "degraded": 0}
    for env in table.envs:
        j = table.first_seen(env)
        if j is None:
            continue
        base = table.rows[j][env]
        for row in table.rows[j + 1:]:
            if env not in row:
                continue
            delta = row[env] - base
            counts["improved" if delta > band else "degraded" if delta < -band else "unchanged"] += 1
    return counts


# -- reports ------------------------------------------------------------------------------


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def render_markdown(report: Mapping[str, Any]) -> str:
    """The run's tables: per mode, the lower-triangular table with the self-learn row;
    then OP/BwT/transfer per mode and success per environment."""
    lines = [f"# Lifelong experiment `{report['config']['name']}`", ""]
    cfg = report["config"]
    lines.append(f"Stream **{cfg['stream']}**, agent **{cfg['agent']}** (learning: {cfg['learn_agent']}), "
                 f"{cfg['train_tasks']} train / {cfg['test_tasks']} test tasks per environment, {cfg['workers']} workers.")
    lines.append("")
    lines.append("| mode | OP | BwT (%) | improved | unchanged | degraded |")
    lines.append("|---|---:|---:|---:|---:|---:|")
    for mode, res in report["modes"].items():
        m, t = res["metrics"], res["transfer"]
        lines.append(f"| {mode} | {_fmt(m['op'])} | {_fmt(m['bwt'])} | {t['improved']} | {t['unchanged']} | {t['degraded']} |")
    lines.append("")
    for mode, res in report["modes"].items():
        table = res["table"]
        envs = table["envs"]
        lines.append(f"## {mode}")
        lines.append("")
        lines.append("| after learning | " + " | ".join(envs) + " |")
        lines.append("|---|" + "---:|" * len(envs))
        for label, row in zip(table["labels"], table["rows"]):
            lines.append(f"| {label} | " + " | ".join(_fmt(row.get(e)) if e in row else "" for e in envs) + " |")
        if table["self_learn"]:
            lines.append("| *self-learn* | " + " | ".join(_fmt(table["self_learn"].get(e)) for e in envs) + " |")
        lines.append("")
    if report.get("memory"):
        lines.append("## Memory at the end (LifeMem)")
        lines.append("")
        mem = report["memory"]
        lines.append(f"{mem.get('trajectories', 0)} trajectories in {mem.get('clusters', 0)} clusters.")
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
    fig, axes = plt.subplots(1, len(modes), figsize=(5.0 * len(modes), 3.8), squeeze=False, gridspec_kw={"wspace": 0.55})
    for ax, (mode, res) in zip(axes[0], modes.items()):
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
                ax.text(i, j, f"{value:.0f}", ha="center", va="center", color="white" if value < 60 else "black", fontsize=8)
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
