"""BFCL v4 multi-turn function calling as a text environment, scored by BFCL's own state/response checks.

Each task is a multi-turn conversation. The first observation is the first user
turn; the agent answers with tool calls in BFCL's Python call syntax
(``cd(folder="document")``; a list ``[cd(folder="a"), ls()]`` runs several calls
in one step; JSON ``{"name": ..., "arguments": {...}}`` works too) and ends its
turn with ``finish_turn`` or ``respond("...")``; the observation after that is the
next user turn. Calls run on BFCL's stateful classes (GorillaFileSystem, TwitterAPI,
TradingBot, ...) loaded with the task's ``initial_config``; arguments are parsed as
literals and dispatched to the instance methods, never ``eval``-ed.

Success is BFCL's ``multi_turn_checker``: after every turn whose ground truth is
not empty, the agent must have made at least one call in that turn, the public
attributes of every involved instance must equal those of instances on which the
ground-truth calls were replayed (``state_checker``), and the ground truth's
execution results must all appear among the agent's results so far
(``response_checker``). As in BFCL, a turn that runs past ``max_steps_per_turn``
actions force-terminates the episode as a failure.

BFCL has no train/test split: a stable hash partition (``train_fraction``, ``seed``)
per category is used. Functions a task excludes, or that ``multi_turn_miss_func``
holds back until a later turn, are left out of ``valid_actions`` until BFCL's prompt
adds them, but (as in BFCL's executor) still run if called: one ground truth
(miss_func_49) calls a held-back function before it is offered.
"""

from __future__ import annotations

import ast
import copy
import hashlib
import importlib
import inspect
import json
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lifemem_ray.core.errors import ActionParseError, InvalidArgumentError
from lifemem_ray.lab.envs.base import Environment, EnvStateError, EnvUnavailable, StepResult, Task, TaskError
from lifemem_ray.lab.envs.calls import literal_arg

__all__ = ["BfclEnv"]

INSTALL = "pip install --no-deps bfcl-eval==2026.3.23 mpmath==1.3.0"
CATEGORIES = ("multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param", "multi_turn_long_context")
END_TURN = ("finish_turn", "end_turn")
_FENCE = re.compile(r"^```[a-zA-Z]*\s*|\s*```$")
_FORBIDDEN = ("kill", "exit", "quit", "remove", "unlink", "popen", "Popen", "run")  # BFCL's executor refuses these
# MathAPI calls that an LLM can make run for hours (big-int power, mpmath at 10^9 digits).
_NUMERIC_LIMITS = {
    "power": ("exponent", 10_000),
    "logarithm": ("precision", 1_000),
    "square_root": ("precision", 1_000),
}
_ADDED_FUNCTIONS_PROMPT = "I have updated some more functions you can choose from. What about now?"  # BFCL's wording

_DATA_CACHE: dict[str, Any] = {}


def _bfcl() -> dict[str, Any]:
    """BFCL's data folder, class table and checkers (imported once, lazily)."""
    if _DATA_CACHE:
        return _DATA_CACHE
    try:
        import bfcl_eval
        from bfcl_eval.constants.executable_backend_config import (
            CLASS_FILE_PATH_MAPPING,
            MULTI_TURN_FUNC_DOC_FILE_MAPPING,
            STATELESS_CLASSES,
        )
        from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import (
            response_checker,
            state_checker,
        )
    except ImportError as exc:
        raise EnvUnavailable(f"bfcl-eval is not installed ({exc}); install it with: {INSTALL}") from exc
    _DATA_CACHE.update(
        data_dir=Path(bfcl_eval.__file__).parent / "data",
        class_paths=CLASS_FILE_PATH_MAPPING,
        doc_files=MULTI_TURN_FUNC_DOC_FILE_MAPPING,
        stateless=set(STATELESS_CLASSES),
        state_checker=state_checker,
        response_checker=response_checker,
        docs={},
        entries={},
    )
    return _DATA_CACHE


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    try:
        with open(path, encoding="utf-8") as fh:
            return [json.loads(line) for line in fh if line.strip()]
    except (OSError, json.JSONDecodeError) as exc:
        raise EnvUnavailable(f"BFCL data file {path} could not be read ({exc}); reinstall with: {INSTALL}") from exc


def _category_entries(category: str) -> dict[str, dict[str, Any]]:
    """The entries of a category, each with its ``ground_truth`` (cached per process)."""
    lib = _bfcl()
    if category not in lib["entries"]:
        questions = _read_jsonl(lib["data_dir"] / f"BFCL_v4_{category}.json")
        answers = {
            a["id"]: a["ground_truth"]
            for a in _read_jsonl(lib["data_dir"] / "possible_answer" / f"BFCL_v4_{category}.json")
        }
        entries = {}
        for entry in questions:
            if entry["id"] not in answers:
                raise EnvUnavailable(
                    f"BFCL {category}: no ground truth for {entry['id']} in possible_answer; reinstall with: {INSTALL}"
                )
            entries[entry["id"]] = {**entry, "ground_truth": answers[entry["id"]]}
        lib["entries"][category] = entries
    return lib["entries"][category]


def _class_docs(class_name: str) -> list[dict[str, Any]]:
    lib = _bfcl()
    if class_name not in lib["docs"]:
        lib["docs"][class_name] = _read_jsonl(lib["data_dir"] / "multi_turn_func_doc" / lib["doc_files"][class_name])
    return lib["docs"][class_name]


def _signature(doc: dict[str, Any]) -> str:
    """``name(required, optional=default)`` from a BFCL function doc."""
    params = doc.get("parameters", {})
    required = set(params.get("required", []))
    parts = []
    for pname, spec in params.get("properties", {}).items():
        parts.append(pname if pname in required else f"{pname}={spec.get('default')!r}")
    return f"{doc['name']}({', '.join(parts)})"


Call = tuple[str, list[Any], dict[str, Any], str]  # name, args, kwargs, source text


def _parse_calls(text: str) -> list[Call]:
    """The calls of one action (one call, a list of calls, or JSON); ValueError if malformed."""
    text = _FENCE.sub("", text.strip()).strip()
    if not text:
        raise ActionParseError("empty action")
    if text[0] in "{[" and not re.match(r"^\[\s*[A-Za-z_][\w.]*\s*\(", text):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ActionParseError(f"invalid JSON ({exc.msg} at position {exc.pos})") from None
        calls: list[Call] = []
        for item in obj if isinstance(obj, list) else [obj]:
            if isinstance(item, dict) and isinstance(item.get("function"), dict):
                item = item["function"]
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                raise ActionParseError('JSON calls need the form {"name": "<function>", "arguments": {...}}')
            args = item.get("arguments", item.get("parameters", {})) or {}
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError:
                    raise ActionParseError("'arguments' is a string that is not valid JSON") from None
            if not isinstance(args, dict):
                raise ActionParseError("'arguments' must be an object")
            name = item["name"].rsplit(".", 1)[-1]
            calls.append((name, [], args, f"{name}({', '.join(f'{k}={v!r}' for k, v in args.items())})"))
        return calls
    if re.fullmatch(r"[A-Za-z_]\w*", text):
        return [(text, [], {}, f"{text}()")]
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise ActionParseError(f"not a function call ({exc.msg})") from None
    nodes = tree.body.elts if isinstance(tree.body, (ast.List, ast.Tuple)) else [tree.body]
    if not nodes:
        raise ActionParseError("an empty list of calls")
    calls = []
    for node in nodes:
        if not isinstance(node, ast.Call):
            raise ActionParseError("expected function calls like cd(folder='document')")
        if isinstance(node.func, ast.Name):
            name = node.func.id
        elif isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name):
            name = node.func.attr  # Class.method(...)
        else:
            raise ActionParseError("expected function calls like cd(folder='document')")
        try:
            args = [literal_arg(a) for a in node.args]
            kwargs = {}
            for kw in node.keywords:
                if kw.arg is None:
                    raise ActionParseError(f"{name}(**...): unpacked keyword arguments are not supported")
                kwargs[kw.arg] = literal_arg(kw.value)
        except (ValueError, TypeError, SyntaxError, RecursionError):
            raise ActionParseError(
                f"arguments of {name} must be literal values (strings, numbers, lists, dicts, True/False/None)"
            ) from None
        calls.append((name, args, kwargs, ast.get_source_segment(text, node) or name))
    return calls


class _World:
    """The involved class instances of one conversation, with BFCL's result formatting."""

    def __init__(self, entry: dict[str, Any], long_context: bool) -> None:
        lib = _bfcl()
        self.instances: dict[str, Any] = {}
        self.methods: dict[str, Callable[..., Any]] = {}
        for class_name in entry["involved_classes"]:
            if class_name not in lib["class_paths"]:
                raise TaskError(f"BFCL entry {entry['id']}: unknown class {class_name!r}")
            try:
                module = importlib.import_module(lib["class_paths"][class_name])
            except ImportError as exc:
                raise EnvUnavailable(
                    f"BFCL class {class_name} needs a package that is missing ({exc}); install bfcl-eval's dependencies for it"
                ) from exc
            instance = getattr(module, class_name)()
            if class_name not in lib["stateless"]:
                instance._load_scenario(
                    copy.deepcopy(entry["initial_config"].get(class_name, {})), long_context=long_context
                )
            self.instances[class_name] = instance
            for name, method in inspect.getmembers(instance, predicate=inspect.ismethod):
                if not name.startswith("_"):
                    self.methods[name] = method  # a later class wins, as in BFCL's executor

    def execute(self, name: str, args: list[Any], kwargs: dict[str, Any]) -> str:
        """One call's result as BFCL's executor renders it (errors included)."""
        method = self.methods[name]
        if name in _NUMERIC_LIMITS:
            try:
                bound = inspect.signature(method).bind_partial(*args, **kwargs).arguments
            except TypeError:
                bound = {}
            param, limit = _NUMERIC_LIMITS[name]
            value = bound.get(param)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) > limit:
                return f"Error during execution: {param} must be at most {limit} in absolute value"
        try:
            result = method(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - as BFCL's executor: any failure is the call's answer
            return f"Error during execution: {exc}"
        if isinstance(result, str):
            return result
        if isinstance(result, dict):
            try:
                return json.dumps(result)
            except (TypeError, ValueError):
                return str(result)
        return str(result)

    def run_source(self, source: str) -> str:
        """Run a ground-truth call string (BFCL syntax)."""
        try:
            ((name, args, kwargs, _),) = _parse_calls(source)
        except ValueError as exc:
            return f"Error during execution: {exc}"
        if name not in self.methods or name in _FORBIDDEN:
            return f"Error during execution: name '{name}' is not defined"
        return self.execute(name, args, kwargs)


class BfclEnv(Environment):
    """BFCL v4 multi-turn categories; one conversation per episode, checked turn by turn like BFCL.

    Options: ``categories`` (any of multi_turn_base, multi_turn_miss_func,
    multi_turn_miss_param, multi_turn_long_context), ``max_steps_per_turn``
    (actions per user turn, the turn-ending one included; BFCL's own limit is 20),
    ``train_fraction`` and ``seed`` (the stable hash partition into train/test).
    """

    name = "bfcl"

    def __init__(
        self,
        categories: tuple[str, ...] | list[str] | str = ("multi_turn_base",),
        max_steps_per_turn: int = 10,
        train_fraction: float = 0.7,
        seed: int = 0,
    ) -> None:
        if isinstance(categories, str):
            categories = (categories,)
        unknown = [c for c in categories if c not in CATEGORIES]
        if unknown or not categories:
            raise InvalidArgumentError(
                f"unknown categories {unknown or list(categories)}; expected some of {', '.join(CATEGORIES)}",
                where="BfclEnv",
            )
        if not isinstance(max_steps_per_turn, int) or max_steps_per_turn < 2:
            raise InvalidArgumentError(
                f"max_steps_per_turn must be an integer >= 2, got {max_steps_per_turn!r}",
                where="BfclEnv",
            )
        if not 0.0 <= float(train_fraction) <= 1.0:
            raise InvalidArgumentError(f"train_fraction must be in [0, 1], got {train_fraction!r}", where="BfclEnv")
        self.categories = tuple(categories)
        self.max_steps_per_turn = max_steps_per_turn
        self.train_fraction = float(train_fraction)
        self.seed = seed
        self._entries = {cat: _category_entries(cat) for cat in self.categories}
        self.max_steps = max_steps_per_turn * max(
            len(e["question"]) for c in self._entries.values() for e in c.values()
        )
        self._train: dict[str, set[str]] = {}
        for cat, entries in self._entries.items():
            ranked = sorted(entries, key=lambda i: hashlib.sha256(f"{self.seed}:{i}".encode()).hexdigest())
            self._train[cat] = set(ranked[: round(self.train_fraction * len(ranked))])
        self._task: Task | None = None
        self._world: _World | None = None  # the episode's instances (reset sets them, close drops them)
        self._gold_world: _World | None = None  # the same, driven by the ground-truth calls
        self._done = True

    # ---- tasks -------------------------------------------------------------------------

    def _make_task(self, cat: str, entry: dict[str, Any], split: str) -> Task:
        return Task(
            env=self.name,
            id=f"bfcl-{entry['id']}",
            instruction=self._turn_text(entry, 0, []),
            split=split,
            payload={"category": cat, "entry_id": entry["id"]},
            metadata={
                "task_type": "+".join(sorted(entry["involved_classes"])),
                "category": cat,
                "n_turns": len(entry["question"]),
                "involved_classes": list(entry["involved_classes"]),
                "excluded_function": list(entry.get("excluded_function", [])),
            },
        )

    def tasks(self, split: str = "train", limit: int | None = None, seed: int = 0) -> list[Task]:
        """The tasks of ``split`` over the chosen categories, in a seeded order."""
        if split not in ("train", "test"):
            raise InvalidArgumentError(f"split must be 'train' or 'test', got {split!r}", where="BfclEnv.tasks")
        keys = []
        for cat, entries in self._entries.items():
            for entry_id in entries:
                if (entry_id in self._train[cat]) == (split == "train"):
                    keys.append((cat, entry_id))
        keys.sort(key=lambda k: (k[0], int(k[1].rsplit("_", 1)[1]) if k[1].rsplit("_", 1)[1].isdigit() else 0, k[1]))
        random.Random(seed).shuffle(keys)
        if limit is not None:
            keys = keys[: max(0, limit)]
        return [self._make_task(cat, self._entries[cat][i], split) for cat, i in keys]

    def _resolve(self, task: Task) -> tuple[str, dict[str, Any]]:
        if not isinstance(task, Task):
            raise TaskError(f"expected a Task, got {type(task).__name__}", where="BfclEnv.reset")
        if task.env != self.name:
            raise TaskError(f"task {task.id!r} is for {task.env!r}, not {self.name!r}", where="BfclEnv.reset")
        payload = task.payload if isinstance(task.payload, dict) else {}
        cat, entry_id = payload.get("category"), payload.get("entry_id")
        if cat not in self._entries or entry_id not in self._entries[cat]:
            raise TaskError(
                f"task {task.id!r}: payload category/entry_id {cat!r}/{entry_id!r} not in the loaded categories {list(self.categories)}",
                where="BfclEnv.reset",
            )
        return cat, self._entries[cat][entry_id]

    # ---- episode -----------------------------------------------------------------------

    def _held_back(self, entry: dict[str, Any], turn: int) -> set[str]:
        """Functions not offered yet at ``turn``: excluded ones, and miss_func's until their turn."""
        held = set(entry.get("excluded_function", []))
        for at, names in (entry.get("missed_function") or {}).items():
            if turn < int(at):
                held.update(names)
        return held

    def _turn_text(self, entry: dict[str, Any], turn: int, added: list[str]) -> str:
        contents = [m.get("content", "") for m in entry["question"][turn] if m.get("role") == "user"]
        text = "\n".join(c for c in contents if c)
        if not text and added:
            text = f"{_ADDED_FUNCTIONS_PROMPT}\nNew functions: {', '.join(added)}"
        return text or _ADDED_FUNCTIONS_PROMPT

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Load the task's initial_config into fresh instances; the observation is the first user turn."""
        cat, entry = self._resolve(task)
        long_context = "long_context" in cat
        self._world = _World(entry, long_context)
        self._gold_world = _World(entry, long_context)
        self._task, self._entry, self._category = task, entry, cat
        self._docs = {d["name"]: d for c in entry["involved_classes"] for d in _class_docs(c)}
        self._turn = 0
        self._turn_steps = 0
        self._turn_calls = 0
        self._steps = 0
        self._results: list[
            str
        ] = []  # every execution result of the agent so far (BFCL's all_turn_model_execution_results)
        self._failure: dict[str, Any] | None = None
        self._responses: list[str] = []
        self._done = False
        self.max_steps = self.max_steps_per_turn * len(entry["question"])
        obs = self._turn_text(entry, 0, [])
        return obs, {
            "instruction": task.instruction,
            "valid_actions": self.valid_actions(),
            "success": None,
            "tools": self.tool_docs(),
            "turn": 0,
        }

    def _worlds(self) -> tuple[_World, _World]:
        """The episode's world and its ground-truth twin."""
        if self._world is None or self._gold_world is None:
            raise EnvStateError("no episode is running; call reset(task) first", where="BfclEnv")
        return self._world, self._gold_world

    def _available(self) -> list[str]:
        held = self._held_back(self._entry, self._turn)
        world, _ = self._worlds()
        return [name for name in self._docs if name not in held and name in world.methods]

    def valid_actions(self) -> list[str]:
        """Signatures of the functions offered now, plus finish_turn and respond(message)."""
        if self._task is None:
            return []
        return [_signature(self._docs[n]) for n in self._available()] + ["finish_turn", "respond(message)"]

    def tool_docs(self) -> list[dict[str, Any]]:
        """BFCL's JSON docs of the functions offered now (for an LLM's tool list)."""
        return [self._docs[n] for n in self._available()] if self._task is not None else []

    def step(self, action: str) -> StepResult:
        """Run one action: call(s), or the end of the agent's turn; errors become observations."""
        if self._task is None:
            raise EnvStateError("call reset(task) first", where="BfclEnv.step")
        if self._done:
            return StepResult(
                "The conversation is over; call reset() for a new task.", 0.0, True, self._info(final=True)
            )
        self._steps += 1
        self._turn_steps += 1
        end_turn, observation = False, ""
        if not isinstance(action, str):
            observation = f"Error: an action must be text, got {type(action).__name__}."
        else:
            try:
                calls = _parse_calls(action)
            except ValueError as exc:
                calls, observation = (
                    [],
                    (
                        f"Error: could not parse the action {action[:200]!r}: {exc}. Write calls like cd(folder='document'), "
                        "a list [f(a=1), g()], finish_turn, or respond('message to the user')."
                    ),
                )
            if calls and calls[0][0] in (*END_TURN, "respond"):
                if len(calls) > 1:
                    observation = "Error: finish_turn / respond(...) must be the only call of its action."
                else:
                    name, args, kwargs, _ = calls[0]
                    message = " ".join(str(v) for v in list(args) + list(kwargs.values()))
                    if name == "respond":
                        self._responses.append(message)
                    end_turn = True
            elif calls:
                observation = self._run_calls(calls)
        if end_turn:
            return self._end_turn()
        if self._turn_steps >= self.max_steps_per_turn:
            self._fail(
                "multi_turn:force_terminated",
                f"turn {self._turn} ran past {self.max_steps_per_turn} actions without finish_turn",
            )
            self._done = True
            observation += f"\n[The conversation was ended: turn {self._turn + 1} used {self.max_steps_per_turn} actions without finish_turn.]"
            return StepResult(observation.strip(), 0.0, True, self._info(final=True))
        return StepResult(observation, 0.0, False, self._info(final=False))

    def _run_calls(self, calls: list[Call]) -> str:
        world, _ = self._worlds()
        lines = []
        for name, args, kwargs, source in calls:
            self._turn_calls += 1  # decoded, as BFCL counts it, whether or not it runs
            if name in _FORBIDDEN:
                result = f"Error during execution: Function call {name} is not allowed."
            elif name not in world.methods:
                result = (
                    f"Error during execution: name {name!r} is not defined; available: {', '.join(self._available())}"
                )
            else:
                result = world.execute(name, args, kwargs)
            self._results.append(result)
            lines.append(result if len(calls) == 1 else f"{source} -> {result}")
        return "\n".join(lines)

    def _fail(self, error_type: str, message: str, details: Any = None) -> None:
        if self._failure is None:
            self._failure = {"error_type": error_type, "error_message": message, "turn": self._turn}
            if details is not None:
                self._failure["details"] = details

    def _end_turn(self) -> StepResult:
        """BFCL's per-turn check against the ground truth, then the next user turn (or the end)."""
        lib = _bfcl()
        world, gold_world = self._worlds()
        gold_calls = self._entry["ground_truth"][self._turn]
        gold_results = [gold_world.run_source(src) for src in gold_calls]
        if gold_calls and self._failure is None:
            if self._turn_calls == 0:
                self._fail(
                    "multi_turn:empty_turn_model_response", f"Model response list is empty for turn {self._turn}"
                )
            else:
                state = lib["state_checker"](world.instances, gold_world.instances)
                if not state["valid"]:
                    self._fail(state["error_type"], state["error_message"])
                else:
                    response = lib["response_checker"](self._results, gold_results, self._turn)
                    if not response["valid"]:
                        self._fail(
                            response["error_type"],
                            response["error_message"],
                            {"missing_items": response["details"]["missing_items"]},
                        )
        before = set(self._available())
        self._turn += 1
        self._turn_steps = 0
        self._turn_calls = 0
        if self._turn >= len(self._entry["question"]):
            self._done = True
            info = self._info(final=True)
            return StepResult("The conversation is over.", 1.0 if info["success"] else 0.0, True, info)
        added = [_signature(self._docs[n]) for n in self._available() if n not in before]
        info = self._info(final=False)
        info["turn"] = self._turn
        return StepResult(self._turn_text(self._entry, self._turn, added), 0.0, False, info)

    def _info(self, final: bool) -> dict[str, Any]:
        if self._task is None:
            raise EnvStateError("no episode is running; call reset(task) first", where="BfclEnv")
        info: dict[str, Any] = {
            "instruction": self._task.instruction,
            "valid_actions": self.valid_actions(),
            "success": None,
            "steps": self._steps,
        }
        if final:
            info["success"] = self._failure is None
            info["score"] = (
                float(self._turn) / len(self._entry["question"])
                if self._failure is None
                else float(self._failure["turn"]) / len(self._entry["question"])
            )
            if self._failure is not None:
                info["failure"] = self._failure
        return info

    def gold_actions(self, task: Task) -> list[str] | None:
        """The ground-truth calls turn by turn, each turn closed by finish_turn (long turns batched in lists)."""
        _, entry = self._resolve(task)
        out: list[str] = []
        room = self.max_steps_per_turn - 1
        for calls in entry["ground_truth"]:
            if len(calls) <= room:
                out.extend(calls)
            else:
                size = -(-len(calls) // room)
                out.extend(f"[{', '.join(calls[i : i + size])}]" for i in range(0, len(calls), size))
            out.append("finish_turn")
        return out

    def close(self) -> None:
        """Drop the episode's instances (no processes are held); safe to call twice."""
        self._world = self._gold_world = None
        self._task = None
        self._done = True
