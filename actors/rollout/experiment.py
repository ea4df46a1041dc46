"""The lifelong experiment on Ray: rollout workers against memory deployments, per seed.

For each seed:

1. **Tasks.** Every environment's training and test tasks, and the test tasks of the
   evaluation-only environments; test tasks that repeat a training task are counted and
   (``dedupe_test``) replaced by the next ones (:func:`lifemem_ray.lab.lifelong.overlap`).
2. **Learning data, once.** When the learner does not read the memory (gold, noisy-gold,
   random), its training trajectories are collected once, with no memory, and every mode
   and the self-learn rows get the very same trajectories: one memory deployment serves all
   the retrieving modes (they differ only in what they read from it), and ``global-skills``
   distils its profile over the same pool with the memory's own distiller (the LLM when the
   run has one). A learner that reads the memory (``learn_agent`` one of
   ``lifelong.MEMORY_AGENTS``, or ``"same"`` with such an agent) acts differently per mode, so each retrieving mode then learns into a memory of
   its own; the report says which collection ran.
3. **The stream.** After each phase's trajectories went in (in stream order; the buffer
   stream commits per-environment caches of ``buffer_size``) and maintenance ran (splits,
   skills), every mode runs the test tasks of the environments seen so far, nothing
   written. ``none`` has no memory: it runs each environment's test tasks once, and its
   rows repeat that score. After the last phase, every mode runs the evaluation-only
   environments (zero-shot transfer): retrieval for such an environment goes to its alias
   (``aliases``) or, without one, to the stored environment whose trajectories best match
   each task (the largest summed score among the global top-k).
4. **Self-learn.** Each environment's own trajectories alone in a fresh memory.

The raw outcomes (:class:`lifemem_ray.lab.lifelong.SeedResult`) are pooled over the seeds with
bootstrap intervals (:func:`lifemem_ray.lab.lifelong.summarise`); the report goes to JSON,
Markdown and PNG.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import re
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from lifemem_ray.actors.client.blocking import MemoryClient
from lifemem_ray.actors.cluster import deployment as dep
from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.actors.rollout.workers import EpisodeSpec, RolloutPool, TaskOutcome, print_progress
from lifemem_ray.core.decisions import ClusterView
from lifemem_ray.core.errors import ConfigError, UsageError
from lifemem_ray.core.model import Trajectory
from lifemem_ray.engine.clustering.policy import OfflinePolicy
from lifemem_ray.lab.envs import Task, make_env
from lifemem_ray.lab.episode import EpisodeLimits
from lifemem_ray.lab.experiment_config import RETRIEVING_MODES, ExperimentConfig
from lifemem_ray.lab.lifelong import (
    Phase,
    SeedResult,
    build_stream,
    learnt_rows,
    overlap,
    render_markdown,
    summarise,
    write_plots,
)

__all__ = ["SeedTasks", "load_tasks", "run_experiment"]

log = logging.getLogger(__name__)


@dataclass
class SeedTasks:
    """One seed's tasks: ``train`` and ``test`` per trained environment, ``zero_shot`` test
    tasks per evaluation-only environment, and the overlap found (env -> counts)."""

    train: dict[str, list[Task]]
    test: dict[str, list[Task]]
    zero_shot: dict[str, list[Task]] = field(default_factory=dict)
    overlap: dict[str, dict[str, int]] = field(default_factory=dict)


def load_tasks(exp: ExperimentConfig, seed: int | None = None) -> SeedTasks:
    """Train and test tasks of every environment for ``seed`` (each environment opened
    once, here), with the train/test overlap check."""
    seed = exp.seed if seed is None else seed
    out = SeedTasks({}, {})
    for name in list(exp.envs) + list(exp.eval_envs):
        env = make_env(name, **exp.env_options.get(name, {}))
        try:
            if name in exp.eval_envs:
                out.zero_shot[name] = env.tasks("test", limit=exp.test_tasks, seed=seed)
                if not out.zero_shot[name]:
                    raise ConfigError(f"environment {name!r}: no test tasks for zero-shot evaluation")
                continue
            train = env.tasks("train", limit=exp.train_tasks, seed=seed)
            candidates = (
                env.tasks("test", limit=None, seed=seed)
                if exp.dedupe_test
                else env.tasks("test", limit=exp.test_tasks, seed=seed)
            )
            test, out.overlap[name] = _pick_test(exp, env, train, candidates)
        finally:
            env.close()
        if not train or not test:
            raise ConfigError(
                f"environment {name!r}: {len(train)} train and {len(test)} test tasks without overlap; need both"
            )
        out.train[name], out.test[name] = train, test
    return out


def _pick_test(
    exp: ExperimentConfig, env: Any, train: list[Task], candidates: list[Task]
) -> tuple[list[Task], dict[str, Any]]:
    """The test tasks, in the fold's order: the first ``test_tasks`` (with ``dedupe_test``,
    skipping those that repeat a training task), and the overlap counts of the configured
    first ``test_tasks``. Gold actions are asked for only as far as the search goes: a
    planner (ALFWorld) may take seconds per task."""
    gold = {t.id: _gold(env, t) for t in train}
    test: list[Task] = []
    counts: dict[str, Any] = {"gold": 0, "goal": 0, "one_template": False, "dropped": 0}
    for position, task in enumerate(candidates):
        if position >= exp.test_tasks and len(test) >= exp.test_tasks:
            break
        gold[task.id] = _gold(env, task)
        found = overlap(train, [task], gold)
        repeated = bool(found["gold"] or found["goal"])
        if position < exp.test_tasks:  # the test set the configuration names
            counts["gold"] += bool(found["gold"])
            counts["goal"] += bool(found["goal"])
            counts["one_template"] = counts["one_template"] or bool(found["one_template"])
            counts["dropped"] += repeated and exp.dedupe_test
        if len(test) < exp.test_tasks and not (exp.dedupe_test and repeated):
            test.append(task)
    return test, counts


def _gold(env: Any, task: Task) -> list[str] | None:
    try:
        return env.gold_actions(task)
    except Exception:  # noqa: BLE001 - an environment that cannot tell: no gold overlap to check
        return None


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-") or "run"


def _outcomes(outs: Sequence[TaskOutcome], envs: Sequence[str]) -> dict[str, list[int]]:
    """1/0 per task, per environment, in the tasks' order (a failed task counts as 0)."""
    per_env: dict[str, list[int]] = {env: [] for env in envs}
    for o in outs:
        per_env.setdefault(o.task.env, []).append(1 if o.success else 0)
    return per_env


def global_skill(trajectories: Sequence[Trajectory], config: DeploymentConfig) -> str:
    """One skill profile over the whole unclustered pool (the AutoSkill-like baseline), by
    the memory's own distiller: the LLM when ``llm.backend = "openai"`` (the offline
    procedure when it gives no valid answer), else the offline policy."""
    if not trajectories:
        return ""
    offline = OfflinePolicy(config.policy)
    sample = list(trajectories)
    n = config.evolution.skill_sample_size
    if len(sample) > n:
        sample = random.Random(len(sample)).sample(sample, n)
    if config.llm.backend == "openai":
        from lifemem_ray.llm.decider import LLMDecider

        envs: dict[str, int] = defaultdict(int)
        for t in trajectories:
            envs[t.env] += 1
        view = ClusterView(
            id=0,
            count=len(trajectories),
            description="every stored trajectory",
            envs=dict(envs),
            examples=tuple(sample[:3]),
        )
        with LLMDecider(config.llm) as decider:
            text = decider.distil(view, sample)
        if text:
            return text
    return offline.distil(sample)


class _Memory:
    """One memory deployment and its client; removed with its files on close."""

    def __init__(self, exp: ExperimentConfig, mconf: DeploymentConfig, tag: str, store: Path) -> None:
        self.namespace = _slug(f"lifelong-{exp.name}-{tag}")
        self.store = store
        self.config = mconf.replace({"cluster.namespace": self.namespace})
        dep.stop(self.namespace)
        dep.remove_store(store)
        dep.deploy(store, self.config, shards=exp.shards)
        self.client = MemoryClient.connect(namespace=self.namespace, config=self.config)

    def add(self, trajectories: Sequence[Trajectory], buffer_size: int | None) -> None:
        """Commit in stream order: at once, or per-environment caches of ``buffer_size``."""
        if buffer_size is None:
            if trajectories:
                self.client.add_many(list(trajectories)).result()
        else:
            caches: dict[str, list[Trajectory]] = defaultdict(list)
            for traj in trajectories:
                caches[traj.env].append(traj)
                if len(caches[traj.env]) >= buffer_size:
                    self.client.add_many(caches.pop(traj.env)).result()
            for cache in caches.values():  # the phase ends: flush what is left
                self.client.add_many(cache).result()
        self.client.maintain()  # splits and skills current before the evaluation

    def summary(self) -> dict[str, Any]:
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
            "splits": stats.get("splits", 0),
            "cluster_sizes": sorted((c.count for c in clusters), reverse=True),
            "clusters_per_env": dict(sorted(per_env.items())),
            "llm": stats["llm"],
        }

    def close(self, keep: bool) -> None:
        dep.stop(self.namespace)
        if not keep:
            dep.remove_store(self.store)


class _SeedRun:
    """One seed of the protocol: memories, learning, evaluations (module docstring)."""

    def __init__(
        self,
        exp: ExperimentConfig,
        mconf: DeploymentConfig,
        pool: RolloutPool,
        seed: int,
        tasks: SeedTasks,
        out: Path,
        record: Callable[[TaskOutcome], None],
    ) -> None:
        self.exp, self.mconf, self.pool, self.seed, self.tasks, self.out, self.record = (
            exp,
            mconf,
            pool,
            seed,
            tasks,
            out,
            record,
        )
        self.run_id = _slug(f"{exp.name}-s{seed}")
        self.retrieving = [m for m in exp.modes if m in RETRIEVING_MODES]
        self.failed: dict[str, int] = defaultdict(int)
        self.memory_summary: dict[str, Any] = {}

    # -- pieces ------------------------------------------------------------------------
    def _spec(
        self, phase: str, mode: str, memory: _Memory | None, *, learn: bool = False, skill: str = ""
    ) -> EpisodeSpec:
        routes = tuple((env, self.exp.aliases.get(env, "")) for env in self.exp.eval_envs)
        return EpisodeSpec(
            run=self.run_id,
            phase=phase,
            mode=mode,
            agent=self.exp.learner if learn else self.exp.agent,
            namespace=memory.namespace if memory is not None else None,
            write=learn and memory is not None,
            global_skill=skill,
            seed=self.seed,
            routes=routes,
        )

    def _evaluate(
        self,
        label: str,
        mode: str,
        memory: _Memory | None,
        envs: Sequence[str],
        tasks: dict[str, list[Task]],
        skill: str = "",
    ) -> dict[str, list[int]]:
        todo = [t for env in envs for t in tasks[env]]
        outs = self.pool.run(todo, self._spec(f"eval-{label}-{mode}", mode, memory, skill=skill), on_result=self.record)
        self.failed[mode] += sum(o.error is not None for o in outs)
        return _outcomes(outs, envs)

    def _collect(self, tasks: Sequence[Task], phase: str) -> dict[tuple[str, str], Trajectory]:
        """The learner's trajectories of ``tasks``, with no memory (task key -> trajectory)."""
        outs = self.pool.run(
            tasks, self._spec(phase, "none", None, learn=True), return_trajectories=True, on_result=self.record
        )
        got = {}
        for o in outs:
            if o.trajectory is not None and o.error is None:
                got[(o.task.env, o.task.id)] = Trajectory.from_dict(o.trajectory)
            else:
                self.failed["learning"] += 1
        return got

    # -- the protocol --------------------------------------------------------------------
    def run(self, phases: Sequence[Phase]) -> SeedResult:
        exp = self.exp
        result = SeedResult(self.seed, [p.label for p in phases], learnt_rows(phases))
        shared = not exp.learner_uses_memory
        everything = [t for p in phases for t in p.tasks]
        collected = self._collect(everything, "learn") if shared else {}
        groups = [tuple(self.retrieving)] if shared else [(m,) for m in self.retrieving]
        # Stores: memory/s<seed>-stream (shared by the retrieving modes) or memory/s<seed>-<mode>.
        memories = {
            g: _Memory(
                exp,
                self.mconf,
                f"s{self.seed}-" + "-".join(g),
                self.out / "memory" / f"s{self.seed}-{'stream' if shared else g[0]}",
            )
            for g in groups
            if g
        }
        pool_so_far: list[Trajectory] = []
        skill = ""
        none_scores: dict[str, list[int]] = {}
        try:
            for phase in phases:
                learnt = [collected[(t.env, t.id)] for t in phase.tasks if (t.env, t.id) in collected]
                for group, memory in memories.items():
                    if shared:
                        memory.add(learnt, exp.buffer_size if exp.stream == "buffer" else None)
                    else:
                        self._learn_with(group[0], memory, phase)
                if "global-skills" in exp.modes:
                    pool_so_far += learnt if shared else self._learn_global(phase, skill)
                    skill = global_skill(pool_so_far, self.mconf)
                label = f"{phase.index:02d}"
                for mode in exp.modes:
                    rows = result.rows.setdefault(mode, [])
                    if mode == "none":
                        new = [e for e in phase.evaluate if e not in none_scores]
                        none_scores.update(self._evaluate(label, mode, None, new, self.tasks.test) if new else {})
                        rows.append({e: none_scores[e] for e in phase.evaluate})
                        continue
                    mode_memory = next((m for g, m in memories.items() if mode in g), None)
                    rows.append(self._evaluate(label, mode, mode_memory, phase.evaluate, self.tasks.test, skill))
            if exp.eval_envs:
                for mode in exp.modes:
                    mode_memory = next((m for g, m in memories.items() if mode in g), None)
                    result.zero_shot[mode] = self._evaluate(
                        "zero-shot", mode, mode_memory, exp.eval_envs, self.tasks.zero_shot, skill
                    )
            if memories:
                self.memory_summary = next(iter(memories.values())).summary()
        finally:
            for memory in memories.values():
                memory.close(keep=True)  # the files stay under memory/: `lifemem-ray serve --store` reopens them
        if exp.self_learn:
            self._self_learn(result, collected, none_scores)
        return result

    def _learn_with(self, mode: str, memory: _Memory, phase: Phase) -> None:
        """A memory-reading learner acts with its mode's memory and writes into it."""
        spec = self._spec(f"learn-{phase.index:02d}-{mode}", mode, memory, learn=True)
        if self.exp.stream == "buffer":
            spec = dataclasses.replace(spec, write=False)
            outs = self.pool.run(phase.tasks, spec, return_trajectories=True, on_result=self.record)
            memory.add(
                [Trajectory.from_dict(o.trajectory) for o in outs if o.trajectory and o.error is None],
                self.exp.buffer_size,
            )
        else:
            self.pool.run(phase.tasks, spec, on_result=self.record)
            memory.client.maintain()

    def _learn_global(self, phase: Phase, skill: str) -> list[Trajectory]:
        spec = self._spec(f"learn-{phase.index:02d}-global-skills", "global-skills", None, learn=True, skill=skill)
        outs = self.pool.run(phase.tasks, spec, return_trajectories=True, on_result=self.record)
        return [Trajectory.from_dict(o.trajectory) for o in outs if o.trajectory and o.error is None]

    def _self_learn(
        self, result: SeedResult, collected: dict[tuple[str, str], Trajectory], none_scores: dict[str, list[int]]
    ) -> None:
        """Each environment learnt alone in a fresh memory, evaluated by every mode."""
        exp = self.exp
        for env in exp.envs:
            alone_phase = Phase(0, env, tuple(self.tasks.train[env]), (env,))
            for mode in exp.modes:
                result.self_learn.setdefault(mode, {})
            if "none" in exp.modes:  # no memory: the score of the stream's evaluation
                result.self_learn["none"][env] = none_scores[env]
            shared = not exp.learner_uses_memory
            groups = [tuple(self.retrieving)] if shared else [(m,) for m in self.retrieving]
            learnt = [collected[(t.env, t.id)] for t in alone_phase.tasks if (t.env, t.id) in collected]
            for group in groups:
                if not group:
                    continue
                tag = f"s{self.seed}-self-{env}-{group[0]}"
                memory = _Memory(exp, self.mconf, tag, self.out / "memory" / tag)
                try:
                    if shared:
                        memory.add(learnt, None)
                    else:
                        self._learn_with(group[0], memory, alone_phase)
                    for mode in group:
                        result.self_learn[mode][env] = self._evaluate(
                            f"self-{env}", mode, memory, [env], self.tasks.test
                        )[env]
                finally:
                    memory.close(keep=False)
            if "global-skills" in exp.modes:
                pool = learnt if shared else self._learn_global(alone_phase, "")
                skill = global_skill(pool, self.mconf)
                result.self_learn["global-skills"][env] = self._evaluate(
                    f"self-{env}", "global-skills", None, [env], self.tasks.test, skill
                )[env]


def _memory_settings(exp: ExperimentConfig) -> dict[str, Any]:
    """``experiment.memory`` as flat "section.key" settings (a nested TOML table too)."""
    flat: dict[str, Any] = {}
    for key, value in exp.memory.items():
        if isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    return flat


def run_experiment(
    exp: ExperimentConfig,
    mconf: DeploymentConfig | None = None,
    *,
    progress: Callable[[dict[str, Any]], None] | None = print_progress,
) -> dict[str, Any]:
    """Run the protocol for every seed and mode; write ``report.json``, ``report.md``,
    ``episodes.jsonl`` and plots to ``exp.output_dir``; return the report. Needs ``ray.init`` first."""
    exp.checked()
    settings = _memory_settings(exp)
    mconf = (mconf or DeploymentConfig()).replace(settings).validate()
    if not ray.is_initialized():
        raise UsageError("call ray.init() first (or use `lifemem-ray run`)", where="run_experiment")
    out = exp.output_dir
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    limits = EpisodeLimits(
        max_steps=exp.max_steps or None, step_timeout_s=exp.step_timeout_s, episode_timeout_s=exp.episode_timeout_s
    )
    episodes: list[dict[str, Any]] = []

    def record(outcome: TaskOutcome) -> None:
        row = {
            "task_id": outcome.task.id,
            "env": outcome.task.env,
            "attempts": outcome.attempts,
            "error": outcome.error,
            **outcome.summary,
        }
        row["stored"] = outcome.stored
        episodes.append(row)

    results: list[SeedResult] = []
    overlaps: dict[str, dict[str, int]] = {}
    failed: dict[str, int] = defaultdict(int)
    memory: dict[str, Any] = {}
    with RolloutPool(
        exp.workers,
        env_options=exp.env_options,
        config=mconf,
        limits=limits,
        seed=exp.seed,
        worker_cpus=exp.worker_cpus,
        max_attempts=exp.max_attempts,
        progress=progress,
        episodes_per_worker=exp.episodes_per_worker,
    ) as pool:
        for seed in exp.seed_list:
            tasks = load_tasks(exp, seed)
            _count_overlaps(overlaps, tasks.overlap)
            phases = build_stream(exp.stream, tasks.train, exp.envs, seed=seed)
            run = _SeedRun(exp, mconf, pool, seed, tasks, out, record)
            results.append(run.run(phases))
            for key, n in run.failed.items():
                failed[key] += n
            memory = run.memory_summary or memory
    modes = summarise(results, exp.modes, exp.envs, bootstrap=exp.bootstrap, seed=exp.seed)
    for mode, res in modes.items():
        res["failed_tasks"] = failed.get(mode, 0)
    report = _report(exp, mconf, settings, results, modes, overlaps, failed, memory)
    report["episodes"] = len(episodes)
    report["throughput"] = _throughput(episodes, time.perf_counter() - started)
    report["seconds"] = round(time.perf_counter() - started, 2)
    _write_outputs(out, report, episodes)
    return report


def _count_overlaps(overlaps: dict[str, dict[str, Any]], seed_overlap: dict[str, dict[str, Any]]) -> None:
    """Add one seed's train/test overlap counts per environment to the run's."""
    for env, counts in seed_overlap.items():
        slot = overlaps.setdefault(env, {"gold": 0, "goal": 0, "dropped": 0, "one_template": False})
        for key in ("gold", "goal", "dropped"):
            slot[key] += counts[key]
        slot["one_template"] = slot["one_template"] or counts["one_template"]


def _report(
    exp: ExperimentConfig,
    mconf: DeploymentConfig,
    settings: dict[str, Any],
    results: list[SeedResult],
    modes: dict[str, Any],
    overlaps: dict[str, dict[str, Any]],
    failed: dict[str, int],
    memory: dict[str, Any],
) -> dict[str, Any]:
    """The run's report: its settings, the modes' figures and the memory's summary."""
    return {
        "config": exp.to_dict(),
        "memory_config": mconf.to_dict(),
        "memory_settings": settings,
        "seeds": exp.seed_list,
        "learner": {
            "agent": exp.learner,
            "collection": "per mode: the learner reads the memory"
            if exp.learner_uses_memory
            else "collected once per seed, the same trajectories for every mode",
        },
        "overlap": overlaps,
        "modes": modes,
        "per_seed": [r.to_dict() for r in results],
        "failed_learning_tasks": failed.get("learning", 0),
        "memory": memory,
        "success_by_env": {
            mode: {env: round(v, 2) for env, v in res["table"]["rows"][-1].items()}
            for mode, res in modes.items()
            if res["table"]["rows"]
        },
    }


def _write_outputs(out: Path, report: dict[str, Any], episodes: list[dict[str, Any]]) -> None:
    """``report.json``, ``episodes.jsonl``, ``report.md`` and the plots (listed in ``report["plots"]``)."""
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    with (out / "episodes.jsonl").open("w") as fh:
        for row in episodes:
            fh.write(json.dumps(row, default=str) + "\n")
    (out / "report.md").write_text(render_markdown(report))
    report["plots"] = [str(p) for p in write_plots(report, out)]


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
