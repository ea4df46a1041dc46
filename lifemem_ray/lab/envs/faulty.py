"""Fault injection around a real environment, for testing the rollout machinery.

``make_env("faulty", inner="sql", hang_on=["<task id>"], crash_on=[...], marker_dir=DIR)``
behaves like ``inner`` except that, the first time it sees one of the named tasks (a
marker file in ``marker_dir`` remembers it across processes):

* ``hang_on``: ``reset`` blocks (a hung environment: the per-step limit must fire);
* ``crash_on``: the worker process dies at once (``os._exit``), as on a segfault or OOM kill;
* ``fail_on``: ``step`` raises (a broken environment that must be replaced).

The retry then runs normally, so a test can check that the task was retried, not
skipped, and that its trajectory was stored exactly once.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lifemem_ray.core.errors import EnvStateError
from lifemem_ray.lab.envs import make_env
from lifemem_ray.lab.envs.base import Environment, StepResult, Task

__all__ = ["FaultyEnv"]


class FaultyEnv(Environment):
    def __init__(
        self,
        inner: str,
        marker_dir: str,
        hang_on: Sequence[str] = (),
        crash_on: Sequence[str] = (),
        fail_on: Sequence[str] = (),
        hang_s: float = 3600.0,
        inner_options: dict[str, Any] | None = None,
    ) -> None:
        self.inner = make_env(inner, **(inner_options or {}))
        self.name = self.inner.name
        self.max_steps = self.inner.max_steps
        self.marker_dir = Path(marker_dir)
        self.marker_dir.mkdir(parents=True, exist_ok=True)
        self.hang_on, self.crash_on, self.fail_on = set(hang_on), set(crash_on), set(fail_on)
        self.hang_s = hang_s
        self._task: Task | None = None
        self._released = threading.Event()

    def _first_time(self, kind: str, task: Task) -> bool:
        marker = self.marker_dir / f"{kind}-{task.env}-{task.id}".replace("/", "_")
        try:
            marker.touch(exist_ok=False)
        except FileExistsError:
            return False
        return True

    def tasks(self, split: str = "train", limit: int | None = None, seed: int = 0) -> list[Task]:
        return self.inner.tasks(split, limit, seed)

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        self._task = task
        if task.id in self.crash_on and self._first_time("crash", task):
            os._exit(17)
        if task.id in self.hang_on and self._first_time("hang", task):
            self._released.wait(self.hang_s)  # until close() or the hang time
        return self.inner.reset(task)

    def step(self, action: str) -> StepResult:
        task = self._task
        if task is not None and task.id in self.fail_on and self._first_time("fail", task):
            raise EnvStateError(f"injected failure in {task.env}/{task.id}")
        return self.inner.step(action)

    def gold_actions(self, task: Task) -> list[str] | None:
        return self.inner.gold_actions(task)

    def close(self) -> None:
        self._released.set()
        self.inner.close()
