"""TextWorldExpress: the fast, JVM-backed text games (coin, cooking, sorting ...), one per variant.

The package runs its simulator in a JVM reached over py4j; one instance holds one JVM
(about 150 MB with the heap capped), started on first use and stopped by ``close()``.
Steps go straight to the simulator's JSON call (the package's own ``step`` makes a
second round trip per step for the task description), so a step costs well under a
millisecond. Each variant has a small default game configuration so episodes stay short;
keyword options override it (``numLocations=6``) and end up in ``Task.payload``.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from typing import Any

from lifemem_ray.core.errors import ArgumentTypeError, InvalidArgumentError
from lifemem_ray.lab.envs.base import (
    EnvStateError,
    EnvUnavailable,
    StepResult,
    Task,
    TaskError,
    check_task,
    select_tasks,
)
from lifemem_ray.lab.envs.jvm import JvmSimulatorEnv

__all__ = ["DEFAULT_GAME_PARAMS", "VARIANTS", "TextWorldExpressEnv"]

INSTALL = "pip install textworld-express  (and a Java 17 runtime: apt-get install -y openjdk-17-jre-headless)"

# Small configurations: gold paths of 5-20 steps. Keys are the simulator's own parameter names.
DEFAULT_GAME_PARAMS: dict[str, dict[str, int]] = {
    "coin": {"numLocations": 4, "numDistractorItems": 0, "includeDoors": 0, "limitInventorySize": 0},
    "cookingworld": {
        "numLocations": 1,
        "numIngredients": 2,
        "numDistractorItems": 0,
        "includeDoors": 0,
        "limitInventorySize": 0,
    },
    "twc": {"numLocations": 1, "numItemsToPutAway": 2, "includeDoors": 0, "limitInventorySize": 0},
    "mapreader": {
        "numLocations": 8,
        "maxDistanceApart": 3,
        "maxDistractorItemsPerLocation": 0,
        "includeDoors": 0,
        "limitInventorySize": 0,
    },
    "arithmetic": {},
    "sorting": {},
    "simonsays": {"gameLength": 5, "numDistractors": 3},
    "peckingorder": {},
}
VARIANTS = tuple(DEFAULT_GAME_PARAMS)

# Steps per episode: about twice the longest gold path seen with the default configuration.
_MAX_STEPS = {
    "coin": 40,
    "cookingworld": 40,
    "twc": 25,
    "mapreader": 30,
    "arithmetic": 15,
    "sorting": 20,
    "simonsays": 15,
    "peckingorder": 25,
}

_FOLDS = {"train": "train", "test": "test"}  # our split -> the package's seed fold


_loads: Callable[[str | bytes], Any]  # one JSON text to its value
try:  # the package uses orjson when present
    from orjson import loads as _loads
except ImportError:  # pragma: no cover
    from json import loads as _loads


def _params_str(params: dict[str, int]) -> str:
    return ",".join(f"{k}={params[k]}" for k in sorted(params))


class TextWorldExpressEnv(JvmSimulatorEnv):
    """One TextWorldExpress game family (``variant``); environment name ``twx-<variant>``.

    Tasks are the package's own seeds: the first ``n_train`` train-fold seeds and the first
    ``n_test`` test-fold seeds (``seed`` != 0 draws a seeded sample of them instead). Actions
    are the game's text commands; ``info["valid_actions"]`` lists them; success is the
    game's ``tasksuccess``; gold actions are the game's generated gold path.
    """

    SIMULATOR = "TextWorldExpress"
    INSTALL = INSTALL

    def __init__(
        self,
        variant: str = "coin",
        seed: int = 0,
        n_train: int = 60,
        n_test: int = 20,
        *,
        max_steps: int | None = None,
        jvm_heap_mb: int = 256,
        **game_params: int,
    ) -> None:
        if variant not in DEFAULT_GAME_PARAMS:
            raise InvalidArgumentError(
                f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}",
                where="TextWorldExpressEnv",
            )
        for what, n in (("n_train", n_train), ("n_test", n_test)):
            if not isinstance(n, int) or not 1 <= n <= 1000:
                raise InvalidArgumentError(
                    f"{what} must be an int in 1..1000 (seeds per fold), got {n!r}",
                    where="TextWorldExpressEnv",
                )
        for key, value in game_params.items():
            if isinstance(value, bool) or not isinstance(value, int):
                raise ArgumentTypeError(
                    f"TextWorldExpressEnv({variant}): game parameter {key}={value!r} must be an int"
                )
        try:
            import textworld_express  # noqa: F401  (lazy: the module imports without the package)
        except ImportError as exc:
            raise EnvUnavailable(
                f"twx-{variant}: the textworld_express package is missing ({exc}); install it with: {INSTALL}"
            ) from None
        self.variant = variant
        self.name = f"twx-{variant}"
        self.seed = seed
        self.n_train = n_train
        self.n_test = n_test
        self.max_steps = max_steps if max_steps is not None else _MAX_STEPS[variant]
        if self.max_steps < 1:
            raise InvalidArgumentError(f"max_steps must be >= 1, got {self.max_steps}", where="TextWorldExpressEnv")
        self.jvm_heap_mb = jvm_heap_mb
        self.game_params = {**DEFAULT_GAME_PARAMS[variant], **game_params}
        self._params_str = _params_str(self.game_params)
        self._id_suffix = ""
        if game_params and self.game_params != DEFAULT_GAME_PARAMS[variant]:
            self._id_suffix = "-p" + hashlib.sha1(self._params_str.encode()).hexdigest()[:8]
        self._simulator: Any = None  # the running simulator (JvmSimulatorEnv)
        self._loaded: tuple[str, str] | None = None
        self._tasks: dict[str, list[Task]] = {}
        self._gold: dict[tuple[str, int, str, str], list[str]] = {}
        self._task: Task | None = None
        self._history: list[str] = []
        self._done = True
        self._last_score = 0.0

    # -- process --------------------------------------------------------------------------

    def _java_options(self) -> str:
        return f"-Xmx{int(self.jvm_heap_mb)}m -XX:+UseSerialGC -XX:TieredStopAtLevel=1"

    def _new_simulator(self) -> Any:
        from textworld_express import TextWorldExpressEnv as _TWX

        return _TWX(envStepLimit=10**9)  # our own max_steps ends episodes

    def _load(self, game: str, params: str) -> Any:
        twx = self._sim()
        if self._loaded != (game, params):
            try:
                twx.load(game, params)
            except ValueError as exc:  # the simulator's message names the bad parameter
                self._loaded = None  # the simulator may hold a half-loaded game now
                raise TaskError(f"{self.name}: game {game!r} rejects parameters {params!r}: {exc}") from None
            self._loaded = (game, params)
        return twx

    # -- tasks ----------------------------------------------------------------------------

    def _game_seeds(self, split: str) -> list[int]:
        twx = self._load(self.variant, self._params_str)
        seeds = sorted(twx.getValidSeedsTrain() if split == "train" else twx.getValidSeedsTest())
        n = self.n_train if split == "train" else self.n_test
        if n > len(seeds):
            raise InvalidArgumentError(f"{self.name}: {split} has {len(seeds)} seeds, asked for {n}")
        if self.seed == 0:
            return seeds[:n]
        return sorted(random.Random(self.seed).sample(seeds, n))

    def _build_tasks(self, split: str) -> list[Task]:
        twx = self._load(self.variant, self._params_str)
        fold = _FOLDS[split]
        out: list[Task] = []
        for game_seed in self._game_seeds(split):
            twx.reset(seed=game_seed, gameFold=fold, generateGoldPath=False)
            instruction = str(twx.getTaskDescription()).strip()
            props = twx.getGenerationProperties()
            out.append(
                Task(
                    env=self.name,
                    id=f"{self.variant}-{split}-{game_seed}{self._id_suffix}",
                    instruction=instruction,
                    split=split,
                    payload={
                        "game": self.variant,
                        "seed": int(game_seed),
                        "fold": fold,
                        "params": dict(self.game_params),
                    },
                    metadata={
                        "task_type": self.variant,
                        "generation": {k: v for k, v in props.items() if isinstance(v, (int, str))},
                    },
                )
            )
        self._restore()  # the simulator's game changed under any running episode
        return out

    def tasks(self, split: str = "train", limit: int | None = None, seed: int = 0) -> list[Task]:
        """The split's tasks: game-seed order for ``seed=0``, else shuffled by ``seed``.

        Ids are ``<variant>-<split>-<game seed>`` (plus a parameter digest for non-default
        game parameters), so they stay stable across runs and instances.
        """
        if split in _FOLDS and split not in self._tasks:
            self._tasks[split] = self._build_tasks(split)
        return select_tasks(self.name, {fold: self._tasks.get(fold, ()) for fold in _FOLDS}, split, limit, seed)

    # -- episodes -------------------------------------------------------------------------

    def _check(self, task: Task) -> tuple[str, int, str, str]:
        check_task(self.name, task, self.name)
        p = task.payload
        game, seed, fold, params = p.get("game"), p.get("seed"), p.get("fold"), p.get("params", {})
        if game != self.variant:
            raise TaskError(f"{self.name}: task {task.id!r} payload.game is {game!r}, expected {self.variant!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise TaskError(f"{self.name}: task {task.id!r} payload.seed must be a non-negative int, got {seed!r}")
        if fold not in ("train", "dev", "test"):
            raise TaskError(f"{self.name}: task {task.id!r} payload.fold must be train/dev/test, got {fold!r}")
        if not isinstance(params, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in params.items()
        ):
            raise TaskError(f"{self.name}: task {task.id!r} payload.params must map names to ints, got {params!r}")
        return game, seed, fold, _params_str(params)

    def _start(self, game: str, seed: int, fold: str, params: str, gold: bool) -> dict[str, Any]:
        twx = self._load(game, params)
        _, info = twx.reset(seed=seed, gameFold=fold, generateGoldPath=gold)
        return info

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        key = self._check(task)
        raw = self._start(*key, gold=True)  # the gold path costs ~0.5 ms; gold_actions() follows reset()
        self._remember_gold(key)
        self._task = task
        self._history = []
        self._done = False
        self._last_score = 0.0
        info = {
            "instruction": task.instruction or str(raw.get("taskDescription", "")),
            "valid_actions": sorted(raw["validActions"]),
            "success": None,
            "score": float(raw.get("score", 0.0)),
        }
        return str(raw["observation"]), info

    def step(self, action: str) -> StepResult:
        if self._task is None or self._simulator is None:
            raise EnvStateError(f"{self.name}: step() before reset()")
        if self._done:
            return StepResult(
                "The episode is over; call reset() for a new task.",
                0.0,
                True,
                {"instruction": self._task.instruction, "valid_actions": [], "success": None},
            )
        if not isinstance(action, str):
            action = "" if action is None else str(action)
        # One line, printable: the simulator's parser would only reject anything else anyway.
        cleaned = " ".join(action.split())[:500]
        self._history.append(cleaned)
        raw = _loads(self._simulator.server.stepJSON(cleaned))
        observation = str(raw["observation"])
        if not cleaned:
            observation = "Invalid action: the action is empty. " + observation
        score = float(raw.get("score", 0.0))
        reward, self._last_score = score - self._last_score, score
        won = bool(raw.get("tasksuccess"))
        lost = bool(raw.get("taskfailure"))
        done = won or lost or score >= 1.0 or len(self._history) >= self.max_steps
        self._done = done
        info: dict[str, Any] = {
            "instruction": self._task.instruction,
            "valid_actions": sorted(raw["validActions"]),
            "success": (won or score >= 1.0) if done else None,
            "score": score,
        }
        return StepResult(observation, reward, done, info)

    def _restore(self) -> None:
        """Replay the running episode after the simulator was used for something else."""
        if self._task is not None and not self._done:
            self._start(*self._check(self._task), gold=False)
            for action in self._history:
                self._simulator.server.stepJSON(action)

    def gold_actions(self, task: Task) -> list[str] | None:
        """The game's gold path; computing it for another task keeps a running episode intact."""
        key = self._check(task)
        if key not in self._gold:
            self._start(*key, gold=True)
            self._remember_gold(key)
            self._restore()
        return list(self._gold[key])

    def _remember_gold(self, key: tuple[str, int, str, str]) -> None:
        if len(self._gold) >= 4096:  # bounded: long runs see many tasks
            self._gold.clear()
        self._gold[key] = [str(a) for a in self._simulator.getGoldActionSequence()]
