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
from dataclasses import dataclass, field
from typing import Any

from lifemem_ray.core.errors import EnvStateError, EnvUnavailable, TaskError

__all__ = ["EnvStateError", "EnvUnavailable", "Environment", "StepResult", "Task", "TaskError"]


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
