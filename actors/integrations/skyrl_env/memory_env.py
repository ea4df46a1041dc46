"""The memory around any SkyRL text environment (``lifemem-memory``): recall at ``init``,
record each step, submit in the background at ``done``, settle (bounded) at ``close``."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from lifemem_ray.actors.integrations.skyrl_env.config_checks import (
    MEMORY_KEYS,
    as_mapping,
    bounded_number,
    check_keys,
    nonempty_name,
)
from lifemem_ray.actors.integrations.skyrl_env.lab_env import LAB_ENV_ID
from lifemem_ray.actors.integrations.skyrl_env.shared_clients import episode_memory_opener
from lifemem_ray.core.errors import ConfigError, InvalidArgumentError
from lifemem_ray.episodes.chat_context import CONTEXT_PLACES, last_message, message_text, with_context
from lifemem_ray.episodes.episode_data import MADE_VALID_KINDS, NOT_STORED_REASONS
from lifemem_ray.episodes.episode_memory import EpisodeRecord

__all__ = ["MEMORY_ENV_ID", "MemoryTextEnv"]

log = logging.getLogger(__name__)

MEMORY_ENV_ID = "lifemem-memory"


class MemoryTextEnv(BaseTextEnv):
    """Any SkyRL text environment with the memory.

    ``env_config``:

    * ``inner``: the registered skyrl_gym id of the environment to wrap (``lifemem-lab``,
      ``gsm8k`` ...); ``inner_config``: its ``env_config``. It gets the same extras. (Or pass a
      built ``inner=`` environment to ``skyrl_gym.make``.)
    * ``memory``: ``namespace`` (the deployment's Ray namespace), optional ``address`` (used
      only when this process has no Ray connection yet), ``overrides`` (dotted DeploymentConfig
      settings of the client), ``reconnect_after_s`` (30), and the episode options ``k``,
      ``token_budget``, ``tenant``, ``ack_timeout_s``, ``max_pending``, ``same_env``, ``as_of`` (a
      memory version the recalls are pinned to; recorded in each stored trajectory) of
      :class:`~lifemem_ray.episodes.episode_memory.EpisodeMemory`. One client per deployment serves
      every environment of the process. (Or pass ``memory=`` to ``skyrl_gym.make``: an
      ``EpisodeMemory``, shared as it is, or a memory object such as ``Memory``.)
    * ``memory_env``: the environment's name in the memory (default: the inner ``init``'s
      ``info["env"]``, else the row's ``data_source``, else the inner id).
    * ``context_in``: ``system`` (default: the context joins the first message when it is a
      system message, else becomes one before the prompt) or ``user`` (before the first user
      message's text); :func:`lifemem_ray.episodes.chat_context.with_context` is the rule.
    * ``task_from``: the task text recalled for and stored: ``auto`` (default: the inner
      ``init``'s ``info["instruction"]``, else the last user message), ``last_user``,
      ``first_user``, or ``extras.<key>[.<key>...]`` (a field of the row).
    * ``settle_timeout_s``: how long ``close`` waits for the write's acknowledgement (10).

    The trajectory stored: the task, the last user message at ``init`` as the first
    observation, each (action, observation) step, the summed reward, and success: the last
    step's ``metadata["success"]`` when the inner environment gives one, else reward > 0.
    An episode closed before ``done`` is stored with its outcome unknown. What the inner
    environment and the policy hand over is made valid by the episode data rule
    (:mod:`lifemem_ray.episodes.episode_data`: a NaN reward, a NUL, a lone surrogate, a 50 MB
    action) and counted; an episode that cannot be stored, or a step output that cannot be
    read, is counted with its reason (``get_metrics``); neither raises into the rollout.

    Example::

        env = MemoryTextEnv(
            {"inner": "lifemem-lab", "inner_config": {"env": "sql"}, "memory": {"namespace": "lifemem"}},
            {"task_index": 0, "max_turns": 8},
        )
        chat, info = env.init([])  # the memory's fenced context as the first (system) message
    """

    def __init__(
        self,
        env_config: Mapping[str, Any] | None = None,
        extras: Mapping[str, Any] | None = None,
        *,
        inner: Any = None,
        memory: Any = None,
    ) -> None:
        super().__init__()
        where = f"{MEMORY_ENV_ID} env_config"
        config = as_mapping(env_config, where)
        check_keys(config, MEMORY_KEYS, where)
        self.extras = as_mapping(extras, f"{MEMORY_ENV_ID} extras")
        self.context_in = config.get("context_in", "system")
        if self.context_in not in CONTEXT_PLACES:
            raise ConfigError(f"{where}['context_in']: expected one of {CONTEXT_PLACES}, got {self.context_in!r}")
        self.task_from = nonempty_name(config.get("task_from", "auto"), f"{where}['task_from']")
        self._extras_task = task_from_extras(self.task_from, self.extras, f"{where}['task_from']")
        self.settle_timeout_s = bounded_number(
            config.get("settle_timeout_s", 10.0), 0.0, 3600.0, f"{where}['settle_timeout_s']"
        )
        memory_env = config.get("memory_env")
        self.memory_env = None if memory_env is None else nonempty_name(memory_env, f"{where}['memory_env']")
        open_memory = episode_memory_opener(config.get("memory"), memory, f"{where}['memory']")
        self.inner_id, make_inner = inner_env_maker(config, self.extras, inner, where)
        self.episodes, self._owns_episodes = open_memory()  # everything checked (a client connects on first use)
        try:
            self.inner = make_inner()
        except BaseException:
            if self._owns_episodes:
                self.episodes.close(0.0)
            raise
        self.max_turns: int = getattr(self.inner, "max_turns", 1)
        self.timings = {"recall_s": 0.0, "submit_s": 0.0, "settle_s": 0.0}  # the episode's time in memory calls
        self.context_chars, self.exemplars, self.skills, self.handoff_failures = 0, 0, 0, 0
        self.recalls, self.recall_failures = 0, 0  # this episode's (the episode memory may be shared)
        self._write: Future[bool] | None = None  # this episode's write, once handed over
        self._hits: list[str] = []
        self._read: dict[str, Any] = {}  # what this episode's recall read (its pinned version)
        self._record: EpisodeRecord | None = None  # the episode running now, until submitted
        self._made_valid: dict[str, int] = {}  # what the rule changed in this episode's trajectory
        self._not_stored = ""  # why this episode was not stored ("" when it was, or is not finished)
        self._closed = False

    def init(self, prompt: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The inner ``init``, with the memory's fenced context in the chat (see ``context_in``)."""
        chat, info = self.inner.init(prompt)
        chat, info = [dict(message) for message in chat or []], dict(info or {})
        env_name = self._env_name(info)
        self._record = EpisodeRecord(env_name, self._task_text(chat, info), message_text(last_message(chat, "user")))
        started = time.perf_counter()
        pinned = self.episodes.as_of  # the version this recall reads (pin may move before done)
        context, found = self.episodes.recall(self._record.task, env_name)  # the task made valid
        self._read = self.episodes.episode_metadata(pinned, found)
        self.timings["recall_s"] = time.perf_counter() - started
        self.recalls += 1
        self.recall_failures += found is None
        self._hits = [hit.id for hit in found.trajectories] if found is not None else []
        self.exemplars = len(self._hits)
        self.skills = len(found.skills) if found is not None else 0
        self.context_chars = len(context)
        info["memory_hits"] = list(self._hits)
        return with_context(chat, context, self.context_in), info

    def step(self, action: str) -> BaseTextEnvStepOutput:
        """The inner ``step``; recorded, and the trajectory submitted when it says ``done``.

        Args:
            action: the policy's text, passed to the inner environment as it is.

        Returns:
            The inner environment's output, unchanged.

        Raises:
            Whatever the inner ``step`` raises (the environment's own error); recording never
            raises: the data is made valid and counted, and an output that cannot be read
            drops the episode's record (``memory_not_stored_unreadable``).
        """
        out = self.inner.step(action)
        if self._record is not None:
            try:
                self._record_step(self._record, out, action)
            except Exception as exc:  # noqa: BLE001 - recording never fails the rollout: the record is dropped
                self._record, self._not_stored = None, "unreadable"
                self.episodes.count_not_stored("unreadable", f"{type(exc).__name__}: {exc}")
        return out

    def get_metrics(self) -> dict[str, Any]:
        """The inner environment's metrics and this episode's memory: ``memory_recalls``,
        ``memory_recall_failures``, ``memory_submitted``, ``memory_acknowledged``,
        ``memory_submit_failures``, ``memory_pending`` (0 or 1 each: the episode's own recall and
        write, also where the episode memory is shared), ``memory_exemplars``, ``memory_skills``,
        ``memory_context_chars``, ``memory_recall_s``, ``memory_submit_s`` (the episode's time in
        memory calls), ``memory_made_valid`` and ``memory_made_valid_<kind>`` for each of
        ``episode_data.MADE_VALID_KINDS`` (1 when the episode's trajectory was stored after that
        kind of change), ``memory_not_stored`` and ``memory_not_stored_<reason>`` for each of
        ``episode_data.NOT_STORED_REASONS`` (1 when the episode was not stored, for that reason),
        and ``memory_last_error`` (the episode memory's latest failure, text; SkyRL's averaging
        drops it)."""
        metrics = dict(self.inner.get_metrics() or {})
        write = self._write
        settled = write is not None and write.done()
        acknowledged = settled and write is not None and write.result() is True
        metrics.update(
            memory_recalls=self.recalls,
            memory_recall_failures=self.recall_failures,
            memory_submitted=int(write is not None) + self.handoff_failures,
            memory_acknowledged=int(acknowledged),
            memory_submit_failures=int(settled and not acknowledged) + self.handoff_failures,
            memory_pending=int(write is not None and not settled),
            memory_exemplars=self.exemplars,
            memory_skills=self.skills,
            memory_context_chars=self.context_chars,
            memory_recall_s=self.timings["recall_s"],
            memory_submit_s=self.timings["submit_s"],
            memory_made_valid=int(bool(self._made_valid)),
            memory_not_stored=int(bool(self._not_stored)),
            memory_last_error=self.episodes.counts.last_error,
        )
        metrics.update({f"memory_made_valid_{kind}": int(kind in self._made_valid) for kind in MADE_VALID_KINDS})
        metrics.update({f"memory_not_stored_{why}": int(why == self._not_stored) for why in NOT_STORED_REASONS})
        return metrics

    def close(self) -> None:
        """Submit an episode closed before ``done`` (outcome unknown), wait for its write's
        acknowledgement (at most ``settle_timeout_s``; 0: not at all, the write goes on in the
        background), close the inner environment; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            self._submit(None, ended="closed before done")
            started = time.perf_counter()
            if self._write is not None and self.settle_timeout_s > 0:
                try:
                    self._write.result(timeout=self.settle_timeout_s)
                except FutureTimeout:
                    pass  # still in flight: get_metrics says pending
            if self._owns_episodes:
                self.episodes.close(0.0)  # its writer finishes what it holds, in the background
            self.timings["settle_s"] = time.perf_counter() - started
        finally:
            self.inner.close()

    # -- helpers ---------------------------------------------------------------------------------------
    def _task_text(self, chat: list[dict[str, Any]], info: Mapping[str, Any]) -> str:
        if self._extras_task is not None:
            return self._extras_task
        if self.task_from == "auto" and isinstance(info.get("instruction"), str) and info["instruction"].strip():
            return str(info["instruction"])
        first = self.task_from == "first_user"
        return message_text(last_message(chat[::-1] if first else chat, "user"))

    def _env_name(self, info: Mapping[str, Any]) -> str:
        for name in (self.memory_env, info.get("env"), self.extras.get("data_source"), self.extras.get("env_class")):
            if isinstance(name, str) and name.strip():
                return name.strip()
        return self.inner_id

    def _record_step(self, record: EpisodeRecord, out: Any, action: Any) -> None:
        """Record the inner environment's output ``out`` to ``action`` in ``record``; submit
        when it says ``done`` (success: its ``metadata["success"]``, else reward > 0)."""
        metadata = out.get("metadata") or {}
        metadata = metadata if isinstance(metadata, Mapping) else {}
        messages = out.get("observations") or []
        observation = "\n".join(message_text(m) if isinstance(m, Mapping) else str(m) for m in messages)
        record.step(action, observation or metadata.get("observation", ""), out.get("reward"))
        if out.get("done"):
            reported = metadata.get("success")
            total = record.total_reward
            success = reported if reported is not None else (None if total is None else total > 0)
            self._submit(success, ended="done")

    def _submit(self, success: Any, ended: str) -> None:
        """Hand the episode to the memory in the background (never raises into the rollout)."""
        record, self._record = self._record, None
        if record is None or not record.steps:
            return
        metadata = {"source": "skyrl", "inner": self.inner_id, "ended": ended, "memory_hits": self._hits}
        metadata.update(self._read)  # the memory version the episode read, when pinned
        if isinstance(self.extras.get("data_source"), str):
            metadata["data_source"] = self.extras["data_source"]
        started = time.perf_counter()
        result = self.episodes.storable(record, success, metadata=metadata)  # made valid and counted, or why not
        self._made_valid, self._not_stored = result.made_valid, result.not_stored
        try:
            if result.trajectory is not None:
                self._write = self.episodes.submit(result.trajectory)
        except Exception as exc:  # noqa: BLE001 - the memory's failure never fails the rollout
            self.handoff_failures += 1
            log.warning("memory submit: %s: %s (the episode goes on without it)", type(exc).__name__, exc)
        self.timings["submit_s"] += time.perf_counter() - started


def task_from_extras(task_from: str, extras: Mapping[str, Any], where: str) -> str | None:
    """The row's field that ``task_from = "extras.<path>"`` names (None for the other choices)."""
    if task_from in ("auto", "last_user", "first_user"):
        return None
    if not task_from.startswith("extras."):
        raise ConfigError(f"expected auto, last_user, first_user or extras.<key>, got {task_from!r}", where=where)
    value: Any = extras
    for key in task_from.split(".")[1:]:
        value = value.get(key) if isinstance(value, Mapping) else None
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"the row's extras hold no text at {task_from!r} (got {value!r})", where=where)
    return value


def inner_env_maker(
    config: Mapping[str, Any], extras: dict[str, Any], inner: Any, where: str
) -> tuple[str, Callable[[], Any]]:
    """The inner id, checked, and the call that gives the inner environment: ``inner`` as
    given, else made from ``config`` with the row's extras."""
    if inner is not None:
        if not isinstance(inner, BaseTextEnv):
            raise InvalidArgumentError(
                f"{MEMORY_ENV_ID}: inner= must be a skyrl_gym BaseTextEnv, got {type(inner).__name__}"
            )
        return str(getattr(getattr(inner, "spec", None), "id", "") or type(inner).__name__), lambda: inner
    inner_id = nonempty_name(config.get("inner"), f"{where}['inner']")
    spec = skyrl_gym.registry.get(inner_id)
    if spec is None:
        raise ConfigError(
            f"{where}['inner']: {inner_id!r} is not registered with skyrl_gym in this process; "
            f"registered: {', '.join(sorted(skyrl_gym.registry))} (register_skyrl_envs() adds {LAB_ENV_ID})"
        )
    if spec.entry_point in (MemoryTextEnv, f"{__name__}:MemoryTextEnv", f"{__package__}:MemoryTextEnv"):
        raise ConfigError(f"{where}['inner']: {inner_id!r} is the memory wrapper itself; name the environment to wrap")
    inner_config = as_mapping(config.get("inner_config"), f"{where}['inner_config']")
    return inner_id, lambda: skyrl_gym.make(inner_id, env_config=inner_config, extras=dict(extras))
