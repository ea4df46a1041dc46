"""ScienceWorld: the elementary-science text simulator (30 task kinds), over one JVM per instance.

The ``scienceworld`` package runs its Scala simulator in a JVM reached over py4j. One
instance holds one JVM (heap capped through ``JAVA_TOOL_OPTIONS``), started on first use,
reused across tasks and killed by ``close()``. Tasks are the package's own variations:
the first ``variations_per_task_train`` of each kind's *train* variations and the first
``variations_per_task_test`` of its *test* variations (None: all of them; the dev fold is
left out). Steps go straight to the simulator: the package's ``step`` makes four extra
round trips per step (look, inventory, task description, and the valid actions as a py4j
list, element by element), which would triple the cost of a step.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from typing import Any

from lifemem_ray.core.errors import ArgumentTypeError, InvalidArgumentError
from lifemem_ray.lab.envs.base import EnvStateError, EnvUnavailable, StepResult, Task, TaskError
from lifemem_ray.lab.envs.jvm import JvmSimulatorEnv, stop_simulator

__all__ = ["DEFAULT_TASK_NAMES", "ScienceWorldEnv"]

INSTALL = "pip install scienceworld  (and a Java 17 runtime: apt-get install -y openjdk-17-jre-headless)"

# Task kinds with short gold paths (2-33 actions on the default variations, "easy"):
# boil/melt/grow/mendelian/inclined-plane need 26-180 actions and are left to opt in.
DEFAULT_TASK_NAMES: tuple[str, ...] = (
    "find-living-thing",
    "find-non-living-thing",
    "find-plant",
    "find-animal",
    "lifespan-longest-lived",
    "lifespan-shortest-lived",
    "power-component",
    "test-conductivity",
    "use-thermometer",
    "chemistry-mix",
)
# The simulator's simplifications ("easy" = all of them); a comma-separated list of these.
SIMPLIFICATIONS = (
    "easy",
    "teleportAction",
    "selfWateringFlowerPots",
    "openContainers",
    "openDoors",
    "noElectricalAction",
)
_SPLITS = ("train", "test")
_MAX_ACTION_CHARS = 500


def _known_task_names() -> dict[str, str]:
    """Every spelling the package accepts (name, id, paper name) -> the simulator's name."""
    from scienceworld.constants import ID2TASK, NAME2ID
    from scienceworld.utils import infer_task

    known = {infer_task(name): infer_task(name) for name in ID2TASK.values()}
    known.update({key: infer_task(key) for key in list(ID2TASK) + list(NAME2ID)})
    return known


class ScienceWorldEnv(JvmSimulatorEnv):
    """ScienceWorld tasks as (kind, variation) pairs; environment name ``scienceworld``.

    Actions are the simulator's text commands ("open door to kitchen", "focus on
    thermometer"; after an ambiguous command, the number of the intended reading).
    ``info["valid_actions"]`` lists the simulator's valid action-object combinations (up to
    a few thousand; ``list_valid_actions=False`` skips them and makes a step ~3x cheaper).
    Reward is the change of the simulator's 0-100 score divided by 100; ``info["score"]``
    is that score / 100. Success: the task completed with score 100 (focusing on a wrong
    object ends it with a negative score). Gold actions: the simulator's generated gold path.
    """

    SIMULATOR = "ScienceWorld"
    INSTALL = INSTALL

    name = "scienceworld"

    def __init__(
        self,
        task_names: list[str] | None = None,
        variations_per_task_train: int | None = 5,
        variations_per_task_test: int | None = 2,
        simplification: str = "easy",
        java_heap_mb: int = 384,
        max_steps: int = 40,
        *,
        list_valid_actions: bool = True,
    ) -> None:
        try:
            import scienceworld  # noqa: F401  (lazy: this module imports without the package)
        except ImportError as exc:
            raise EnvUnavailable(
                f"scienceworld: the scienceworld package is missing ({exc}); install it with: {INSTALL}"
            ) from None
        java_home = os.environ.get("JAVA_HOME")
        java = os.path.join(java_home, "bin", "java") if java_home else shutil.which("java")
        if not java or not os.access(java, os.X_OK):
            where = f"$JAVA_HOME/bin/java ({java})" if java_home else "java on $PATH"
            raise EnvUnavailable(
                f"scienceworld: no Java runtime ({where} not found); install it with: apt-get install -y openjdk-17-jre-headless"
            )

        known = _known_task_names()
        names = list(DEFAULT_TASK_NAMES) if task_names is None else list(task_names)
        if not names:
            raise InvalidArgumentError("task_names must not be empty", where="ScienceWorldEnv")
        resolved: list[str] = []
        for name in names:
            if not isinstance(name, str) or name not in known:
                raise InvalidArgumentError(
                    f"unknown task name {name!r}; known: {', '.join(sorted(set(known.values())))}",
                    where="ScienceWorldEnv",
                )
            if known[name] not in resolved:
                resolved.append(known[name])
        for what, n in (
            ("variations_per_task_train", variations_per_task_train),
            ("variations_per_task_test", variations_per_task_test),
        ):
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
                raise InvalidArgumentError(
                    f"{what} must be an int >= 0 or None (every variation of the fold), got {n!r}",
                    where="ScienceWorldEnv",
                )
        if not isinstance(simplification, str):
            raise ArgumentTypeError(f"simplification must be a string, got {simplification!r}", where="ScienceWorldEnv")
        unknown = [s for s in simplification.split(",") if s and s not in SIMPLIFICATIONS]
        if unknown:
            raise InvalidArgumentError(
                f"unknown simplification(s) {unknown}; known: {', '.join(SIMPLIFICATIONS)} (comma-separated)",
                where="ScienceWorldEnv",
            )
        if isinstance(java_heap_mb, bool) or not isinstance(java_heap_mb, int) or java_heap_mb < 64:
            raise InvalidArgumentError(
                f"java_heap_mb must be an int >= 64, got {java_heap_mb!r}", where="ScienceWorldEnv"
            )
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
            raise InvalidArgumentError(f"max_steps must be an int >= 1, got {max_steps!r}", where="ScienceWorldEnv")

        self.task_names = resolved
        self.variations = {"train": variations_per_task_train, "test": variations_per_task_test}
        self.simplification = simplification
        self.java_heap_mb = java_heap_mb
        self.max_steps = max_steps
        self.list_valid_actions = list_valid_actions
        # Ids name the simplification when it is not the default, so tasks of both never mix.
        self._id_suffix = "" if simplification == "easy" else "-" + (simplification.replace(",", "+") or "none")
        self._simulator: Any = None  # the running simulator (JvmSimulatorEnv)
        self._loaded: tuple[str, int] | None = None
        self._splits: dict[str, dict[str, list[int]]] = {}
        self._instructions: dict[tuple[str, int], str] = {}
        self._gold: dict[tuple[str, int], list[str]] = {}
        self._task: Task | None = None
        self._history: list[str] = []
        self._done = True
        self._last_score = 0
        self._generation = 0  # counts loads, so a running episode knows when to replay
        self._episode_generation = 0

    # -- process --------------------------------------------------------------------------

    def _java_options(self) -> str:
        return f"-Xmx{self.java_heap_mb}m -XX:+UseSerialGC -XX:MinHeapFreeRatio=10 -XX:MaxHeapFreeRatio=30"

    def _new_simulator(self) -> Any:
        from scienceworld import ScienceWorldEnv as _SW

        return _SW("", envStepLimit=10**9)  # our own max_steps ends episodes

    def _load(self, task_name: str, variation: int, gold: bool = False) -> Any:
        sw = self._sim()
        try:
            sw.load(task_name, variation, self.simplification, generateGoldPath=gold)
        except ValueError as exc:  # the package's message names the bad name or simplification
            raise TaskError(f"cannot load {task_name!r} variation {variation}: {exc}", where="scienceworld") from None
        except Exception as exc:
            if self.jvm_pid is None:
                raise EnvStateError(
                    f"the JVM died while loading {task_name!r} variation {variation}: {exc}",
                    where="scienceworld",
                ) from exc
            raise TaskError(
                f"the simulator rejected {task_name!r} variation {variation}: {exc}",
                where="scienceworld",
            ) from None
        self._loaded = (task_name, variation)
        self._generation += 1  # any running episode's state is gone
        return sw

    def _stop(self, sim: Any) -> None:
        """Stop the JVM, then remove the object-tree folder the package keeps."""
        tempdir = getattr(sim, "_obj_tree_tempdir", None)
        stop_simulator(sim)
        if tempdir is not None:
            tempdir.cleanup()

    # -- tasks ----------------------------------------------------------------------------

    def _variations(self, task_name: str, split: str) -> list[int]:
        """The package's variation fold for a task kind (asks the simulator once per kind)."""
        if task_name not in self._splits:
            sw = self._load(task_name, 0)
            self._splits[task_name] = {
                "train": sorted(int(v) for v in sw.get_variations_train()),
                "test": sorted(int(v) for v in sw.get_variations_test()),
            }
        return self._splits[task_name][split]

    def _instruction(self, task_name: str, variation: int) -> str:
        key = (task_name, variation)
        if key not in self._instructions:
            sw = self._load(task_name, variation)
            self._instructions[key] = str(sw.get_task_description()).strip()
        return self._instructions[key]

    def tasks(self, split: str = "train", limit: int | None = None, seed: int = 0) -> list[Task]:
        """The split's tasks shuffled by ``seed`` (ids ``<kind>-<split>-<variation>``).

        Only the returned tasks are loaded for their instruction (~0.1-0.5 s each, cached).
        """
        if split not in _SPLITS:
            raise InvalidArgumentError(f"split must be 'train' or 'test', got {split!r}", where="scienceworld")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise InvalidArgumentError(f"limit must be an int >= 0 or None, got {limit!r}", where="scienceworld")
        try:
            keys: list[tuple[str, int]] = []
            for name in self.task_names:
                available = self._variations(name, split)
                n = self.variations[split]
                if n is None:
                    n = len(available)
                elif n > len(available):
                    raise InvalidArgumentError(
                        f"{name} has {len(available)} {split} variations, asked for {n}",
                        where="scienceworld",
                    )
                keys.extend((name, v) for v in available[:n])
            random.Random(seed).shuffle(keys)
            if limit is not None:
                keys = keys[:limit]
            return [
                Task(
                    env=self.name,
                    id=f"{name}-{split}-{variation}{self._id_suffix}",
                    instruction=self._instruction(name, variation),
                    split=split,
                    payload={"task_name": name, "variation": variation, "simplification": self.simplification},
                    metadata={"task_type": name, "variation": variation, "simplification": self.simplification},
                )
                for name, variation in keys
            ]
        finally:
            self._restore()  # the simulator's task changed under any running episode

    # -- episodes -------------------------------------------------------------------------

    def _check(self, task: Task) -> tuple[str, int]:
        if not isinstance(task, Task):
            raise TaskError(f"expected a Task, got {type(task).__name__}", where="scienceworld")
        if task.env != self.name:
            raise TaskError(f"task {task.id!r} belongs to environment {task.env!r}", where="scienceworld")
        p = task.payload
        name, variation, simp = p.get("task_name"), p.get("variation"), p.get("simplification", self.simplification)
        if not isinstance(name, str) or name not in _known_task_names().values():
            raise TaskError(
                f"task {task.id!r} payload.task_name {name!r} is not a ScienceWorld task kind",
                where="scienceworld",
            )
        if isinstance(variation, bool) or not isinstance(variation, int) or variation < 0:
            raise TaskError(
                f"task {task.id!r} payload.variation must be an int >= 0, got {variation!r}", where="scienceworld"
            )
        if simp != self.simplification:
            raise TaskError(
                f"task {task.id!r} was made with simplification {simp!r}; this instance uses {self.simplification!r}",
                where="scienceworld",
            )
        return name, variation

    def _start(self, name: str, variation: int) -> str:
        """Load and reset the simulator; the observation of the first 'look around'."""
        sw = self._load(name, variation)
        sw.server.reset()
        sw.lastStepScore = 0
        return str(sw.server.step("look around"))

    def _valid_actions(self) -> list[str] | None:
        if not self.list_valid_actions:
            return None
        raw = json.loads(self._simulator.server.getValidActionObjectCombinationsJSON())
        return sorted({str(entry["action"]) for entry in raw.get("validActions", [])})

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Load the task's variation and look around (the first observation)."""
        key = self._check(task)
        self._task = None
        observation = self._start(*key)
        self._episode_generation = self._generation
        self._task = task
        self._history = []
        self._done = False
        self._last_score = 0
        info = {
            "instruction": task.instruction or str(self._simulator.get_task_description()),
            "valid_actions": self._valid_actions(),
            "success": None,
            "score": 0.0,
        }
        return observation, info

    def step(self, action: str) -> StepResult:
        """Apply one command; anything unparsable gets the simulator's 'No known action' answer."""
        if self._task is None or self._simulator is None:
            raise EnvStateError("step() before reset()", where="scienceworld")
        if self._done:
            return StepResult(
                "The episode is over; call reset() for a new task.",
                0.0,
                True,
                {"instruction": self._task.instruction, "valid_actions": [], "success": None},
            )
        if not isinstance(action, str):
            action = "" if action is None else str(action)
        cleaned = " ".join(action.split())[:_MAX_ACTION_CHARS]  # one line: the parser rejects anything else
        self._history.append(cleaned)
        server = self._simulator.server
        from py4j.protocol import Py4JJavaError

        try:
            observation = str(server.step(cleaned))
        except Py4JJavaError as exc:  # the simulator threw on this input: the episode goes on
            observation = f"Invalid action {cleaned!r}: the simulator could not parse it ({exc.java_exception})."
        except Exception as exc:
            raise EnvStateError(
                f"the JVM (pid {self.jvm_pid}) failed on step {cleaned!r}: {type(exc).__name__}: {exc}",
                where="scienceworld",
            ) from exc
        if not cleaned:
            observation = "Invalid action: the action is empty. " + observation
        score = round(100 * float(server.getScore()))
        completed = bool(server.getCompleted())
        reward, self._last_score = (score - self._last_score) / 100.0, score
        won = score >= 100
        done = won or completed or score < 0 or len(self._history) >= self.max_steps
        self._done = done
        info: dict[str, Any] = {
            "instruction": self._task.instruction,
            "valid_actions": [] if done else self._valid_actions(),
            "success": won if done else None,
            "score": score / 100.0,
        }
        return StepResult(observation, reward, done, info)

    def _restore(self) -> None:
        """Replay the running episode after the simulator was used for something else."""
        if (
            self._task is not None
            and not self._done
            and self._simulator is not None
            and self._generation != self._episode_generation
        ):
            from py4j.protocol import Py4JJavaError

            self._start(*self._check(self._task))
            for action in self._history:
                try:
                    self._simulator.server.step(action)
                except Py4JJavaError:  # it threw the first time too
                    pass
            self._episode_generation = self._generation

    def gold_actions(self, task: Task) -> list[str] | None:
        """The simulator's gold path (generating it costs 0.3-3 s); a running episode stays intact."""
        key = self._check(task)
        if key not in self._gold:
            try:
                sw = self._load(*key, gold=True)
                gold = [str(a) for a in sw.get_gold_action_sequence()]
            finally:
                self._restore()
            if gold and gold[0].startswith("ERROR"):
                return None
            if len(self._gold) >= 4096:  # bounded: long runs see many tasks
                self._gold.clear()
            self._gold[key] = gold
        return list(self._gold[key])
