"""Labelled trajectories from the installed real environments, played by their gold agents.

Clustering and skill quality can only be judged against ground truth the clusterer never
sees. Each environment here has labels of its own tasks, from its package: ScienceWorld's
task kind and the topic its id numbers it under (``4-2`` is topic 4, classification);
ALFWorld's six task types; TextWorldExpress's game; the SQL environment's query kind;
BFCL's and tau2's task categories. Labels go into ``metadata["labels"]`` as
``{level: value}``, finest level first (:data:`LABEL_LEVELS`); the last level is the
coarsest (*topic*).

Two folds, drawn from disjoint parts of every environment, so that what is tuned on one is
reported on the other:

* ``tune``: the environments' train folds (ScienceWorld train variations, TextWorldExpress
  train seeds, ALFWorld valid_train + valid_seen, SQL train instances, the train halves of
  BFCL and tau2);
* ``report``: their test folds (ScienceWorld test variations, TextWorldExpress test seeds,
  ALFWorld valid_unseen, SQL test instances, the test halves of BFCL and tau2).

Episodes run in worker processes (``spawn``), one environment instance each; a worker whose
episode runs past the time limit (ALFWorld's planner takes minutes on a few games) is killed
and replaced, and the task is counted as skipped, never silently dropped.

Example (needs the environment packages: docs/experiments.md, "Environments"):

>>> from lifemem_ray.lab.datasets import default_sources, generate  # doctest: +SKIP
>>> result = generate(default_sources(scale=0.1), "report", workers=2)  # doctest: +SKIP
>>> result.trajectories[0].metadata["labels"]  # doctest: +SKIP
{'task_type': 'find-animal', 'topic': '4-classification'}
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import multiprocessing
import multiprocessing.connection
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, cast

from lifemem_ray.core.errors import InvalidArgumentError, UnknownNameError
from lifemem_ray.core.model import Trajectory

__all__ = [
    "FOLDS",
    "LABEL_LEVELS",
    "GenerationResult",
    "Source",
    "default_sources",
    "generate",
    "label_of",
    "load_set",
    "save_set",
]

FOLDS = {"tune": "train", "report": "test"}  # our fold -> the environments' split

# Label levels of each memory environment, finest first; the last one is the topic level.
LABEL_LEVELS: dict[str, tuple[str, ...]] = {
    "scienceworld": ("task_type", "topic"),
    "twx": ("game",),
    "alfworld": ("task_type",),
    "sql": ("task_type",),
    "bfcl": ("task_type",),
    "tau2-retail": ("task_type",),
    "tau2-airline": ("task_type",),
    "fever": ("task_type",),  # the claim's label
    "webshop": ("product_type", "task_type"),  # 30 product types under WebShop's 5 categories
    "mind2web": ("subdomain", "task_type"),  # Mind2Web's subdomains under its domains
}

# ScienceWorld numbers its 30 task kinds under 10 topics (``scienceworld.constants.ID2TASK``).
_SW_TOPIC_NAMES = {
    "1": "matter", "2": "measurement", "3": "electricity", "4": "classification", "5": "biology-growth",
    "6": "chemistry", "7": "biology-lifespan", "8": "biology-life-stages", "9": "forces", "10": "genetics",
}  # fmt: skip

MAX_EPISODE_S = 120.0  # an episode (gold plan included) past this is abandoned and its worker replaced


@dataclass(frozen=True)
class Source:
    """One environment adapter feeding one memory environment.

    ``env`` is the memory's environment name: the eight TextWorldExpress games are one
    environment (``twx``), so the clusterer has to tell them apart. ``limit`` caps the
    tasks taken from each fold (the environment's own order, seeded by ``seed``).
    """

    env: str
    adapter: str
    options: dict[str, Any] = field(default_factory=dict)
    limit: int | None = None
    seed: int = 1

    @property
    def levels(self) -> tuple[str, ...]:
        return LABEL_LEVELS[self.env]


def default_sources(scale: float = 1.0) -> list[Source]:
    """The sources of the cluster-quality benchmark; ``scale`` multiplies every task count.

    At ``scale=1`` a fold holds 3,000 trajectories or more: ScienceWorld up to 20 variations of
    each of its 30 kinds (about 460-600: some kinds have few), TextWorldExpress 200 games of
    each of its 8 kinds, ALFWorld up to 190 games (its unseen fold has 134 solvable), SQL 650
    tasks, BFCL 100, tau2 retail 57 and airline 25, FEVER 100 claims (the test split's all),
    WebShop 200 goals and Mind2Web 190 steps (its unseen websites' all).
    """
    if not 0 < scale <= 10:
        raise InvalidArgumentError(f"must be in (0, 10], got {scale!r}", where="scale")

    def n(count: int) -> int:
        return max(1, round(count * scale))

    from lifemem_ray.lab.envs.twx import VARIANTS

    sources: list[Source] = []
    for kind in _scienceworld_kinds():
        # Every variation of the fold, shuffled by the source's seed; the first ``limit`` are played.
        sources.append(
            Source(
                "scienceworld",
                "scienceworld",
                {
                    "task_names": [kind],
                    "max_steps": 300,
                    "variations_per_task_train": None,
                    "variations_per_task_test": None,
                },
                limit=n(20),
            )
        )
    for game in VARIANTS:
        sources.append(Source("twx", f"twx-{game}", {"n_train": n(200), "n_test": n(200)}, limit=n(200)))
    sources.append(Source("alfworld", "alfworld", {}, limit=n(190)))
    sources.append(Source("sql", "sql", {"n_train": n(650), "n_test": n(650)}, limit=n(650)))
    sources.append(Source("bfcl", "bfcl", {"train_fraction": 0.5}, limit=n(100)))
    sources.append(Source("tau2-retail", "tau2-retail", {"train_fraction": 0.5}, limit=n(57)))
    sources.append(Source("tau2-airline", "tau2-airline", {"train_fraction": 0.5}, limit=n(25)))
    sources.append(Source("fever", "fever", {}, limit=n(100)))
    sources.append(Source("webshop", "webshop", {}, limit=n(200)))
    sources.append(Source("mind2web", "mind2web", {}, limit=n(190)))
    return sources


def _scienceworld_kinds() -> list[str]:
    try:
        from scienceworld.constants import ID2TASK
    except ImportError:
        return []
    return list(ID2TASK.values())


def scienceworld_topic(kind: str) -> str:
    """``4-classification`` for ``find-animal``: the topic ScienceWorld numbers the kind under."""
    from scienceworld.constants import ID2TASK

    for task_id, name in ID2TASK.items():
        if name == kind:
            topic = task_id.split("-", 1)[0]
            return f"{topic}-{_SW_TOPIC_NAMES.get(topic, 'topic')}"
    raise UnknownNameError(f"unknown task kind {kind!r}", where="scienceworld")


def _labels(source: Source, metadata: dict[str, Any]) -> dict[str, str]:
    kind = str(metadata.get("task_type", "unknown"))
    if source.env == "scienceworld":
        return {"task_type": kind, "topic": scienceworld_topic(kind)}
    if source.env == "twx":
        return {"game": source.adapter.removeprefix("twx-")}
    finer = {"webshop": "product_type", "mind2web": "subdomain"}.get(source.env)
    if finer is not None:
        return {finer: str(metadata.get(finer, "unknown")), "task_type": kind}
    return {"task_type": kind}


def label_of(trajectory: Trajectory, level: str) -> str | None:
    """The trajectory's label at ``level`` (None when it has none)."""
    labels = trajectory.metadata.get("labels")
    return labels.get(level) if isinstance(labels, dict) else None


# --------------------------------------------------------------------------- generation


@dataclass
class GenerationResult:
    """What a fold's generation produced, and what it could not."""

    trajectories: list[Trajectory]
    skipped: Counter = field(default_factory=Counter)  # "env: reason" -> tasks
    unavailable: dict[str, str] = field(default_factory=dict)  # adapter -> why it did not run
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        per_env: Counter = Counter(t.env for t in self.trajectories)
        return {
            "trajectories": len(self.trajectories),
            "per_env": dict(sorted(per_env.items())),
            "successes": sum(1 for t in self.trajectories if t.outcome.success),
            "skipped": dict(self.skipped),
            "unavailable": dict(self.unavailable),
            "seconds": round(self.seconds, 1),
        }


@dataclass(frozen=True)
class _Job:
    source: Source
    fold: str
    agent: str
    noise: float
    timeout_s: float
    positions: tuple[int, ...] | None = None  # task positions to play (None: all the fold lists)


def generate(
    sources: Sequence[Source],
    fold: str,
    *,
    workers: int = 2,
    agent: str = "noisy-gold",
    noise: float = 0.05,
    episode_timeout_s: float = MAX_EPISODE_S,
    progress: Callable[[int], None] | None = None,
) -> GenerationResult:
    """Play every source's tasks of ``fold`` with the gold agent (``noise``: the share of
    steps where the noisy-gold agent takes a random valid action instead, which gives
    failures) and return the labelled trajectories, in the sources' order."""
    if fold not in FOLDS:
        raise InvalidArgumentError(f"expected one of {', '.join(FOLDS)}, got {fold!r}", where="fold")
    if not 1 <= workers <= 64:
        raise InvalidArgumentError(f"must be in [1, 64], got {workers!r}", where="workers")
    if not 0.0 <= noise <= 1.0:
        raise InvalidArgumentError(f"must be in [0, 1], got {noise!r}", where="noise")
    if not 0.0 < episode_timeout_s <= 3600.0:
        raise InvalidArgumentError(f"must be in (0, 3600], got {episode_timeout_s!r}", where="episode_timeout_s")
    started = time.perf_counter()
    jobs = [_Job(s, fold, agent, noise, episode_timeout_s) for s in sources]
    result = GenerationResult(trajectories=[])
    done: dict[int, list[Trajectory]] = {}
    _run_jobs(jobs, workers, episode_timeout_s, done, result, progress)
    for j in range(len(jobs)):
        result.trajectories.extend(done.get(j, []))
    result.seconds = time.perf_counter() - started
    return result


def _run_jobs(
    jobs: list[_Job],
    workers: int,
    timeout_s: float,
    done: dict[int, list[Trajectory]],
    result: GenerationResult,
    progress: Callable[[int], None] | None,
) -> None:
    """Keep up to ``workers`` processes busy, one job each; replace a worker whose episode
    overruns ``timeout_s`` and go on with the rest of its job.

    Each worker writes to a pipe of its own, synchronously: a message is in the pipe before
    the worker goes on, so a worker that dies (``os._exit``, a segfault) loses nothing it
    reported, and the end of its pipe tells the parent it has read everything."""
    ctx = multiprocessing.get_context("spawn")
    waiting = list(range(len(jobs)))
    running: dict[int, _Running] = {}
    remaining: dict[int, list[int] | None] = {j: None for j in waiting}  # positions still to play (None: unknown yet)
    while waiting or running:
        while waiting and len(running) < workers:
            j = waiting.pop(0)
            left = remaining[j]
            job = jobs[j] if left is None else dataclasses.replace(jobs[j], positions=tuple(left))
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_worker, args=(j, job, writer), daemon=True)
            proc.start()
            writer.close()  # the child holds the only write end: its exit ends the pipe
            running[j] = _Running(proc, job, reader, time.monotonic())
        ended: list[int] = []
        by_reader = {r.reader: j for j, r in running.items()}
        # wait() returns some of the readers it was given (typeshed: any waitable object).
        ready = cast("list[Connection]", multiprocessing.connection.wait(list(by_reader), timeout=1.0))
        for reader in ready:
            j = by_reader[reader]
            try:
                msg = reader.recv()
            except (EOFError, OSError):
                ended.append(j)
                continue
            _handle(msg, jobs, running, remaining, done, result, progress)
        now = time.monotonic()
        for j, run in list(running.items()):
            overdue = (
                run.position is not None and now - run.heard > timeout_s + 30
            )  # the worker's own limit did not fire
            if j not in ended and not overdue:
                continue
            if overdue:
                run.proc.kill()
            run.proc.join(5)
            run.reader.close()
            del running[j]
            left = remaining[j]
            if left is None:  # it never listed its tasks
                result.unavailable[run.job.source.adapter] = (
                    f"the worker process exited with code {run.proc.exitcode} before it listed its tasks"
                )
                continue
            if run.position is not None:  # killed, or crashed, in the middle of an episode
                why = f"episode over {timeout_s:g} s" if overdue else f"worker crashed (exit code {run.proc.exitcode})"
                result.skipped[f"{run.job.source.env}: {why}"] += 1
                remaining[j] = [p for p in left if p != run.position]
            if remaining[j]:
                waiting.append(j)


@dataclass
class _Running:
    """A worker process at work on a job."""

    proc: Any
    job: _Job
    reader: Any  # the read end of the worker's pipe
    heard: float  # monotonic time of its last message
    position: int | None = None  # the task position of the episode it is playing (None: between episodes)


def _handle(
    msg: tuple,
    jobs: list[_Job],
    running: dict[int, _Running],
    remaining: dict,
    done: dict,
    result: GenerationResult,
    progress: Callable[[int], None] | None,
) -> None:
    kind, j = msg[0], msg[1]
    run = running.get(j)
    if run is not None:
        run.heard = time.monotonic()
    if kind == "positions":
        remaining[j] = list(msg[2])
    elif kind == "start":
        if run is not None:
            run.position = msg[2]
    elif kind in ("done", "skip"):
        position = msg[2]
        if remaining[j] is not None:
            remaining[j] = [p for p in remaining[j] if p != position]
        if kind == "done":
            done.setdefault(j, []).append(Trajectory.from_dict(msg[3]))
            if progress is not None:
                progress(1)
        else:
            result.skipped[f"{jobs[j].source.env}: {msg[3]}"] += 1
        if run is not None:
            run.position = None
    elif kind == "unavailable":
        result.unavailable[jobs[j].source.adapter] = msg[2]
        remaining[j] = []
    elif kind == "end":
        remaining[j] = []


def _worker(j: int, job: _Job, messages: Any) -> None:
    """Play a job's tasks in this process; report each episode as it ends (``messages``: the
    write end of this worker's pipe; ``send`` returns once the message is in the pipe)."""
    from lifemem_ray.lab.agents import make_agent
    from lifemem_ray.lab.envs import make_env
    from lifemem_ray.lab.episode import EnvHung, EpisodeLimits, EpisodeTimeout, run_episode

    source = job.source
    split = FOLDS[job.fold]
    try:
        env = make_env(source.adapter, **source.options)
        tasks = env.tasks(split, limit=source.limit, seed=source.seed)
    except Exception as exc:  # noqa: BLE001 - a missing package, Java or data: the report names it
        messages.send(("unavailable", j, f"{type(exc).__name__}: {exc}"[:500]))
        return
    positions = list(range(len(tasks))) if job.positions is None else list(job.positions)
    messages.send(("positions", j, positions))
    agent = make_agent(job.agent, seed=source.seed, **({"epsilon": job.noise} if job.agent == "noisy-gold" else {}))
    limits = EpisodeLimits(step_timeout_s=job.timeout_s, episode_timeout_s=job.timeout_s)
    for position in positions:
        task = tasks[position]
        messages.send(("start", j, position))
        try:
            episode = run_episode(
                env, agent, task, trajectory_id=f"{job.fold}/{source.adapter}/{task.id}", limits=limits
            )
        except (EpisodeTimeout, EnvHung):
            # A helper thread may still run inside the environment (a planner, a hung call), and
            # closing it could block: leave at once; the parent goes on in a fresh process.
            messages.send(("skip", j, position, f"episode over {job.timeout_s:g} s"))
            os._exit(3)
        except Exception as exc:  # noqa: BLE001 - the environment refused the task: counted, not hidden
            messages.send(("skip", j, position, f"{type(exc).__name__}"))
            continue
        traj = episode.trajectory
        meta = {
            **traj.metadata,
            "labels": _labels(source, {**task.metadata, **traj.metadata}),  # the task says the finer levels
            "source_env": source.adapter,
            "fold": job.fold,
        }
        meta.pop("timings", None)
        labelled = dataclasses.replace(traj, env=source.env, metadata=meta)
        messages.send(("done", j, position, labelled.to_dict()))
    messages.send(("end", j))
    env.close()


# --------------------------------------------------------------------------- files


def save_set(path: str | os.PathLike[str], trajectories: Iterable[Trajectory], meta: dict[str, Any]) -> int:
    """Write native JSONL (gzip) and ``<path>.meta.json``; atomically, so a crash leaves the old set."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    n = 0
    with gzip.open(tmp, "wt", encoding="utf-8") as fh:
        for traj in trajectories:
            fh.write(json.dumps(traj.to_dict(), ensure_ascii=False) + "\n")
            n += 1
    meta_path = path.with_name(path.name + ".meta.json")
    meta_tmp = meta_path.with_name(meta_path.name + ".tmp")
    meta_tmp.write_text(json.dumps({**meta, "trajectories": n}, indent=2, sort_keys=True))
    os.replace(tmp, path)
    os.replace(meta_tmp, meta_path)
    return n


def load_set(path: str | os.PathLike[str]) -> tuple[list[Trajectory], dict[str, Any]]:
    """A set written by :func:`save_set`: its trajectories and its meta data."""
    from lifemem_ray.core.importers import iter_jsonl

    path = Path(path)
    meta_path = path.with_name(path.name + ".meta.json")
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    return list(iter_jsonl(path, fmt="native")), meta
