"""Rollout workers: Ray actors that run environments against the shared memory.

A :class:`RolloutWorker` owns its environment instances (one per environment name,
created on first use, replaced when one hangs or fails) and its agents. For each task it
retrieves from the memory through :class:`~lifemem_ray.actors.client.blocking.MemoryClient`, runs
the episode (:func:`lifemem_ray.lab.episode.run_episode`), and, when asked to, submits the
trajectory (success or failure, with its outcome) and goes on: it hands the pool the add's
:class:`~lifemem_ray.actors.client.blocking.AddFuture`, and the pool counts the task done once
that future resolved (with the client's rules: a request whose coordinator died, or whose
worker died before the answer, is sent again; what its first attempt committed reads
``added``).

:class:`RolloutPool` drives N workers in the manner of Ray's ``ActorPool``, with the
fault handling rollouts need: a task whose worker dies, or that runs past its deadline
(the worker is then killed), is retried on a fresh worker; trajectory ids are
deterministic per (run, phase, task) so a retried task is stored once; a task that
fails ``max_attempts`` times is reported as failed, never dropped silently.

With ``episodes_per_worker`` > 1 the pool starts
:class:`~lifemem_ray.actors.rollout.async_worker.AsyncRolloutWorker` actors instead, and
keeps up to that many tasks in flight on each: one worker process then drives dozens of
episodes at once against an LLM server. Such a worker awaits each add's acknowledgement
itself before it answers for the task; the pool reads what it found, with the same rules.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from lifemem_ray.actors.client.blocking import AddFuture
from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.actors.cluster.remote_errors import actor_failures, remote_cause
from lifemem_ray.actors.rollout.async_worker import AsyncRolloutWorker
from lifemem_ray.actors.rollout.worker_base import (
    MAX_EPISODES_PER_WORKER,
    EpisodeSpec,
    RolloutWorkerBase,
    add_failure,
    best_env,
    close_quietly,
    global_profile,
    shaped,
)
from lifemem_ray.core.errors import InvalidArgumentError
from lifemem_ray.engine.retrieval import Retrieval
from lifemem_ray.lab.agents import Agent
from lifemem_ray.lab.envs import Environment, Task
from lifemem_ray.lab.episode import EpisodeLimits, run_episode, trajectory_id
from lifemem_ray.lab.experiment_config import MEMORY_MODES

__all__ = ["MEMORY_MODES", "EpisodeSpec", "RolloutPool", "RolloutWorker", "TaskOutcome", "print_progress"]

log = logging.getLogger(__name__)


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


class RolloutWorker(RolloutWorkerBase):
    """One worker process: environments, agents and a memory client, reused across tasks;
    one episode at a time."""

    def __init__(
        self,
        worker_id: int,
        env_options: dict[str, dict[str, Any]] | None = None,
        config: DeploymentConfig | None = None,
        limits: EpisodeLimits = EpisodeLimits(),
        seed: int = 0,
        env_retries: int = 2,
    ) -> None:
        super().__init__(worker_id, env_options, config, limits, seed, env_retries)
        self._envs: dict[str, Environment] = {}
        self._agents: dict[tuple[str, int], Agent] = {}  # (name, seed) -> agent
        self._clients: dict[str, Any] = {}

    def ping(self) -> int:
        return self.worker_id

    # -- resources ---------------------------------------------------------------------
    def _env(self, name: str) -> Environment:
        env = self._envs.get(name)
        if env is None:
            env = self._envs[name] = self._new_env(name)
        return env

    def _drop_env(self, name: str) -> None:
        env = self._envs.pop(name, None)
        if env is not None:
            self._abandon_env(env)

    def _agent(self, name: str, seed: int | None = None) -> Agent:
        seed = self.seed if seed is None else seed
        agent = self._agents.get((name, seed))
        if agent is None:
            agent = self._agents[(name, seed)] = self._new_agent(name, seed)
        return agent

    def _client(self, namespace: str) -> Any:
        """This worker's client of the deployment in ``namespace`` (it connects at its first
        call, and again after the deployment went away: the client's own rule)."""
        client = self._clients.get(namespace)
        if client is None:
            from lifemem_ray.actors.client.blocking import MemoryClient

            client = self._clients[namespace] = MemoryClient(namespace, self.config)
        return client

    # -- one task ----------------------------------------------------------------------
    def _retriever(self, spec: EpisodeSpec) -> Callable[[Task], Retrieval | None] | None:
        """What each mode shows the agent (see :data:`lifemem_ray.lab.lifelong.MEMORY_MODES`)."""
        if spec.mode == "none":
            return None
        budget = self.config.retrieval.token_budget
        if spec.mode == "global-skills":
            return global_profile(spec, budget)
        client = self._client(spec.namespace)  # type: ignore[arg-type]
        if spec.mode == "trajectory":
            return lambda task: client.retrieve(task.instruction, None, spec.k, skills=False)
        routes = dict(spec.routes)

        def same_env(task: Task) -> Retrieval:
            # The task's vector is embedded once: the client's cache serves the second retrieve
            # and the add after the episode (templated tasks repeat).
            env: str | None = routes.get(task.env, task.env)
            if not env:
                env = best_env(client.retrieve(task.instruction, None, spec.k, skills=False))
            if env is None:  # an empty memory
                return Retrieval(task.instruction, task.env, [], [], "", 0, budget)
            hit = client.retrieve(task.instruction, env, spec.k, skills=spec.mode != "lifemem-no-skills")
            return shaped(spec, hit, env, budget)

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
                    metadata=self._metadata(spec),
                )
                break
            except Exception as exc:  # sorted by _env_fault: the environment's faults are retried
                if not self._env_fault(exc, task, attempt):
                    raise
                last_error = exc
                self._drop_env(task.env)
        else:
            raise self._gave_up(task, last_error)
        ack = None
        submit_s = 0.0
        if spec.write:
            # Submitted, not awaited: the pool holds the add's future and counts the task done
            # only once it resolved, while this worker already runs the next episode.
            t0 = time.perf_counter()
            client = self._client(spec.namespace)  # type: ignore[arg-type]
            ack = client.add(result.trajectory)  # with the task's vector when the client holds it
            submit_s = time.perf_counter() - t0
        reply = self._reply(result, submit_s, return_trajectory)
        reply["ack"] = [ack] if ack is not None else None
        return reply

    def close(self) -> None:
        for name in list(self._envs):
            env = self._envs.pop(name)
            close_quietly(env)
        for agent in self._agents.values():
            agent.close()
        self._agents.clear()


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
    free: list[int] = field(default_factory=list)  # free slots: a worker index once per task it can take
    inflight: dict = field(default_factory=dict)  # ref -> (task index, attempt, worker index, deadline, handle)
    acks: list = field(default_factory=list)  # (AddFuture of the task's add, task index, attempt, outcome, sent)

    def __post_init__(self) -> None:
        self.queue = deque((i, 1) for i in range(len(self.tasks)))
        self.results = [None] * len(self.tasks)


class RolloutPool:
    """N worker actors, each running at most ``episodes_per_worker`` episodes at once: a
    :class:`RolloutWorker` each with 1 (the default, one task in flight), an
    :class:`~lifemem_ray.actors.rollout.async_worker.AsyncRolloutWorker` each above (twice
    that many tasks in flight: the second half waits in the worker for a slot).

    A worker that dies, or is killed for a stuck task, takes its other tasks in flight with
    it: each is retried on the fresh worker, as an attempt of its own."""

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
        episodes_per_worker: int = 1,
    ) -> None:
        if workers < 1:
            raise InvalidArgumentError(f"must be >= 1, got {workers}", where="workers")
        if not 1 <= episodes_per_worker <= MAX_EPISODES_PER_WORKER:
            raise InvalidArgumentError(
                f"must be within [1, {MAX_EPISODES_PER_WORKER}], got {episodes_per_worker}",
                where="episodes_per_worker",
            )
        if max_attempts < 1:
            raise InvalidArgumentError(f"must be >= 1, got {max_attempts}", where="max_attempts")
        self.size = workers
        self._args = (env_options or {}, config or DeploymentConfig(), limits, seed)
        self.worker_cpus = worker_cpus
        self.max_attempts = max_attempts
        self.limits = limits
        self.progress = progress
        self.progress_every_s = progress_every_s
        self.episodes_per_worker = episodes_per_worker
        # Tasks in flight per worker: an async worker gets as many again as it runs, which wait
        # for an episode slot with their task's embedding already computed (and an episode
        # awaiting its add's acknowledgement no longer holds a slot).
        self.width = 1 if episodes_per_worker == 1 else 2 * episodes_per_worker
        self._next_id = 0
        self.workers = [self._start_worker() for _ in range(workers)]
        ray.get([w.ping.remote() for w in self.workers])
        self.replaced = 0

    def _start_worker(self) -> Any:
        env_options, config, limits, seed = self._args
        worker_id = self._next_id
        self._next_id += 1
        if self.episodes_per_worker == 1:
            return (
                ray.remote(RolloutWorker)
                .options(num_cpus=self.worker_cpus, max_restarts=0)
                .remote(worker_id, env_options, config, limits, seed)
            )
        return (
            ray.remote(AsyncRolloutWorker)
            .options(num_cpus=self.worker_cpus, max_restarts=0, max_concurrency=self.width + 1)
            .remote(worker_id, env_options, config, limits, seed, episodes=self.episodes_per_worker)
        )

    def _replace(self, index: int, handle: Any) -> None:
        """A fresh worker in place of ``handle`` (nothing when it was already replaced: its
        other tasks in flight fail the same way, each once)."""
        if self.workers[index] is not handle:
            return
        try:
            ray.kill(handle, no_restart=True)
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
            # Past the worker's own limits it is stuck; a task on an async worker may first wait
            # for one episode slot.
            deadline_s=(self.limits.episode_timeout_s * 1.5 + 60.0) * (1 if self.width == 1 else 2),
        )
        st.free = [w for _ in range(self.width) for w in range(self.size)]
        last_report = time.monotonic()
        while st.queue or st.inflight or st.acks:
            while st.queue and st.free:
                i, attempt = st.queue.popleft()
                w = st.free.pop()
                handle = self.workers[w]
                ref = handle.run.remote(tasks[i], spec, return_trajectories)
                st.inflight[ref] = (i, attempt, w, time.monotonic() + st.deadline_s, handle)
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
        i, attempt, w, _, handle = st.inflight.pop(ref)
        task = st.tasks[i]
        try:
            out = ray.get(ref)
        except actor_failures() as exc:
            log.warning("rollout worker died on task %s (attempt %d): %s", task.id, attempt, type(exc).__name__)
            self._replace(w, handle)
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
        elif out.get("not_stored"):  # an async worker's add, acknowledged there: not stored
            self._retry_or_fail(st.queue, st.results, st.tasks, i, attempt, out["not_stored"], st.stats, st.on_result)
        else:
            outcome.stored = out.get("stored")
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
            except Exception as exc:  # noqa: BLE001 - sorted by add_failure: a conflict, a lost answer, a refusal
                outcome.stored, why = add_failure(exc)
            st.acks.remove(entry)
            if why is not None:
                self._retry_or_fail(st.queue, st.results, st.tasks, i, attempt, why, st.stats, st.on_result)
                continue
            outcome.summary["ack_s"] = round(time.monotonic() - submitted, 6)
            self._finish(st.results, outcome, i, st.stats, st.on_result)

    def _replace_stuck(self, st: _PoolRun, now: float) -> None:
        for ref, (i, attempt, w, deadline, handle) in list(st.inflight.items()):
            if now > deadline:  # hung beyond the worker's own limits: kill it
                del st.inflight[ref]
                log.warning(
                    "rollout worker %d stuck on task %s for %.0f s: replacing it", w, st.tasks[i].id, st.deadline_s
                )
                self._replace(w, handle)
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
