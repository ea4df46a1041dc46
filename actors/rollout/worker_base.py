"""What the rollout workers share: the task's spec (:class:`EpisodeSpec`), the worker's
settings and resources (:class:`RolloutWorkerBase`), what each memory mode shows the agent,
and what an add that raised means for its task.

:class:`~lifemem_ray.actors.rollout.workers.RolloutWorker` (one episode at a time) and
:class:`~lifemem_ray.actors.rollout.async_worker.AsyncRolloutWorker` (many at once) build on
it; :mod:`lifemem_ray.actors.rollout.workers` re-exports :class:`EpisodeSpec`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from lifemem_ray.actors.cluster import ray_metrics
from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.actors.cluster.remote_errors import actor_failures
from lifemem_ray.core.errors import EnvStateError, IdConflictError, InvalidArgumentError
from lifemem_ray.engine.retrieval import Retrieval, RetrievedSkill, render_context
from lifemem_ray.lab.agents import Agent, make_agent
from lifemem_ray.lab.envs import Environment, Task, make_env
from lifemem_ray.lab.episode import EnvHung, EpisodeLimits, EpisodeResult, EpisodeTimeout
from lifemem_ray.lab.experiment_config import MEMORY_MODES, RETRIEVING_MODES

__all__ = [
    "MAX_EPISODES_PER_WORKER",
    "EpisodeSpec",
    "RolloutWorkerBase",
    "add_failure",
    "best_env",
    "close_quietly",
    "global_profile",
    "shaped",
]

log = logging.getLogger(__name__)

MAX_EPISODES_PER_WORKER = 1024  # concurrent episodes on one worker (experiment.episodes_per_worker)


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
            raise InvalidArgumentError(f"{self.mode!r} is not one of {', '.join(MEMORY_MODES)}", where="mode")
        if self.mode in RETRIEVING_MODES and self.namespace is None:
            raise InvalidArgumentError(f"mode {self.mode!r} needs the memory deployment's namespace")
        if self.write and self.namespace is None:
            raise InvalidArgumentError("write=True needs the memory deployment's namespace")


class RolloutWorkerBase:
    """What both rollout workers share: their settings, how they make environments and
    agents, the task-embedding cache, which failures are the environment's, and the report
    of one task. :class:`RolloutWorker` runs one episode at a time;
    :class:`~lifemem_ray.actors.rollout.async_worker.AsyncRolloutWorker` runs several at once."""

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
        self.env_restarts = 0

    def _new_env(self, name: str) -> Environment:
        return make_env(name, **self.env_options.get(name, {}))

    def _abandon_env(self, env: Environment) -> None:
        """Close an environment that hung or failed, without waiting on it forever."""
        import threading

        self.env_restarts += 1
        threading.Thread(target=close_quietly, args=(env,), daemon=True, name=f"close-{env.name}").start()

    @staticmethod
    def _close_env(env: Environment) -> None:
        """Close an environment now (a worker closing), logging rather than raising."""
        close_quietly(env)

    def _new_agent(self, name: str, seed: int, client: Any = None) -> Agent:
        """An agent; ``client``: the LLM client a ReAct agent shares (None: its own)."""
        options: dict[str, Any] = {}
        if name == "react":
            options = {"client": client} if client is not None else {"metrics": ray_metrics.SINK}
        return make_agent(name, seed=seed, llm_config=self.config.llm, **options)

    def _env_fault(self, exc: Exception, task: Task, attempt: int) -> bool:
        """Whether ``exc`` is the environment's fault (logged here; the caller replaces the
        environment and retries the task) rather than the task's or the agent's (a
        ValueError or KeyError: the caller raises it as it is)."""
        if isinstance(exc, (EnvHung, EpisodeTimeout)):
            log.warning(
                "worker %d: %s; replacing environment %s (attempt %d)", self.worker_id, exc, task.env, attempt + 1
            )
            return True
        if isinstance(exc, (ValueError, KeyError)):
            return False
        log.warning(
            "worker %d: %s failed in %s: %s: %s; replacing it",
            self.worker_id,
            task.id,
            task.env,
            type(exc).__name__,
            exc,
        )
        return True

    def _gave_up(self, task: Task, last_error: BaseException | None) -> EnvStateError:
        return EnvStateError(
            f"task {task.env}/{task.id} failed {self.env_retries + 1} times with a fresh environment: {last_error}"
        )

    def _metadata(self, spec: EpisodeSpec) -> dict[str, Any]:
        return {"mode": spec.mode, "phase": spec.phase, "run": spec.run, "worker": self.worker_id}

    def _reply(self, result: EpisodeResult, submit_s: float, return_trajectory: bool) -> dict[str, Any]:
        """What goes back to the pool for one task (``ack`` is set by the caller)."""
        summary = result.summary()
        summary.update(
            worker=self.worker_id,
            submit_s=round(submit_s, 6),
            env_restarts=self.env_restarts,
            memory_s=round(result.timings["memory_s"] + submit_s, 6),
        )
        return {
            "summary": summary,
            "ack": None,
            "trajectory": result.trajectory.to_dict() if return_trajectory else None,
        }


def global_profile(spec: EpisodeSpec, budget: int) -> Callable[[Task], Retrieval]:
    """Mode ``global-skills``: the run's one skill profile, for every task (no memory call)."""
    skills = [RetrievedSkill(-1, spec.global_skill, 1.0)] if spec.global_skill.strip() else []

    def profile(task: Task) -> Retrieval:
        context, tokens = render_context([], skills, budget)
        return Retrieval(task.instruction, None, [], skills, context, tokens, budget)

    return profile


def shaped(spec: EpisodeSpec, hit: Retrieval, env: str, budget: int) -> Retrieval:
    """A same-environment retrieval as the mode shows it: ``skills-only`` keeps the skills
    and drops the exemplars; the other modes show it as it came."""
    if spec.mode != "skills-only":
        return hit
    context, tokens = render_context([], hit.skills, budget)
    return Retrieval(hit.task, env, [], hit.skills, context, tokens, budget)


def best_env(found: Retrieval) -> str | None:
    """The stored environment whose trajectories best match a task of an environment the
    memory has never seen (``found``: the task's global top-k, no skills): the one with the
    largest summed score (ties: the earlier hit). None for an empty memory."""
    totals: dict[str, float] = {}
    for hit in found.trajectories:
        totals[hit.env] = totals.get(hit.env, 0.0) + max(hit.score, 0.0)
    return max(totals, key=lambda env: totals[env]) if totals else None


def add_failure(exc: BaseException) -> tuple[str | None, str | None]:
    """What an add that raised means for its task: ``(stored, None)`` when the memory keeps
    a trajectory under its id (an earlier attempt of this task stored a different run of it,
    and the memory keeps the first, as promised), else ``(None, why)``: not stored, or not
    known to be (the retry has the same id, so it is stored at most once), and the task is
    retried as any failed attempt."""
    if isinstance(exc, IdConflictError):
        return "conflict-existing", None
    if isinstance(exc, actor_failures(ray.exceptions.OwnerDiedError)):
        return None, f"acknowledgement lost: {type(exc).__name__}"
    return None, f"not stored: {type(exc).__name__}: {exc}"


def close_quietly(env: Environment) -> None:
    try:
        env.close()
    except Exception:
        log.warning("closing environment %s failed", getattr(env, "name", env), exc_info=True)
