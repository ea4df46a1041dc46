"""Rollout workers: Ray actors that run environments against the shared memory.

A :class:`RolloutWorker` owns its environment instances (one per environment name,
created on first use, replaced when one hangs or fails) and its agents. For each task it
retrieves from the memory through :class:`~lifemem_ray.actors.cluster.client.MemoryClient`, runs
the episode (:func:`lifemem_ray.lab.episode.run_episode`), and, when asked to, submits the
trajectory (success or failure, with its outcome) and goes on: it hands the pool the add's
:class:`~lifemem_ray.actors.cluster.client.AddFuture`, and the pool counts the task done once
that future resolved (with the client's rules: a request whose coordinator died, or whose
worker died before the answer, is sent again; what its first attempt committed reads
``added``).

:class:`RolloutPool` drives N workers in the manner of Ray's ``ActorPool``, with the
fault handling rollouts need: a task whose worker dies, or that runs past its deadline
(the worker is then killed), is retried on a fresh worker; trajectory ids are
deterministic per (run, phase, task) so a retried task is stored once; a task that
fails ``max_attempts`` times is reported as failed, never dropped silently.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from lifemem_ray.actors.cluster import ray_metrics
from lifemem_ray.actors.cluster.client import AddFuture
from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.actors.cluster.remote_errors import actor_failures, remote_cause
from lifemem_ray.core.errors import EnvStateError, InvalidArgumentError
from lifemem_ray.engine.memory import IdConflictError
from lifemem_ray.engine.retrieval import Retrieval, RetrievedSkill, render_context
from lifemem_ray.lab.agents import Agent, make_agent
from lifemem_ray.lab.envs import Environment, Task, make_env
from lifemem_ray.lab.episode import EnvHung, EpisodeLimits, EpisodeTimeout, run_episode, trajectory_id
from lifemem_ray.lab.experiment_config import MEMORY_MODES, RETRIEVING_MODES

__all__ = ["MEMORY_MODES", "EpisodeSpec", "RolloutPool", "RolloutWorker", "TaskOutcome", "print_progress"]

log = logging.getLogger(__name__)

VECTOR_CACHE = 4096  # task embeddings a worker keeps


@dataclass(frozen=True)
class EpisodeSpec:
    """What a worker needs to run one task besides the task itself."""

    run: str  # the experiment's id: part of every trajectory id
    phase: str  # e.g. "learn-03" or "eval-03"
    mode: str = "lifemem"
    agent: str = "exemplar"
    namespace: str | None = None  # the memory deployment; None with mode "none"
    write: bool = False  # submit the trajectory to the memory (the pool waits for the ack)
    global_skill: str = ""  # mode "global-skills": the profile to show
    k: int | None = None
    seed: int | None = None  # the agents' seed (None: the worker's)
    # Environment -> the stored environment to retrieve for it ("": the best-matching one):
    # evaluation-only environments of a zero-shot transfer run.
    routes: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.mode not in MEMORY_MODES:
            raise InvalidArgumentError(f"mode: {self.mode!r} is not one of {', '.join(MEMORY_MODES)}")
        if self.mode in RETRIEVING_MODES and self.namespace is None:
            raise InvalidArgumentError(f"mode {self.mode!r} needs the memory deployment's namespace")
        if self.write and self.namespace is None:
            raise InvalidArgumentError("write=True needs the memory deployment's namespace")


@dataclass
class TaskOutcome:
    """What came back for one task (``error`` set when it failed for good)."""

    task: Task
    summary: dict[str, Any] = field(default_factory=dict)  # EpisodeResult.summary() plus worker, attempts
    trajectory: dict[str, Any] | None = None  # with return_trajectories
    stored: str | None = None  # added | duplicate | conflict-existing | None (not written)
    attempts: int = 1
    error: str | None = None

    @property
    def success(self) -> bool:
        return bool(self.summary.get("success")) and self.error is None


class RolloutWorker:
    """One worker process: environments, agents and a memory client, reused across tasks."""

    def __init__(
        self,
        worker_id: int,
        env_options: dict[str, dict[str, Any]] | None = None,
        config: DeploymentConfig | None = None,
        limits: EpisodeLimits = EpisodeLimits(),
        seed: int = 0,
        env_retries: int = 2,
    ) -> None:
        self.worker_id = worker_id
        self.env_options = env_options or {}
        self.config = config or DeploymentConfig()
        self.limits = limits
        self.seed = seed
        self.env_retries = env_retries
        self._envs: dict[str, Environment] = {}
        self._agents: dict[tuple[str, int], Agent] = {}  # (name, seed) -> agent
        self._clients: dict[str, Any] = {}
        self._vectors: OrderedDict[str, Any] = OrderedDict()  # instruction -> embedding (templated tasks repeat)
        self.env_restarts = 0

    def ping(self) -> int:
        return self.worker_id

    # -- resources ---------------------------------------------------------------------
    def _env(self, name: str) -> Environment:
        env = self._envs.get(name)
        if env is None:
            env = self._envs[name] = make_env(name, **self.env_options.get(name, {}))
        return env

    def _drop_env(self, name: str) -> None:
        """Close an environment that hung or failed, without waiting on it forever."""
        env = self._envs.pop(name, None)
        if env is None:
            return
        self.env_restarts += 1
        import threading

        threading.Thread(target=_close_quietly, args=(env,), daemon=True, name=f"close-{name}").start()

    def _agent(self, name: str, seed: int | None = None) -> Agent:
        seed = self.seed if seed is None else seed
        agent = self._agents.get((name, seed))
        if agent is None:
            agent = self._agents[(name, seed)] = make_agent(
                name,
                seed=seed,
                llm_config=self.config.llm,
                **({"metrics": ray_metrics.SINK} if name == "react" else {}),
            )
        return agent

    def _client(self, namespace: str) -> Any:
        client = self._clients.get(namespace)
        if client is None:
            from lifemem_ray.actors.cluster.client import MemoryClient

            client = self._clients[namespace] = MemoryClient.connect(namespace=namespace, config=self.config)
        return client

    def _vector(self, client: Any, text: str) -> Any:
        """The task's embedding, computed once: used for retrieval and again for the add."""
        vec = self._vectors.get(text)
        if vec is None:
            vec = self._vectors[text] = client.embed([text])[0]
            if len(self._vectors) > VECTOR_CACHE:
                self._vectors.popitem(last=False)
        else:
            self._vectors.move_to_end(text)
        return vec

    # -- one task ----------------------------------------------------------------------
    def _retriever(self, spec: EpisodeSpec) -> Callable[[Task], Retrieval | None] | None:
        """What each mode shows the agent (see :data:`lifemem_ray.lab.lifelong.MEMORY_MODES`)."""
        if spec.mode == "none":
            return None
        budget = self.config.retrieval.token_budget
        if spec.mode == "global-skills":
            skills = [RetrievedSkill(-1, spec.global_skill, 1.0)] if spec.global_skill.strip() else []

            def profile(task: Task) -> Retrieval:
                context, tokens = render_context([], skills, budget)
                return Retrieval(task.instruction, None, [], skills, context, tokens, budget)

            return profile
        client = self._client(spec.namespace)  # type: ignore[arg-type]
        if spec.mode == "trajectory":
            return lambda task: client.retrieve(
                task.instruction, None, spec.k, skills=False, vector=self._vector(client, task.instruction)
            )
        routes = dict(spec.routes)

        def same_env(task: Task) -> Retrieval:
            vector = self._vector(client, task.instruction)
            env = routes.get(task.env, task.env) or _best_matching_env(client, task.instruction, vector, spec.k)
            if env is None:  # an empty memory
                return Retrieval(task.instruction, task.env, [], [], "", 0, budget)
            hit = client.retrieve(task.instruction, env, spec.k, skills=spec.mode != "lifemem-no-skills", vector=vector)
            if spec.mode == "skills-only":
                context, tokens = render_context([], hit.skills, budget)
                return Retrieval(task.instruction, env, [], hit.skills, context, tokens, budget)
            return hit

        return same_env

    def run(self, task: Task, spec: EpisodeSpec, return_trajectory: bool = False) -> dict[str, Any]:
        """Run ``task``; a hung or failing environment is replaced and the task retried
        (up to ``env_retries`` times) before the error goes back to the pool."""
        retrieve = self._retriever(spec)
        agent = self._agent(spec.agent, spec.seed)
        tid = trajectory_id(spec.run, spec.phase, task)
        last_error: BaseException | None = None
        for attempt in range(self.env_retries + 1):
            env = self._env(task.env)
            try:
                result = run_episode(
                    env,
                    agent,
                    task,
                    retrieve=retrieve,
                    trajectory_id=tid,
                    limits=self.limits,
                    metadata={"mode": spec.mode, "phase": spec.phase, "run": spec.run, "worker": self.worker_id},
                )
                break
            except (EnvHung, EpisodeTimeout) as exc:
                last_error = exc
                log.warning(
                    "worker %d: %s; replacing environment %s (attempt %d)", self.worker_id, exc, task.env, attempt + 1
                )
                self._drop_env(task.env)
            except (ValueError, KeyError):  # bad task or agent misuse: not an environment fault
                raise
            except Exception as exc:  # noqa: BLE001 - the environment broke: replace it and retry
                last_error = exc
                log.warning(
                    "worker %d: %s failed in %s: %s: %s; replacing it",
                    self.worker_id,
                    task.id,
                    task.env,
                    type(exc).__name__,
                    exc,
                )
                self._drop_env(task.env)
        else:
            raise EnvStateError(
                f"task {task.env}/{task.id} failed {self.env_retries + 1} times with a fresh environment: {last_error}"
            )
        ack = None
        submit_s = 0.0
        if spec.write:
            # Submitted, not awaited: the pool holds the add's future and counts the task done
            # only once it resolved, while this worker already runs the next episode.
            t0 = time.perf_counter()
            client = self._client(spec.namespace)  # type: ignore[arg-type]
            traj = result.trajectory
            vector = self._vectors.get(traj.query_text)
            ack = client.add(traj, vector=vector)
            submit_s = time.perf_counter() - t0
        summary = result.summary()
        summary.update(
            worker=self.worker_id,
            submit_s=round(submit_s, 6),
            env_restarts=self.env_restarts,
            memory_s=round(result.timings["memory_s"] + submit_s, 6),
        )
        return {
            "summary": summary,
            "ack": [ack] if ack is not None else None,
            "trajectory": result.trajectory.to_dict() if return_trajectory else None,
        }

    def close(self) -> None:
        for name in list(self._envs):
            env = self._envs.pop(name)
            _close_quietly(env)
        for agent in self._agents.values():
            agent.close()
        self._agents.clear()


def _best_matching_env(client: Any, text: str, vector: Any, k: int | None) -> str | None:
    """The stored environment whose trajectories best match a task of an environment the
    memory has never seen: the one with the largest summed score among the global top-k
    (ties: the earlier hit). None for an empty memory."""
    hits = client.retrieve(text, None, k, skills=False, vector=vector).trajectories
    totals: dict[str, float] = {}
    for hit in hits:
        totals[hit.env] = totals.get(hit.env, 0.0) + max(hit.score, 0.0)
    return max(totals, key=lambda env: totals[env]) if totals else None


def _close_quietly(env: Environment) -> None:
    try:
        env.close()
    except Exception:
        log.warning("closing environment %s failed", getattr(env, "name", env), exc_info=True)


@dataclass
class _PoolRun:
    """The bookkeeping of one :meth:`RolloutPool.run`."""

    tasks: Sequence[Task]
    spec: EpisodeSpec
    return_trajectories: bool
    on_result: Callable[[TaskOutcome], None] | None
    stats: _Progress
    deadline_s: float  # a task running longer than this on a worker is stuck: the worker is replaced
    queue: deque = field(default_factory=deque)  # (task index, attempt) still to hand out
    results: list = field(default_factory=list)  # per task: its TaskOutcome once done
    free: list[int] = field(default_factory=list)  # idle workers
    inflight: dict = field(default_factory=dict)  # ref -> (task index, attempt, worker index, deadline)
    acks: list = field(default_factory=list)  # (AddFuture of the task's add, task index, attempt, outcome, sent)

    def __post_init__(self) -> None:
        self.queue = deque((i, 1) for i in range(len(self.tasks)))
        self.results = [None] * len(self.tasks)


class RolloutPool:
    """N :class:`RolloutWorker` actors, each with at most one task in flight."""

    def __init__(
        self,
        workers: int,
        *,
        env_options: dict[str, dict[str, Any]] | None = None,
        config: DeploymentConfig | None = None,
        limits: EpisodeLimits = EpisodeLimits(),
        seed: int = 0,
        worker_cpus: float = 0.5,
        max_attempts: int = 3,
        progress: Callable[[dict[str, Any]], None] | None = None,
        progress_every_s: float = 2.0,
    ) -> None:
        if workers < 1:
            raise InvalidArgumentError(f"workers: must be >= 1, got {workers}")
        if max_attempts < 1:
            raise InvalidArgumentError(f"max_attempts: must be >= 1, got {max_attempts}")
        self.size = workers
        self._args = (env_options or {}, config or DeploymentConfig(), limits, seed)
        self.worker_cpus = worker_cpus
        self.max_attempts = max_attempts
        self.limits = limits
        self.progress = progress
        self.progress_every_s = progress_every_s
        self._next_id = 0
        self.workers = [self._start_worker() for _ in range(workers)]
        ray.get([w.ping.remote() for w in self.workers])
        self.replaced = 0

    def _start_worker(self) -> Any:
        env_options, config, limits, seed = self._args
        worker_id = self._next_id
        self._next_id += 1
        return (
            ray.remote(RolloutWorker)
            .options(num_cpus=self.worker_cpus, max_restarts=0)
            .remote(worker_id, env_options, config, limits, seed)
        )

    def _replace(self, index: int) -> None:
        try:
            ray.kill(self.workers[index], no_restart=True)
        except Exception:  # noqa: BLE001, S110 - already dead or gone: a fresh one replaces it anyway
            pass
        self.workers[index] = self._start_worker()
        self.replaced += 1

    def run(
        self,
        tasks: Sequence[Task],
        spec: EpisodeSpec,
        *,
        return_trajectories: bool = False,
        on_result: Callable[[TaskOutcome], None] | None = None,
    ) -> list[TaskOutcome]:
        """Run every task (results in the order of ``tasks``). Tasks are handed out in
        order, so a stream's order holds up to the pool's width."""
        st = _PoolRun(
            tasks,
            spec,
            return_trajectories,
            on_result,
            _Progress(len(tasks), spec.phase),
            deadline_s=self.limits.episode_timeout_s * 1.5 + 60.0,
        )  # past the worker's own limits: it is stuck
        st.free = list(range(self.size))
        last_report = time.monotonic()
        while st.queue or st.inflight or st.acks:
            while st.queue and st.free:
                i, attempt = st.queue.popleft()
                w = st.free.pop()
                ref = self.workers[w].run.remote(tasks[i], spec, return_trajectories)
                st.inflight[ref] = (i, attempt, w, time.monotonic() + st.deadline_s)
            idle = not st.inflight  # only adds to wait for: wait on them instead
            ready, _ = ray.wait(list(st.inflight), num_returns=1, timeout=0.5) if st.inflight else ([], [])
            for ref in ready:
                self._collect(st, ref)
            self._settle_acks(st, wait_s=0.5 if idle else 0.0)
            now = time.monotonic()
            self._replace_stuck(st, now)
            if self.progress is not None and (
                now - last_report >= self.progress_every_s or not (st.queue or st.inflight or st.acks)
            ):
                self.progress(st.stats.snapshot())
                last_report = now
        return [r for r in st.results if r is not None]

    def _collect(self, st: _PoolRun, ref: Any) -> None:
        """One worker's answer: a result (waiting for the memory's acknowledgement when it
        wrote), a retry, or a failure."""
        i, attempt, w, _ = st.inflight.pop(ref)
        task = st.tasks[i]
        try:
            out = ray.get(ref)
        except actor_failures() as exc:
            log.warning("rollout worker died on task %s (attempt %d): %s", task.id, attempt, type(exc).__name__)
            self._replace(w)
            st.free.append(w)
            self._retry_or_fail(
                st.queue, st.results, st.tasks, i, attempt, f"worker died: {type(exc).__name__}", st.stats, st.on_result
            )
            return
        except ray.exceptions.RayTaskError as exc:
            cause = remote_cause(exc)
            st.free.append(w)
            if isinstance(cause, (ValueError, KeyError)):  # not transient: no retry
                self._finish(
                    st.results,
                    TaskOutcome(task, attempts=attempt, error=f"{type(cause).__name__}: {cause}"),
                    i,
                    st.stats,
                    st.on_result,
                )
            else:
                self._retry_or_fail(
                    st.queue,
                    st.results,
                    st.tasks,
                    i,
                    attempt,
                    f"{type(cause).__name__}: {cause}",
                    st.stats,
                    st.on_result,
                )
            return
        st.free.append(w)
        outcome = TaskOutcome(task, out["summary"], out["trajectory"], None, attempt)
        outcome.summary["attempts"] = attempt
        if out["ack"]:
            st.acks.append((out["ack"][0], i, attempt, outcome, time.monotonic()))
        else:
            self._finish(st.results, outcome, i, st.stats, st.on_result)

    def _settle_acks(self, st: _PoolRun, wait_s: float = 0.0) -> None:
        """Tasks whose add resolved are done (``wait_s``: how long to wait for one when none
        did). The outcome is the add's future's (:meth:`AddFuture.poll`); a task whose
        trajectory was not stored is retried, as any failed attempt."""
        if not st.acks:
            return
        moving = {id(f) for f in AddFuture.ready([entry[0] for entry in st.acks], wait_s)}
        for entry in [e for e in st.acks if id(e[0]) in moving]:
            future, i, attempt, outcome, submitted = entry
            why = None  # set when the trajectory was not stored
            try:
                result = future.poll()
                if result is None:  # sent again (its coordinator, or its worker, died): not yet
                    continue
                outcome.stored = result.status
            except IdConflictError:
                # An earlier attempt of this task stored a different run of it (its worker
                # died after the commit): the memory keeps the first, as promised.
                outcome.stored = "conflict-existing"
            except actor_failures(ray.exceptions.OwnerDiedError) as exc:
                # No answer after the future's resends: unknown whether it was stored; the
                # retry has the same id, so at most once.
                why = f"acknowledgement lost: {type(exc).__name__}"
            except Exception as exc:  # noqa: BLE001 - the memory refused it (a shard down, overload...): retried
                why = f"not stored: {type(exc).__name__}: {exc}"
            st.acks.remove(entry)
            if why is not None:
                self._retry_or_fail(st.queue, st.results, st.tasks, i, attempt, why, st.stats, st.on_result)
                continue
            outcome.summary["ack_s"] = round(time.monotonic() - submitted, 6)
            self._finish(st.results, outcome, i, st.stats, st.on_result)

    def _replace_stuck(self, st: _PoolRun, now: float) -> None:
        for ref, (i, attempt, w, deadline) in list(st.inflight.items()):
            if now > deadline:  # hung beyond the worker's own limits: kill it
                del st.inflight[ref]
                log.warning(
                    "rollout worker %d stuck on task %s for %.0f s: replacing it", w, st.tasks[i].id, st.deadline_s
                )
                self._replace(w)
                st.free.append(w)
                self._retry_or_fail(
                    st.queue,
                    st.results,
                    st.tasks,
                    i,
                    attempt,
                    f"worker stuck past {st.deadline_s:.0f} s",
                    st.stats,
                    st.on_result,
                )

    def _retry_or_fail(
        self,
        queue: deque,
        results: list,
        tasks: Sequence[Task],
        i: int,
        attempt: int,
        why: str,
        stats: _Progress,
        on_result: Callable[[TaskOutcome], None] | None,
    ) -> None:
        if attempt < self.max_attempts:
            stats.retries += 1
            queue.appendleft((i, attempt + 1))
        else:
            self._finish(
                results,
                TaskOutcome(tasks[i], attempts=attempt, error=f"failed {attempt} times; last: {why}"),
                i,
                stats,
                on_result,
            )

    @staticmethod
    def _finish(
        results: list, outcome: TaskOutcome, i: int, stats: _Progress, on_result: Callable[[TaskOutcome], None] | None
    ) -> None:
        results[i] = outcome
        stats.add(outcome)
        if on_result is not None:
            on_result(outcome)

    def close(self) -> None:
        refs = [w.close.remote() for w in self.workers]
        try:
            ray.get(refs, timeout=60)
        except Exception:
            log.warning("some rollout workers did not close cleanly", exc_info=True)
        for w in self.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:  # noqa: BLE001, S110 - already dead or gone: closing goes on
                pass
        self.workers = []

    def __enter__(self) -> RolloutPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Progress:
    """Live counters of one pool run."""

    def __init__(self, total: int, phase: str) -> None:
        self.total = total
        self.phase = phase
        self.started = time.monotonic()
        self.done = self.success = self.failed = self.steps = self.retries = 0
        self.memory_s: list[float] = []

    def add(self, outcome: TaskOutcome) -> None:
        self.done += 1
        if outcome.error is not None:
            self.failed += 1
            return
        self.success += int(bool(outcome.summary.get("success")))
        self.steps += int(outcome.summary.get("steps", 0))
        self.memory_s.append(float(outcome.summary.get("memory_s", 0.0)))

    def snapshot(self) -> dict[str, Any]:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        lat = sorted(self.memory_s)
        ok = self.done - self.failed
        return {
            "phase": self.phase,
            "episodes": self.done,
            "total": self.total,
            "success_rate": self.success / ok if ok else 0.0,
            "failed": self.failed,
            "retries": self.retries,
            "episodes_per_s": self.done / elapsed,
            "steps_per_s": self.steps / elapsed,
            "memory_p50_ms": 1000 * lat[len(lat) // 2] if lat else 0.0,
            "memory_p99_ms": 1000 * lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else 0.0,
        }


def print_progress(snapshot: dict[str, Any], stream: Any = None) -> None:
    """A one-line live report on stderr (overwritten in place on a terminal)."""
    stream = stream or sys.stderr
    line = (
        f"[{snapshot['phase']}] {snapshot['episodes']}/{snapshot['total']} episodes, success {100 * snapshot['success_rate']:.0f}%, "
        f"{snapshot['steps_per_s']:.0f} steps/s, memory p50 {snapshot['memory_p50_ms']:.1f} ms"
        + (f", {snapshot['failed']} failed" if snapshot["failed"] else "")
        + (f", {snapshot['retries']} retried" if snapshot["retries"] else "")
    )
    end = "\r" if stream.isatty() and snapshot["episodes"] < snapshot["total"] else "\n"
    print(line.ljust(100), end=end, file=stream, flush=True)
