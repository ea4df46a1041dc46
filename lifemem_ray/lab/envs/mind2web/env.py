"""Mind2Web's offline step-level protocol over the released trajectories: one step is one episode.

Mind2Web (Deng et al., 2023) evaluates a web agent offline: for each step of a recorded
task, given the cleaned page, the task and the previous (gold) actions, the agent predicts
the next element and operation; the scores are element accuracy, operation F1 and step
success rate (element right and operation F1 = 1), and a task succeeds when all its steps
do. Here the recorded tasks are the LifeMem training set's 81 Mind2Web trajectories (633
steps, 33 websites, 3 domains; see :mod:`lifemem_ray.lab.envs.mind2web.records` for the format
and the scoring). No further tasks are generated: every episode is a released step.

* **Task**: one step. The instruction is Mind2Web's prompt text, ``Task: ...`` then
  ``Previous actions:`` with the last ``previous_k`` (5, as MindAct) earlier steps'
  ``action_reprs`` lines (``[combobox]  Reservation type -> SELECT: Pickup``), or ``None``.
  The first observation is the step's cleaned HTML as released (untrusted page text,
  returned as is; cut at ``MAX_PAGE_CHARS``).
* **Valid actions** (the offline agents' choices): the page's elements with an id, in page
  order: ``CLICK [id]`` for each; ``SELECT [id] [option]`` for each option of an element
  holding options (a select, or a label around one); ``TYPE [id] [value]`` for each element
  text can be typed into (inputs but checkboxes, radios, buttons..., textareas, labels) and
  each of the task text's spans of 1-4 words that neither start nor end with a stop word
  nor cross punctuation (at most ``MAX_TYPE_VALUES``, in task order). On the shared file a
  step has 3 to 223 valid actions, 3 (clicks only) for the median step. Mind2Web's models
  write the typed value freely; a listed agent (the ReAct agent checks its answer against
  this list) must be able to express the gold, so when no listed action is equivalent to
  the gold one (same element, operation F1 1) the gold action is inserted into its
  element's group at a position seeded by the task id, so its place says nothing. On the
  shared file that is 16 of the 86 TYPE steps, whose value is no task span (``NAPA
  VALLEY``, ``udupi``, ``red sox vs yankees``), and 2 of the 16 SELECT steps, whose option
  the cleaner cut off the page.
* **One prediction per step**: the first action that parses as ``CLICK [id]``, ``TYPE [id]
  [text]`` or ``SELECT [id] [option]`` (an ``Action:`` label, backticks or a description
  after it are ignored) is scored and ends the episode; reward = step success (1/0);
  ``info`` has ``element_correct``, ``operation_f1`` and ``success``. An element id not on
  the page is a wrong element, not an invalid action. An action that does not parse (or is
  over ``MAX_ACTION_CHARS``) gets an observation saying so, with the page again, and the
  agent may answer again, up to ``max_steps`` (3) answers; running out is a failed step
  (element wrong, F1 0), as Mind2Web counts an unparsable prediction.
* **Splits**: by website, as Mind2Web's cross-website test set: within each domain a seeded
  ``held_out_fraction`` (0.3; at least one website of a domain with two or more) of the
  websites is the test split, so no test website is seen in train. ``task_type`` is the
  domain; ``website``, ``subdomain``, ``trajectory`` (the record's ``source_line``), ``step``
  and ``n_steps`` are in the metadata too.

:func:`summarise` aggregates finished steps into Mind2Web's report: element accuracy,
operation F1 and step success rate over steps, and task success rate over the trajectories
all of whose steps were run.
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Iterable, Mapping
from typing import Any

from lifemem_ray.core.errors import InvalidArgumentError
from lifemem_ray.lab.envs.base import Environment, EnvStateError, StepResult, Task, TaskError, check_task, select_tasks
from lifemem_ray.lab.envs.mind2web.records import (
    MAX_ACTION_CHARS,
    MAX_PAGE_CHARS,
    Action,
    Element,
    StepRecord,
    load_steps,
    operation_f1,
    operation_string,
    page_elements,
    parse_action,
    resolve_path,
    score_action,
)

__all__ = ["MAX_PAGE_CHARS", "Mind2WebEnv", "candidate_actions", "operation_f1", "summarise", "task_spans"]

MAX_TYPE_VALUES = 100  # typed-value candidates per element (the released tasks have at most 73 spans)
MAX_SPAN_WORDS = 4
MAX_ECHO = 200  # characters of an action repeated in an observation
_WORD = re.compile(r"[\w@.'&/+-]*\w[\w@.'&/+-]*")  # e-mail addresses, phone numbers and 1-adult stay whole
_CLAUSE = re.compile(r"[,;!?()\"\[\]]|\.(?=\s|$)|\s-\s|:\s")  # a span does not cross punctuation
_STOP_WORDS = (  # words a typed value neither starts nor ends with
    "a an the in on at from to for with and or of by near under over within between as "
    "is are be that which who whose my me i it its than no more less least about into per"
)
_STOP = frozenset(_STOP_WORDS.split())
_FORMATS = "CLICK [id], TYPE [id] [text] or SELECT [id] [option], with the id of an element of the page"


# --------------------------------------------------------------------------- candidates


def task_spans(text: str) -> list[str]:
    """The task text's word spans of 1-MAX_SPAN_WORDS words that neither start nor end with a
    stop word nor cross punctuation, in task order, without repeats: the typed-value candidates."""
    out: dict[str, None] = {}
    for clause in _CLAUSE.split(text):
        words = [w.rstrip(".'") or w for w in _WORD.findall(clause)]
        for i in range(len(words)):
            for n in range(1, MAX_SPAN_WORDS + 1):
                span = words[i : i + n]
                if len(span) < n or span[0].lower() in _STOP or span[-1].lower() in _STOP:
                    continue
                out.setdefault(" ".join(span), None)
    return list(out)


def _action_text(a: Action) -> str:
    return f"{a.op} [{a.element}]" + (f" [{a.value}]" if a.op != "CLICK" else "")


def candidate_actions(elements: list[Element], task: str, gold: Action, key: str) -> tuple[list[str], bool]:
    """The valid actions of a page (clicks, then selects, then typed values; see the module
    doc) and whether the gold action had to be inserted (no listed action was equivalent)."""
    values = task_spans(task)[:MAX_TYPE_VALUES]
    groups: dict[tuple[str, str], list[Action]] = {("CLICK", ""): [Action("CLICK", e.id, "") for e in elements]}
    for e in elements:
        options = [o for o in e.options if "[" not in o and "]" not in o]
        if options:
            groups[("SELECT", e.id)] = [Action("SELECT", e.id, o) for o in options]
    for e in elements:
        if e.typeable and values:
            groups[("TYPE", e.id)] = [Action("TYPE", e.id, v) for v in values]
    inserted = not any(score_action(a, gold)[2] for group in groups.values() for a in group)
    if inserted:
        group = groups.setdefault(("CLICK", "") if gold.op == "CLICK" else (gold.op, gold.element), [])
        group.insert(random.Random(f"lifemem-mind2web:{key}").randrange(len(group) + 1), gold)
    return [_action_text(a) for group in groups.values() for a in group], inserted


# --------------------------------------------------------------------------- reporting


def summarise(results: Iterable[tuple[Task, Mapping[str, Any]]]) -> dict[str, Any]:
    """Mind2Web's report over finished steps, given as (task, final info) pairs: element
    accuracy, operation F1 and step success rate (means over steps), and task success rate
    (the share of trajectories, among those all of whose steps are given, whose every step
    succeeded; None when there is none)."""
    steps = 0
    element = f1 = success = 0.0
    by_trajectory: dict[Any, list[bool]] = {}
    size: dict[Any, int] = {}
    websites: set[str] = set()
    for task, info in results:
        steps += 1
        element += bool(info.get("element_correct"))
        f1 += float(info.get("operation_f1") or 0.0)
        success += bool(info.get("success"))
        traj = (task.metadata.get("website"), task.metadata.get("trajectory"))
        by_trajectory.setdefault(traj, []).append(bool(info.get("success")))
        size[traj] = int(task.metadata.get("n_steps", 0))
        websites.add(str(task.metadata.get("website")))
    complete = [ok for traj, ok in by_trajectory.items() if len(ok) >= size[traj] > 0]
    return {
        "steps": steps,
        "tasks": len(by_trajectory),
        "complete_tasks": len(complete),
        "websites": len(websites),
        "element_acc": element / steps if steps else None,
        "operation_f1": f1 / steps if steps else None,
        "step_sr": success / steps if steps else None,
        "task_sr": sum(all(ok) for ok in complete) / len(complete) if complete else None,
    }


# --------------------------------------------------------------------------- the environment


def _website_split(steps: list[StepRecord], fraction: float, seed: int) -> set[str]:
    """The held-out websites: a seeded ``fraction`` of each domain's websites (at least one
    of a domain with two or more)."""
    by_domain: dict[str, set[str]] = {}
    for s in steps:
        by_domain.setdefault(s.domain, set()).add(s.website)
    held: set[str] = set()
    for domain in sorted(by_domain):
        sites = sorted(by_domain[domain])
        random.Random(f"lifemem-mind2web:{seed}:{domain}").shuffle(sites)
        n = round(fraction * len(sites))
        if fraction > 0 and len(sites) >= 2:
            n = max(n, 1)
        held.update(sites[: min(n, len(sites))])
    return held


def _check_fraction(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise InvalidArgumentError(f"held_out_fraction must be in [0, 1], got {value!r}", where="Mind2WebEnv")
    return float(value)


def _check_count(name: str, value: Any, low: int, high: int = 100_000) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidArgumentError(f"{name} must be an integer in {low}..{high}, got {value!r}", where="Mind2WebEnv")
    return value


class Mind2WebEnv(Environment):
    """Mind2Web's offline protocol: each released step an episode of one prediction; split by website."""

    name = "mind2web"

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        held_out_fraction: float = 0.3,
        seed: int = 0,
        max_steps: int = 3,
        previous_k: int = 5,
        n_train: int | None = None,
        n_test: int | None = None,
    ) -> None:
        """``n_train`` / ``n_test``: at most that many steps of each split, the first in file
        order (None: all of them), as the generated environments take a task count."""
        self.held_out_fraction = _check_fraction(held_out_fraction)
        self.max_steps = _check_count("max_steps", max_steps, 1, 100)
        self.previous_k = _check_count("previous_k", previous_k, 0, 100)
        self.seed = seed
        self.path = resolve_path(path)
        steps = load_steps(self.path)
        held = _website_split(steps, self.held_out_fraction, seed)
        self._tasks: dict[str, list[Task]] = {"train": [], "test": []}
        seen: set[str] = set()
        for s in steps:
            task = self._task_of(s, "test" if s.website in held else "train")
            if task.id in seen:
                raise TaskError(f"{self.path}: two records share source_line {s.source_line}", where="Mind2WebEnv")
            seen.add(task.id)
            self._tasks[task.split].append(task)
        for split, cap in (("train", n_train), ("test", n_test)):
            if cap is not None:
                self._tasks[split] = self._tasks[split][: _check_count(f"n_{split}", cap, 0)]
        self._task: Task | None = None
        self._gold: Action | None = None
        self._valid: list[str] = []
        self._done = True
        self._answers = 0

    def _task_of(self, s: StepRecord, split: str) -> Task:
        previous = s.previous[-self.previous_k :] if self.previous_k else ()
        lines = "\n".join(previous) if previous else "None"
        return Task(
            env=self.name,
            id=f"m2w-{s.source_line:03d}-{s.step:02d}",
            instruction=f"Task: {s.task}\nPrevious actions:\n{lines}",
            split=split,
            payload={"page": s.page, "gold": s.gold, "task": s.task},
            metadata={
                "task_type": s.domain,
                "website": s.website,
                "subdomain": s.subdomain,
                "trajectory": s.source_line,
                "step": s.step,
                "n_steps": s.n_steps,
            },
        )

    def tasks(self, split: str = "train", limit: int | None = None, seed: int = 0) -> list[Task]:
        """The split's steps: file order (record, then step) for ``seed=0``, else shuffled by ``seed``."""
        return select_tasks("Mind2WebEnv", self._tasks, split, limit, seed)

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Start one step: the observation is its page; ``valid_actions`` its candidates."""
        check_task("Mind2WebEnv", task, self.name)
        page, gold_text = task.payload.get("page"), task.payload.get("gold")
        gold = parse_action(gold_text)
        if not isinstance(page, str) or gold is None:
            raise TaskError(
                f"task {task.id!r} payload needs 'page' (the HTML) and 'gold' (CLICK|TYPE|SELECT [id] ...)",
                where="Mind2WebEnv.reset",
            )
        text = str(task.payload.get("task") or task.instruction)
        self._valid, _ = candidate_actions(page_elements(page), text, gold, task.id)
        self._task, self._gold, self._done, self._answers = task, gold, False, 0
        return page, self._info(None)

    def _info(self, success: bool | None) -> dict[str, Any]:
        instruction = self._task.instruction if self._task is not None else ""
        return {"instruction": instruction, "valid_actions": list(self._valid), "success": success}

    def step(self, action: str) -> StepResult:
        """Score one prediction (ends the episode); an unparsable answer gets an observation."""
        if self._task is None or self._gold is None:
            raise EnvStateError("no episode running; call reset(task) first", where="Mind2WebEnv.step")
        if self._done:
            raise EnvStateError(
                f"episode of task {self._task.id!r} is over; call reset(task)", where="Mind2WebEnv.step"
            )
        self._answers += 1
        pred = parse_action(action)
        if pred is None:
            obs = self._refusal(action)
            if self._answers < self.max_steps:  # the page again: the refusal replaces it as the latest observation
                page = str(self._task.payload.get("page", ""))
                return StepResult(f"{obs}\nThe page is unchanged:\n{page}", 0.0, False, self._info(None))
            self._done = True
            info = {**self._info(False), "element_correct": False, "operation_f1": 0.0, "prediction": None}
            return StepResult(obs + f"\nNo prediction in {self.max_steps} answers: the step is wrong.", 0.0, True, info)
        element, f1, success = score_action(pred, self._gold)
        self._done = True
        on_page = f"CLICK [{pred.element}]" in self._valid
        obs = (
            f"Predicted {operation_string(pred.op, pred.value)[:MAX_ECHO]} on element {pred.element}"
            f"{'' if on_page else ' (not an element of this page)'}. "
            f"Element {'correct' if element else 'wrong'}, operation F1 {f1:.2f}: "
            f"step {'succeeded' if success else 'failed'}, reward = {int(success)}"
        )
        info = {
            **self._info(success),
            "element_correct": element,
            "operation_f1": f1,
            "prediction": _action_text(pred),
        }
        return StepResult(obs, 1.0 if success else 0.0, True, info)

    def _refusal(self, action: Any) -> str:
        if not isinstance(action, str):
            return f"Invalid action: expected text, got {type(action).__name__}. Answer with {_FORMATS}."
        if len(action) > MAX_ACTION_CHARS:
            return f"Invalid action: over {MAX_ACTION_CHARS} characters. Answer with {_FORMATS}."
        shown = action if len(action) <= MAX_ECHO else action[:MAX_ECHO] + "..."
        return f"Invalid action: {shown}. Answer with {_FORMATS}."

    def gold_actions(self, task: Task) -> list[str] | None:
        """The released gold action of the step."""
        gold = task.payload.get("gold")
        return [gold] if isinstance(gold, str) else None

    def close(self) -> None:
        """Nothing is held but the (shared, cached) steps."""
        self._task, self._gold, self._done, self._valid = None, None, True, []
