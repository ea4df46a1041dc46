"""ALFWorld on its real TextWorld PDDL engine, from the game files of the three validation splits.

``alfworld-download`` cannot reach its server here; the shared folder holds the 582 game
files (``json_2.1.1/<split>/<task>/<trial>/game.tw-pddl``, domain and grammar embedded).
Like ALFWorld itself, only games marked solvable and without movable/sliced objects are
used (474). The partition is fixed by the source split: **train = valid_train + valid_seen
(340 games), test = valid_unseen (134 games, unseen rooms: ALFWorld's out-of-distribution
evaluation set)**.

Costs (CPU, measured on the 2-core dev machine): loading a game translates its PDDL to SAS
twice (0.5-4 s, pure Python, larger for kitchens); a step costs 50-200 ms (the engine
re-derives the text of every admissible command); the planner behind ``gold_actions`` takes
0.1-12 s per game, so it runs only when asked and its plans are cached per game file. Two
process-wide memos, installed on first use, cut this: the PDDL->SAS translation (a small
LRU: a reset after load, or of a recent game, skips it) and the grammar's template parser
(about half the step cost; the text produced is unchanged). The translator's ``sys.argv``
rewrite (a fast-downward hack) is undone after every call.
"""

from __future__ import annotations

import collections
import json
import os
import random
import re
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lifemem_ray.core.errors import InvalidArgumentError
from lifemem_ray.core.lru import LruCache
from lifemem_ray.lab.envs.base import Environment, EnvStateError, EnvUnavailable, StepResult, Task, TaskError
from lifemem_ray.lab.envs.shared_data import find_data_dir

__all__ = ["TASK_TYPES", "TEST_SOURCES", "TRAIN_SOURCES", "AlfWorldEnv"]

INSTALL = "pip install alfworld  (builds fast-downward: needs a C/C++ compiler and cmake; about 400 MB)"
TASK_TYPES = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)
TRAIN_SOURCES = ("valid_train", "valid_seen")
TEST_SOURCES = ("valid_unseen",)
_GAME = "game.tw-pddl"
_GOAL = re.compile(r'"task"\s*:\s*\[\s*\{\s*"rhs"\s*:\s*"Your task is to: ([^"]+)"')
_BANNER = "-= Welcome to TextWorld, ALFRED! =-"


def _default_data_dir() -> Path | None:
    """ALFWORLD_DATA, else the shared folder's ``data/alfworld`` (:mod:`lifemem_ray.lab.envs.shared_data`)."""
    return find_data_dir("ALFWORLD_DATA", Path("data") / "alfworld", "json_2.1.1")


# -- the game index (shared by all instances: it reads 474 files once) ---------------------

_INDEX: dict[Path, tuple[list[dict[str, str]], list[str]]] = {}
_INDEX_LOCK = threading.Lock()


def _index(root: Path) -> tuple[list[dict[str, str]], list[str]]:
    """(games, skipped): every usable game with its split, task type and goal text."""
    with _INDEX_LOCK:
        if root in _INDEX:
            return _INDEX[root]
        games: list[dict[str, str]] = []
        skipped: list[str] = []
        for source in TRAIN_SOURCES + TEST_SOURCES:
            for path in sorted((root / "json_2.1.1" / source).glob(f"*/*/{_GAME}")):
                rel = path.relative_to(root).as_posix()
                task_dir = path.parent.parent.name
                if "movable" in task_dir or "Sliced" in task_dir:
                    continue  # ALFWorld's own filter: the text engine does not support them
                try:
                    data = json.loads(path.read_text(encoding="utf-8"))
                except (OSError, ValueError) as exc:
                    skipped.append(f"{rel}: unreadable ({exc})")
                    continue
                if data.get("solvable") is not True:
                    continue  # marked unsolvable (or never checked) by ALFWorld's generator
                goal = _GOAL.search(data.get("grammar", ""))
                task_type = task_dir.split("-", 1)[0]
                if goal is None or task_type not in TASK_TYPES:
                    skipped.append(f"{rel}: no goal text or unknown task type {task_type!r}")
                    continue
                games.append(
                    {
                        "rel": rel,
                        "source": source,
                        "task_type": task_type,
                        "instruction": goal.group(1).strip(),
                        "id": f"{source}/{task_dir}/{path.parent.name}",
                    }
                )
        _INDEX[root] = (games, skipped)
        return games, skipped


# -- fast-downward translation: memoised, sys.argv protected ----------------------------------

_SAS_LOCK = threading.RLock()  # the translator keeps global options: one translation at a time
_SAS_CACHE: LruCache[tuple, Any] = LruCache(16, "pddl2sas memo")  # 2 entries a game (plain + optimised): the last 8


def _install_sas_memo() -> None:
    """Wrap ``fast_downward.pddl2sas`` once: same (domain, problem, options) -> same result."""
    import fast_downward

    original: Callable[..., Any] = fast_downward.pddl2sas
    if getattr(original, "_lifemem_memo", False):
        return

    def pddl2sas(domain: str, problem: str, verbose: bool = False, optimize: bool = False) -> Any:
        key = (hash(domain), len(domain), hash(problem), len(problem), bool(verbose), bool(optimize))
        with _SAS_LOCK:
            hit = _SAS_CACHE.get(key)
            if hit is not None and hit[0] == (domain, problem):
                return hit[1]
            argv = sys.argv
            try:
                result = original(domain, problem, verbose=verbose, optimize=optimize)
            finally:
                sys.argv = argv  # the translator overwrites sys.argv with its own arguments
            _SAS_CACHE.put(key, ((domain, problem), result))
            return result

    pddl2sas._lifemem_memo = True  # type: ignore[attr-defined]
    fast_downward.pddl2sas = pddl2sas


_PARSE_CACHE: LruCache[tuple[str, str], Any] = LruCache(8192, "text-template parse memo")


def _install_textgen_memo() -> None:
    """Memoise the grammar's text-template parser (a TatSu parse per admissible command per step).

    ``derive`` mutates the symbols it gets, so each hit is a deep copy; the derived text is
    unchanged (checked against the unpatched engine), a step costs about half the CPU.
    """
    import copy

    from textworld.envs.pddl import textgen

    original: Callable[..., Any] = getattr(textgen, "_parse_and_convert", None)  # type: ignore[assignment]
    if original is None or getattr(original, "_lifemem_memo", False):
        return

    def _parse_and_convert(text: str, rule_name: str = "symbols", **kwargs: Any) -> Any:
        if kwargs.get("trace") or not isinstance(text, str) or set(kwargs) - {"trace"}:
            return original(text, rule_name=rule_name, **kwargs)
        key = (text, rule_name)
        hit = _PARSE_CACHE.get(key)
        if hit is None:
            hit = original(text, rule_name=rule_name)
            _PARSE_CACHE.put(key, hit)
        return copy.deepcopy(hit)

    _parse_and_convert._lifemem_memo = True  # type: ignore[attr-defined]
    textgen._parse_and_convert = _parse_and_convert


# Gold plans per game file (absolute path): planning costs up to ~10 s CPU on a large kitchen.
_GOLD: LruCache[str, list[str]] = LruCache(4096, "ALFWorld gold plans")


class AlfWorldEnv(Environment):
    """ALFWorld's six household task types as text games; environment name ``alfworld``.

    Actions are ALFWorld commands (``go to desk 1``, ``take mug 1 from desk 1``,
    ``put mug 1 in/on shelf 1``, ``heat/cool/clean X with Y``, ``use desklamp 1``,
    ``open``/``close``/``examine``, ``look``, ``inventory``); ``info["valid_actions"]``
    lists the admissible ones; an inadmissible one gets "Nothing happens." Success is the
    engine's ``won`` (the PDDL goal holds). Gold actions: the fast-downward planner's plan
    from the initial state (the game's walkthrough). ``seed`` is accepted for the common
    constructor signature; the engine and the partition are deterministic.
    """

    name = "alfworld"

    def __init__(self, data_dir: str | os.PathLike[str] | None = None, max_steps: int = 50, seed: int = 0) -> None:
        if not isinstance(max_steps, int) or max_steps < 1:
            raise InvalidArgumentError(f"max_steps must be an int >= 1, got {max_steps!r}", where="AlfWorldEnv")
        root = Path(data_dir) if data_dir is not None else _default_data_dir()
        if root is None or not (root / "json_2.1.1").is_dir():
            where = root if root is not None else "ALFWORLD_DATA / <shared>/data/alfworld"
            raise EnvUnavailable(
                f"alfworld: no game files at {where} (expected json_2.1.1/<split>/<task>/<trial>/{_GAME}); "
                "point data_dir or ALFWORLD_DATA at a copy of the shared data/alfworld folder"
            )
        self.data_dir = root.resolve()
        # Importing alfworld sets ALFWORLD_DATA process-wide (and creates ~/.cache/alfworld when
        # unset): point it at our folder for the import, then put the variable back.
        previous = os.environ.get("ALFWORLD_DATA")
        os.environ["ALFWORLD_DATA"] = str(self.data_dir)
        try:  # lazy: the module imports without the packages
            import fast_downward  # noqa: F401
            import textworld  # noqa: F401
            from alfworld.agents.environment import alfred_tw_env  # noqa: F401
        except ImportError as exc:
            raise EnvUnavailable(f"alfworld: a package is missing ({exc}); install with: {INSTALL}") from None
        finally:
            if previous is None:
                os.environ.pop("ALFWORLD_DATA", None)
            else:
                os.environ["ALFWORLD_DATA"] = previous
        self.max_steps = max_steps
        self.seed = seed
        games, self.skipped = _index(self.data_dir)
        if not games:
            raise EnvUnavailable(f"alfworld: no usable games under {self.data_dir / 'json_2.1.1'}")
        self._tasks: dict[str, list[Task]] = {"train": [], "test": []}
        for g in games:
            split = "train" if g["source"] in TRAIN_SOURCES else "test"
            self._tasks[split].append(self._task_of(g, split))
        for split, tasks in self._tasks.items():
            self._tasks[split] = self._interleave(tasks)
        self._engine: Any = None
        self._infos: Any = None  # the engine's EnvInfos (its extras toggle the planner)
        self._loaded: str | None = None  # rel path of the game in the engine
        self._task: Task | None = None
        self._history: list[str] = []
        self._admissible: list[str] = []
        self._done = True

    @staticmethod
    def _task_of(game: dict[str, str], split: str) -> Task:
        return Task(
            env="alfworld",
            id=game["id"],
            instruction=game["instruction"],
            split=split,
            payload={"game_file": game["rel"]},
            metadata={"task_type": game["task_type"], "source_split": game["source"]},
        )

    @staticmethod
    def _interleave(tasks: list[Task]) -> list[Task]:
        """Round robin over task types (each in path order): any prefix mixes all six."""
        by_type: dict[str, list[Task]] = collections.defaultdict(list)
        for t in sorted(tasks, key=lambda t: t.id):
            by_type[t.metadata["task_type"]].append(t)
        queues = [collections.deque(by_type[k]) for k in TASK_TYPES if by_type.get(k)]
        out: list[Task] = []
        while queues:
            for q in list(queues):
                out.append(q.popleft())
                if not q:
                    queues.remove(q)
        return out

    def tasks(self, split: str = "train", limit: int | None = None, seed: int = 0) -> list[Task]:
        """The split's games: task types interleaved for ``seed=0``, else shuffled by ``seed``."""
        if split not in self._tasks:
            raise InvalidArgumentError(f"split must be 'train' or 'test', got {split!r}", where="AlfWorldEnv.tasks")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise InvalidArgumentError(
                f"limit must be None or an integer >= 0, got {limit!r}", where="AlfWorldEnv.tasks"
            )
        out = list(self._tasks[split])
        if seed:
            random.Random(seed).shuffle(out)
        return out if limit is None else out[:limit]

    # -- engine ---------------------------------------------------------------------------

    def _make_engine(self) -> Any:
        import textworld
        from alfworld.agents.environment.alfred_tw_env import (
            AlfredDemangler,
            AlfredInfos,
        )
        from textworld.envs.pddl import PddlEnv

        _install_sas_memo()
        _install_textgen_memo()
        # The walkthrough (a fast-downward plan) is asked for only when gold_actions needs it.
        self._infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=[])
        argv = sys.argv
        try:
            return AlfredInfos(AlfredDemangler(PddlEnv(self._infos)))
        finally:
            sys.argv = argv

    def _start(self, rel: str, plan: bool = False) -> Any:
        """Load (if another game is loaded) and reset ``rel``; the engine's first state.

        ``plan``: also run the planner (the state's ``extra.walkthrough``).
        """
        if self._engine is None:
            self._engine = self._make_engine()
        argv = sys.argv
        self._infos.extras = ["walkthrough"] if plan else []
        try:
            if self._loaded != rel:
                self._loaded = None
                self._engine.load(str(self.data_dir / rel))
                self._loaded = rel
            return self._engine.reset()
        except Exception as exc:
            self._loaded, self._done = None, True  # the engine's state is unknown now
            raise TaskError(
                f"the engine cannot load game {self.data_dir / rel}: {type(exc).__name__}: {exc}",
                where="alfworld",
            ) from exc
        finally:
            sys.argv = argv  # belt and braces: the translator rewrites sys.argv
            self._infos.extras = []

    def _check(self, task: Task) -> str:
        if not isinstance(task, Task):
            raise TaskError(f"expected a Task, got {type(task).__name__}", where="AlfWorldEnv")
        if task.env != self.name:
            raise TaskError(
                f"task {task.id!r} belongs to environment {task.env!r}, not 'alfworld'", where="AlfWorldEnv"
            )
        rel = task.payload.get("game_file")
        if not isinstance(rel, str) or not rel.endswith(_GAME) or ".." in Path(rel).parts or Path(rel).is_absolute():
            raise TaskError(
                f"task {task.id!r} payload.game_file must be a path under the data folder ending in {_GAME}, got {rel!r}",
                where="AlfWorldEnv",
            )
        if not (self.data_dir / rel).is_file():
            raise TaskError(f"task {task.id!r}: game file {self.data_dir / rel} not found", where="AlfWorldEnv")
        return rel

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        rel = self._check(task)
        state = self._start(rel)
        self._task, self._history, self._done = task, [], False
        self._admissible = list(state["admissible_commands"])
        observation = str(state.feedback).replace(_BANNER, "").strip()
        return observation, {
            "instruction": task.instruction,
            "valid_actions": list(self._admissible),
            "success": None,
            "task_type": task.metadata.get("task_type"),
        }

    def _normalise(self, action: Any) -> str:
        """One line, lower case, no trailing period; ``put X in Y``/``move X to Y`` -> ``put X in/on Y``."""
        text = " ".join(str(action if action is not None else "").split()).lower().rstrip(".")
        if text in self._admissible:
            return text
        m = re.fullmatch(r"(?:put|move|place) (.+?) (?:in|on|into|onto|to|in/on) (.+)", text)
        if m:
            alias = f"put {m.group(1)} in/on {m.group(2)}"
            if alias in self._admissible:
                return alias
        return text

    def step(self, action: str) -> StepResult:
        if self._task is None:
            raise EnvStateError("step() before reset()", where="AlfWorldEnv")
        info: dict[str, Any] = {"instruction": self._task.instruction}
        if self._done:
            return StepResult(
                "The episode is over; call reset() for a new task.",
                0.0,
                True,
                {**info, "valid_actions": [], "success": None},
            )
        command = self._normalise(action)[:500]
        self._history.append(command)
        if command in self._admissible:
            state, score, _ = self._engine.step(command)
            observation = str(state.feedback).strip()
            self._admissible = list(state["admissible_commands"])
            won = bool(state["won"])
        else:  # what the engine would answer, without its cost (it re-derives every command)
            observation, score, won = "Nothing happens.", 0, False
            if not command:
                observation = "Nothing happens. (The action was empty.)"
        done = won or len(self._history) >= self.max_steps
        self._done = done
        info.update(valid_actions=list(self._admissible), success=won if done else None, score=float(score))
        return StepResult(observation, 1.0 if won else 0.0, done, info)

    def gold_actions(self, task: Task) -> list[str] | None:
        """The planner's plan from the initial state (cached per game file; a running episode
        is replayed afterwards, so it stays intact). None when the planner finds no plan."""
        rel = self._check(task)
        key = str(self.data_dir / rel)
        plan = _GOLD.get(key)
        if plan is None:
            state = self._start(rel, plan=True)
            plan = [str(a) for a in (state.get("extra.walkthrough") or [])]
            _GOLD.put(key, plan)
            if self._task is not None and not self._done:  # put the running episode back
                current = self._check(self._task)
                if current != rel or self._history:
                    state = self._start(current)
                    for command in self._history:
                        if command in state["admissible_commands"]:
                            state, _, _ = self._engine.step(command)
        return list(plan) or None

    def close(self) -> None:
        """Free the engine: the game state and the planner's memory in its fast-downward copy.

        The library copy itself stays mapped (a few MB; TextWorld never unloads it either):
        ``dlclose`` on a copy that has run a game crashes the interpreter at exit.
        """
        engine, self._engine = self._engine, None
        self._loaded, self._task, self._done, self._history = None, None, True, []
        if engine is None:
            return
        inner = engine
        while hasattr(inner, "_wrapped_env"):
            inner = inner._wrapped_env
        lib = getattr(inner, "downward_lib", None)
        try:
            engine.close()
        except Exception:  # noqa: BLE001, S110 - a broken engine: what it holds is released below
            pass
        if lib is not None:
            try:
                lib.cleanup()
            except Exception:  # noqa: BLE001, S110 - best effort: the references are dropped anyway
                pass
            inner.downward_lib = None
            inner._pddl_state = None
