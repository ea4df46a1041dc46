"""The environment interface rollout workers drive: small, gym-like, text in and out.

The convention of the Ray RL stacks (verl, SkyRL, rLLM): ``reset(task)`` returns the
first observation and an info dict; ``step(action)`` returns observation, reward,
done and info; ``close()`` frees what the environment holds (a JVM, a browser).

Info keys every adapter fills where it can:

* ``instruction``: the task's goal text;
* ``valid_actions``: the actions the environment accepts now (None when it cannot list them);
* ``success``: at the end of an episode, whether the task was solved (None: unknown);
* ``score``: the environment's own progress score, when it has one.
"""

from __future__ import annotations

import abc
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lifemem_ray.core.errors import EnvStateError, EnvUnavailable, InvalidArgumentError, TaskError

__all__ = [
    "EnvStateError",
    "EnvUnavailable",
    "Environment",
    "StepResult",
    "Task",
    "TaskError",
    "check_task",
    "select_tasks",
]


@dataclass(frozen=True)
class Task:
    """One task of an environment. ``env`` is the memory's environment name."""

    env: str
    id: str
    instruction: str
    split: str = "train"  # train | test
    payload: dict[str, Any] = field(default_factory=dict)  # what the adapter needs to set it up
    metadata: dict[str, Any] = field(default_factory=dict)  # e.g. task_type, difficulty


@dataclass(frozen=True)
class StepResult:
    observation: str
    reward: float
    done: bool
    info: dict[str, Any]


class Environment(abc.ABC):
    """One instance of an environment; not thread-safe (one per worker)."""

    name: str = "env"
    max_steps: int = 50

    @abc.abstractmethod
    def tasks(self, split: str = "train", limit: int | None = None, seed: int = 0) -> list[Task]:
        """The tasks of a split, in a fixed (seeded) order."""

    @abc.abstractmethod
    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Start ``task``; the first observation and info (instruction, valid_actions)."""

    @abc.abstractmethod
    def step(self, action: str) -> StepResult:
        """Apply one action (any text: an invalid one gets an observation saying so)."""

    def gold_actions(self, task: Task) -> list[str] | None:
        """A known solution of ``task`` (for scripted data-collection agents), if the environment has one."""
        return None

    def close(self) -> None:  # noqa: B027 - optional: an environment without processes or files has nothing to free
        """Free processes and files; safe to call twice."""

    def __enter__(self) -> Environment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def select_tasks(
    owner: str, by_split: Mapping[str, Sequence[Task]], split: str, limit: int | None, seed: int
) -> list[Task]:
    """``Environment.tasks``' rule: the split's tasks in their own order for ``seed=0``, else
    shuffled by ``seed``; the first ``limit`` (None: all). ``owner`` names the environment in
    the errors (an unknown split, a bad limit)."""
    if split not in by_split:
        raise InvalidArgumentError(
            f"{owner}.tasks: split must be one of {', '.join(map(repr, by_split))}, got {split!r}"
        )
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise InvalidArgumentError(f"{owner}.tasks: limit must be None or an integer >= 0, got {limit!r}")
    out = list(by_split[split])
    if seed:
        random.Random(seed).shuffle(out)
    return out if limit is None else out[:limit]


def check_task(owner: str, task: object, env_name: str) -> Task:
    """``task`` when it is a Task of environment ``env_name``; a TaskError naming ``owner`` otherwise."""
    if not isinstance(task, Task):
        raise TaskError(f"{owner}.reset: expected a Task, got {type(task).__name__}")
    if task.env != env_name:
        raise TaskError(f"{owner}.reset: task {task.id!r} belongs to environment {task.env!r}, not {env_name!r}")
    return task
