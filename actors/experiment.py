"""The lifelong experiment on Ray: rollout workers against one memory deployment per mode.

For each memory mode: a fresh deployment (none for ``none`` and ``global-skills``), then
for each phase of the stream the learning tasks (trajectories written, or buffered per
environment for the ``buffer`` stream), maintenance (skills up to date), and the test
tasks of every environment seen so far (nothing written). Then the self-learn row: each
environment learnt alone in a fresh memory. The report goes to JSON, Markdown and PNG.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Sequence

import ray

from lifemem_ray.config import MemoryConfig
from lifemem_ray.envs import Task, make_env
from lifemem_ray.lifelong import ExperimentConfig, Phase, ScoreTable, build_stream, metrics, render_markdown, transfer_events, write_plots
from lifemem_ray.model import Trajectory
from lifemem_ray.policy import OfflinePolicy
from lifemem_ray.rollout import EpisodeLimits

from . import deployment as dep
from .client import MemoryClient
from .rollout import EpisodeSpec, RolloutPool, TaskOutcome, print_progress

__all__ = ["load_tasks", "run_experiment"]

log = logging.getLogger(__name__)


def load_tasks(exp: ExperimentConfig) -> tuple[dict[str, list[Task]], dict[str, list[Task]]]:
    """Train and test tasks of every environment (each environment opened once, here)."""
    train: dict[str, list[Task]] = {}
    test: dict[str, list[Task]] = {}
    for name in exp.envs:
        env = make_env(name, **exp.env_options.get(name, {}))
        try:
            train[name] = env.tasks("train", limit=exp.train_tasks, seed=exp.seed)
            test[name] = env.tasks("test", limit=exp.test_tasks, seed=exp.seed)
        finally:
            env.close()
        if not train[name] or not test[name]:
            raise ValueError(f"environment {name!r}: {len(train[name])} train and {len(test[name])} test tasks; need both")
    return train, test


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-") or "run"


def _global_skill(trajectories: Sequence[Trajectory], policy: OfflinePolicy) -> str:
    """One profile over the whole unclustered pool (the AutoSkill-like baseline)."""
    return policy.distil(trajectories) if trajectories else ""


class _ModeRun:
    """One memory mode through the stream (or one environment alone, for self-learn)."""

    def __init__(self, exp: ExperimentConfig, mconf: MemoryConfig, pool: RolloutPool, mode: str, tag: str, store: Path,
                 on_result: Callable[[TaskOutcome], None]) -> None:
        self.exp, self.pool, self.mode, self.tag = exp, pool, mode, tag
        self.namespace: str | None = None
        self.on_result = on_result
        self.pool_trajectories: list[Trajectory] = []
        self.global_skill = ""
        self.client: MemoryClient | None = None
        if mode in ("trajectory", "lifemem"):
            self.namespace = _slug(f"lifelong-{exp.name}-{tag}")
            config = mconf.replace({"cluster.namespace": self.namespace})
            dep.stop(self.namespace)
            dep.remove_store(store)
            dep.deploy(store, config, shards=exp.shards)
            self.client = MemoryClient.connect(namespace=self.namespace, config=config)
        self.run_id = _slug(f"{exp.name}-s{exp.seed}-{tag}")

    def spec(self, phase: str, *, learn: bool) -> EpisodeSpec:
        return EpisodeSpec(
            run=self.run_id, phase=phase, mode=self.mode, agent=self.exp.learner if learn else self.exp.agent,
            namespace=self.namespace, write=learn and self.namespace is not None and self.exp.stream != "buffer",
            global_skill=self.global_skill,
        )

    def learn(self, phase: Phase) -> list[TaskOutcome]:
        keep = self.mode == "global-skills" or (self.exp.stream == "buffer" and self.namespace is not None)
        outcomes = self.pool.run(phase.tasks, self.spec(f"learn-{phase.index:02d}", learn=True), return_trajectories=keep, on_result=self.on_result)
        learnt = [Trajectory.from_dict(o.trajectory) for o in outcomes if o.trajectory is not None and o.error is None]
        if self.mode == "global-skills":
            self.pool_trajectories.extend(learnt)
            self.global_skill = _global_skill(self.pool_trajectories, OfflinePolicy())
        elif self.exp.stream == "buffer" and self.client is not None:
            self._commit_buffered(learnt)
        if self.client is not None:
            self.client.maintain()  # splits and skills current before the evaluation
        return outcomes

    def _commit_buffered(self, learnt: list[Trajectory]) -> None:
        """Per-environment caches of ``buffer_size``, each committed as one batch (in stream order)."""
        assert self.client is not None
        caches: dict[str, list[Trajectory]] = defaultdict(list)
        for traj in learnt:
            cache = caches[traj.env]
            cache.append(traj)
            if len(cache) >= self.exp.buffer_size:
                self.client.add_many(cache).result()
                caches[traj.env] = []
        for cache in caches.values():  # the phase ends: flush what is left
            if cache:
                self.client.add_many(cache).result()

    def evaluate(self, label: str, tasks: Sequence[Task]) -> tuple[dict[str, float], list[TaskOutcome]]:
        outcomes = self.pool.run(tasks, self.spec(f"eval-{label}", learn=False), on_result=self.on_result)
        per_env: dict[str, list[float]] = defaultdict(list)
        for o in outcomes:
            per_env[o.task.env].append(1.0 if o.success else 0.0)
        return {env: 100.0 * sum(v) / len(v) for env, v in per_env.items()}, outcomes

    def memory_summary(self) -> dict[str, Any]:
        if self.client is None:
            return {}
        stats = self.client.stats()
        clusters = self.client.clusters()
        per_env: dict[str, dict[str, int]] = {}
        for c in clusters:
            for env in c.envs:
                slot = per_env.setdefault(env, {"single_env": 0, "shared": 0})
                slot["single_env" if len(c.envs) == 1 else "shared"] += 1
        return {
            "trajectories": stats["trajectories"],
            "clusters": stats["clusters"],
            "mixed_env_clusters": stats["mixed_env_clusters"],
            "cluster_sizes": sorted((c.count for c in clusters), reverse=True),
            "clusters_per_env": dict(sorted(per_env.items())),
            "llm": stats["llm"],
        }

    def close(self) -> None:
        if self.namespace is not None:
            dep.stop(self.namespace)


def run_experiment(
    exp: ExperimentConfig,
    mconf: MemoryConfig | None = None,
    *,
    progress: Callable[[dict[str, Any]], None] | None = print_progress,
) -> dict[str, Any]:
    """Run the protocol for every mode; write ``report.json``, ``report.md`` and plots to
    ``exp.output_dir``; return the report. Needs ``ray.init`` first."""
    exp.validate()
    mconf = (mconf or MemoryConfig()).validate()
    if not ray.is_initialized():
        raise RuntimeError("run_experiment: call ray.init() first (or use `lifemem-ray run`)")
    out = exp.output_dir
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    train, test = load_tasks(exp)
    phases = build_stream(exp.stream, train, exp.envs, seed=exp.seed)
    limits = EpisodeLimits(max_steps=exp.max_steps or None, step_timeout_s=exp.step_timeout_s, episode_timeout_s=exp.episode_timeout_s)
    episodes: list[dict[str, Any]] = []

    def record(outcome: TaskOutcome) -> None:
        row = {"task_id": outcome.task.id, "env": outcome.task.env, "attempts": outcome.attempts, "error": outcome.error, **outcome.summary}
        row["stored"] = outcome.stored
        episodes.append(row)

    report: dict[str, Any] = {"config": exp.to_dict(), "memory_config": mconf.to_dict(), "modes": {}, "memory": {}}
    with RolloutPool(exp.workers, env_options=exp.env_options, config=mconf, limits=limits, seed=exp.seed,
                     worker_cpus=exp.worker_cpus, max_attempts=exp.max_attempts, progress=progress) as pool:
        for mode in exp.modes:
            mode_started = time.perf_counter()
            table = ScoreTable(list(exp.envs))
            run = _ModeRun(exp, mconf, pool, mode, mode, out / "memory" / mode, record)
            failed = 0
            try:
                for phase in phases:
                    learnt = run.learn(phase)
                    failed += sum(o.error is not None for o in learnt)
                    eval_tasks = [t for env in phase.evaluate for t in test[env]]
                    scores, outs = run.evaluate(f"{phase.index:02d}", eval_tasks)
                    failed += sum(o.error is not None for o in outs)
                    table.add_row(phase.label, scores)
                if mode == "lifemem":
                    report["memory"] = run.memory_summary()
            finally:
                run.close()  # the files stay under memory/<mode>: `lifemem-ray serve --store` reopens them
            if exp.self_learn:
                for env in exp.envs:
                    if mode == "none":  # nothing is learnt: the first evaluation is the isolated score
                        table.self_learn[env] = table.rows[table.first_seen(env) or 0][env]
                        continue
                    alone = _ModeRun(exp, mconf, pool, mode, f"{mode}-self-{env}", out / "memory" / f"{mode}-self-{env}", record)
                    try:
                        alone.learn(Phase(0, env, tuple(train[env]), (env,)))
                        scores, _ = alone.evaluate(f"self-{env}", test[env])
                        table.self_learn[env] = scores.get(env, 0.0)
                    finally:
                        alone.close()
                        dep.remove_store(out / "memory" / f"{mode}-self-{env}")
            report["modes"][mode] = {
                "table": table.to_dict(),
                "metrics": metrics(table),
                "transfer": transfer_events(table),
                "failed_tasks": failed,
                "seconds": round(time.perf_counter() - mode_started, 2),
            }
    report["episodes"] = len(episodes)
    report["success_by_env"] = _success_by_env(report)
    report["throughput"] = _throughput(episodes, time.perf_counter() - started)
    report["seconds"] = round(time.perf_counter() - started, 2)
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    with (out / "episodes.jsonl").open("w") as fh:
        for row in episodes:
            fh.write(json.dumps(row, default=str) + "\n")
    (out / "report.md").write_text(render_markdown(report))
    report["plots"] = [str(p) for p in write_plots(report, out)]
    return report


def _success_by_env(report: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Final-row success per environment for each mode (the exemplar-agent comparison)."""
    out: dict[str, dict[str, float]] = {}
    for mode, res in report["modes"].items():
        rows = res["table"]["rows"]
        if rows:
            out[mode] = {env: round(v, 2) for env, v in rows[-1].items()}
    return out


def _throughput(episodes: list[dict[str, Any]], seconds: float) -> dict[str, float]:
    done = [e for e in episodes if not e.get("error")]
    steps = sum(int(e.get("steps", 0)) for e in done)
    mem = sorted(float(e.get("memory_s", 0.0)) for e in done)
    return {
        "episodes": len(done),
        "steps": steps,
        "episodes_per_s": round(len(done) / seconds, 3) if seconds else 0.0,
        "steps_per_s": round(steps / seconds, 2) if seconds else 0.0,
        "memory_p50_ms": round(1000 * mem[len(mem) // 2], 3) if mem else 0.0,
        "memory_p99_ms": round(1000 * mem[min(len(mem) - 1, int(len(mem) * 0.99))], 3) if mem else 0.0,
    }
