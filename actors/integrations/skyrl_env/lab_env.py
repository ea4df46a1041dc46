"""The project's environments (:mod:`lifemem_ray.lab.envs`) as SkyRL text environments
(``lifemem-lab``), with a per-process pool of idle environments: SkyRL makes one environment
per trajectory, and some of ours start a JVM or a browser."""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from typing import Any

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from lifemem_ray.actors.integrations.skyrl_env.config_checks import (
    LAB_KEYS,
    as_mapping,
    check_keys,
    max_turns_of,
    nonempty_name,
    row_extra,
)
from lifemem_ray.core.errors import ConfigError, EnvStateError, InvalidArgumentError, TaskError, UnknownNameError
from lifemem_ray.lab.envs import Environment, Task, make_env

__all__ = ["LAB_ENV_ID", "LabEnvPool", "LabTextEnv"]

LAB_ENV_ID = "lifemem-lab"
MAX_VALID_ACTIONS = 80  # valid actions listed under an observation
IDLE_ENVS_KEPT = 8  # environments of one kind kept for reuse per process (a JVM or a browser is slow to start)


class LabEnvPool:
    """This process's idle environments by kind, and each kind's tasks by id: SkyRL makes an
    environment per trajectory, and some of ours start a JVM or a browser."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: dict[str, list[Environment]] = {}
        self._tasks: dict[tuple[str, str], dict[str, Task]] = {}

    @staticmethod
    def key(name: str, options: Mapping[str, Any]) -> str:
        return json.dumps([name, options], sort_keys=True, default=repr)

    def acquire(self, key: str, name: str, options: dict[str, Any], where: str) -> Environment:
        with self._lock:
            idle = self._idle.get(key)
            if idle:
                return idle.pop()
        try:
            return make_env(name, **dict(options))
        except UnknownNameError as exc:
            raise UnknownNameError(f"{where}['env']: {exc.args[0]}") from None
        except (TypeError, InvalidArgumentError, ConfigError) as exc:
            raise ConfigError(f"{where}['options']: environment {name!r} does not accept {options!r}: {exc}") from None

    def release(self, key: str, env: Environment, healthy: bool) -> None:
        with self._lock:
            idle = self._idle.setdefault(key, [])
            if healthy and len(idle) < IDLE_ENVS_KEPT:
                idle.append(env)
                return
        env.close()

    def task(self, key: str, env: Environment, split: str, extras: Mapping[str, Any], where: str) -> Task:
        """The task the row's extras name: ``task_id`` (looked up in ``split``, then in every
        split) or ``task_index`` (into ``split``), at the top of the extras or in ``extra_info``."""
        task_id, index = row_extra(extras, "task_id"), row_extra(extras, "task_index")
        if task_id is None and index is None:
            raise ConfigError(
                f"the row names no task; give extras['task_id'] or extras['task_index'] "
                f"(or the same under extras['extra_info']); extras has {sorted(extras)}",
                where=where,
            )
        if task_id is None:
            tasks = env.tasks(split)
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(tasks):
                raise TaskError(f"{where}['task_index']: expected 0..{len(tasks) - 1} ({split} split), got {index!r}")
            return tasks[index]
        for each in (split, *(s for s in ("train", "test") if s != split)):
            with self._lock:
                by_id = self._tasks.get((key, each))
            if by_id is None:
                by_id = {t.id: t for t in env.tasks(each)}
                with self._lock:
                    self._tasks[(key, each)] = by_id
            if str(task_id) in by_id:
                return by_id[str(task_id)]
        raise TaskError(f"{where}['task_id']: no task {task_id!r} in environment {env.name!r} (looked in every split)")


LAB_ENVS = LabEnvPool()


class LabTextEnv(BaseTextEnv):
    """One of the project's environments (:mod:`lifemem_ray.lab.envs`) as a SkyRL text environment.

    ``env_config``: ``env`` (its name: ``sql``, ``twx-coin`` ...), ``options`` (keyword options of
    :func:`~lifemem_ray.lab.envs.make_env`), ``split`` (default ``train``). ``extras`` (the dataset
    row): ``task_id`` or ``task_index`` (top level or under ``extra_info``), optional ``split`` and
    ``max_turns`` (SkyRL sets it from ``generator.max_turns``; the episode ends there, unsolved).

    ``init(prompt)`` starts the task and returns the prompt plus the first observation as a user
    message (with the valid actions when the environment lists them); ``step(action)`` returns
    the next observation as a user message (none once ``done``), the step's reward, ``done``, and
    metadata with ``success`` (at the end), ``observation``, ``turn``, ``task_id`` and ``env``.

    Example::

        env = LabTextEnv({"env": "sql"}, {"task_index": 0, "max_turns": 8})
        chat, info = env.init([{"role": "system", "content": "Solve the task."}])
        out = env.step("Action: Answer\\nFinal Answer: []")
        env.close()
    """

    def __init__(self, env_config: Mapping[str, Any] | None = None, extras: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        where = f"{LAB_ENV_ID} env_config"
        config = as_mapping(env_config, where)
        check_keys(config, LAB_KEYS, where)
        self.extras = as_mapping(extras, f"{LAB_ENV_ID} extras")
        self.env_name = nonempty_name(config.get("env"), f"{where}['env']")
        options = as_mapping(config.get("options"), f"{where}['options']")
        split = row_extra(self.extras, "split") or config.get("split", "train")
        if split not in ("train", "test"):
            raise ConfigError(f"{where}['split'] (or extras['split']): expected 'train' or 'test', got {split!r}")
        self._key = LAB_ENVS.key(self.env_name, options)
        self._env: Environment | None = LAB_ENVS.acquire(self._key, self.env_name, options, where)
        try:
            self.task = LAB_ENVS.task(self._key, self._env, split, self.extras, f"{LAB_ENV_ID} extras")
            limit = max_turns_of(self.extras, f"{LAB_ENV_ID} extras")
        except BaseException:
            LAB_ENVS.release(self._key, self._env, healthy=True)
            self._env = None
            raise
        self.max_turns = limit if limit is not None else self._env.max_steps
        self.success: bool | None = None  # known once the episode is done
        self.total_reward = 0.0
        self._done = True  # until init
        self._healthy = True

    def init(self, prompt: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Start the task; the prompt's messages, then the first observation as a user message."""
        env = self._running("init")
        try:
            observation, info = env.reset(self.task)
        except BaseException:
            self._healthy = False
            raise
        self.turns, self._done, self.success, self.total_reward = 0, False, None, 0.0
        chat = [dict(message) for message in prompt or []]
        chat.append({"role": "user", "content": with_valid_actions(observation, info)})
        return chat, {
            "env": self.env_name,
            "task_id": self.task.id,
            "instruction": str(info.get("instruction") or self.task.instruction),
        }

    def step(self, action: str) -> BaseTextEnvStepOutput:
        """Apply ``action``; done when the environment ends the episode or at ``max_turns``."""
        env = self._running("step")
        if self._done:
            raise EnvStateError(f"{LAB_ENV_ID}({self.env_name}): step after the episode ended; make a new environment")
        try:
            result = env.step(action)
        except BaseException:
            self._healthy = False
            raise
        self.turns += 1
        self.total_reward += float(result.reward or 0.0)
        cut_off = not result.done and self.turns >= self.max_turns
        done = result.done or cut_off
        success = result.info.get("success")
        if cut_off and success is None:
            success = False  # out of turns without solving it
        self._done = done
        if done:
            self.success = None if success is None else bool(success)
        metadata = {
            "env": self.env_name,
            "task_id": self.task.id,
            "turn": self.turns,
            "success": self.success if done else None,
            "observation": result.observation,
            "truncated": cut_off,
        }
        observations = (
            [] if done else [{"role": "user", "content": with_valid_actions(result.observation, result.info)}]
        )
        return BaseTextEnvStepOutput(
            observations=observations, reward=float(result.reward or 0.0), done=done, metadata=metadata
        )

    def get_metrics(self) -> dict[str, Any]:
        """``turns``, ``reward`` (summed) and, once known, ``success`` (1.0 or 0.0)."""
        metrics: dict[str, Any] = {"turns": self.turns, "reward": self.total_reward}
        if self.success is not None:
            metrics["success"] = float(self.success)
        return metrics

    def close(self) -> None:
        """Hand the environment back for the next trajectory of this process (or close it, if it
        failed or enough are idle); safe to call twice."""
        env, self._env = self._env, None
        if env is not None:
            LAB_ENVS.release(self._key, env, self._healthy)

    def _running(self, what: str) -> Environment:
        if self._env is None:
            raise EnvStateError(f"{LAB_ENV_ID}({self.env_name}): {what} after close; make a new environment")
        return self._env


def with_valid_actions(observation: str, info: Mapping[str, Any]) -> str:
    actions = info.get("valid_actions")
    if not actions:
        return str(observation)
    shown = [str(a) for a in list(actions)[:MAX_VALID_ACTIONS]]
    more = f"\n(+{len(actions) - len(shown)} more)" if len(actions) > len(shown) else ""
    return f"{observation}\n\nValid actions:\n" + "\n".join(f"- {a}" for a in shown) + more
