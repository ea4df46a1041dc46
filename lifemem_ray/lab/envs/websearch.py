"""HotpotQA in the ReAct style on an offline corpus: Search[entity], Lookup[keyword], Finish[answer].

ReAct's HotpotQA environment searches live Wikipedia; here the corpus is the union
of the questions' own context paragraphs (HotpotQA distractor setting: the gold
paragraphs plus distractors), so episodes run offline and reproducibly.

* ``Search[entity]``, ``Lookup[keyword]``: ReAct's tools, whose rules (matching, what each
  observes) live in :mod:`lifemem_ray.lab.envs.wiki_tools`, shared with the FEVER
  environment (:mod:`lifemem_ray.lab.envs.fever`);
* ``Finish[answer]``: ends the episode; reward 1 on an exact match after HotpotQA's
  answer normalisation (lower case, no punctuation or articles); ``info["f1"]``
  has HotpotQA's token F1.

An action may carry a ReAct label (``Action 2: Search[x]``) or a preceding
thought; the first ``Search[...]``/``Lookup[...]``/``Finish[...]`` is taken.
"""

from __future__ import annotations

import os
import random
import re
import string
from collections import Counter
from typing import Any

from lifemem_ray.core.errors import InvalidArgumentError
from lifemem_ray.lab.envs.base import Environment, EnvStateError, StepResult, Task, TaskError, check_task, select_tasks
from lifemem_ray.lab.envs.wiki_tools import (
    Corpus,
    WikiBrowser,
    parse_action,
    resolve_corpus_path,
    shown_action,
)

__all__ = ["Corpus", "WebSearchEnv", "answer_f1", "normalize_answer"]


# --------------------------------------------------------------------------- HotpotQA scoring


def normalize_answer(s: str) -> str:
    """HotpotQA's official normalisation: lower case, no punctuation, no articles, single spaces."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def answer_f1(prediction: str, gold: str) -> float:
    """HotpotQA's official token F1 (yes/no/noanswer must match exactly)."""
    pred, ref = normalize_answer(prediction), normalize_answer(gold)
    if (pred in ("yes", "no", "noanswer") or ref in ("yes", "no", "noanswer")) and pred != ref:
        return 0.0
    p_toks, r_toks = pred.split(), ref.split()
    common = Counter(p_toks) & Counter(r_toks)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p_toks), same / len(r_toks)
    return 2 * precision * recall / (precision + recall)


# --------------------------------------------------------------------------- the environment


class WebSearchEnv(Environment):
    """ReAct-style HotpotQA over the questions' own paragraphs; a fixed seeded train/test partition."""

    name = "websearch"

    def __init__(
        self,
        corpus_path: str | os.PathLike[str] | None = None,
        train_fraction: float = 0.7,
        seed: int = 0,
        max_steps: int = 8,
    ) -> None:
        if (
            isinstance(train_fraction, bool)
            or not isinstance(train_fraction, (int, float))
            or not 0.0 <= train_fraction <= 1.0
        ):
            raise InvalidArgumentError(
                f"train_fraction must be in [0, 1], got {train_fraction!r}", where="WebSearchEnv"
            )
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
            raise InvalidArgumentError(f"max_steps must be an integer >= 1, got {max_steps!r}", where="WebSearchEnv")
        self.corpus_path = resolve_corpus_path(corpus_path)
        self.corpus = Corpus.load(self.corpus_path)
        self.train_fraction, self.seed, self.max_steps = float(train_fraction), seed, max_steps
        ids = sorted(q["id"] for q in self.corpus.questions)
        random.Random(f"lifemem-websearch:{seed}").shuffle(ids)
        n_train = round(self.train_fraction * len(ids))
        split_of = {qid: ("train" if i < n_train else "test") for i, qid in enumerate(ids)}
        self._tasks: dict[str, list[Task]] = {"train": [], "test": []}
        for q in self.corpus.questions:  # file order within a split
            split = split_of[q["id"]]
            self._tasks[split].append(
                Task(
                    env=self.name,
                    id=q["id"],
                    instruction=str(q["question"]),
                    split=split,
                    payload={
                        "answer": str(q["answer"]),
                        "supporting_titles": list(dict.fromkeys(t for t, _ in q["supporting_facts"])),
                    },
                    metadata={"task_type": str(q.get("type", "unknown")), "level": str(q.get("level", "unknown"))},
                )
            )
        self._task: Task | None = None
        self._done = True
        self._steps = 0
        self._browser = WikiBrowser(self.corpus)

    def tasks(self, split: str = "train", limit: int | None = None, seed: int = 0) -> list[Task]:
        """The split's questions: file order for ``seed=0``, else shuffled by ``seed``."""
        return select_tasks("WebSearchEnv", self._tasks, split, limit, seed)

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Start a question; the observation is the question and the action formats."""
        check_task("WebSearchEnv", task, self.name)
        if not isinstance(task.payload.get("answer"), str):
            raise TaskError(f"task {task.id!r} payload lacks its answer (a string)", where="WebSearchEnv.reset")
        self._task, self._done, self._steps = task, False, 0
        self._browser.reset()
        obs = (
            f"Question: {task.instruction}\n"
            "Actions: Search[entity] (a page of the corpus), Lookup[keyword] (next sentence with it on the current page), "
            "Finish[answer]."
        )
        return obs, {"instruction": task.instruction, "valid_actions": None, "success": None}

    def step(self, action: str) -> StepResult:
        """One Search, Lookup or Finish; anything else is an invalid action (a step)."""
        if self._task is None:
            raise EnvStateError("no episode running; call reset(task) first", where="WebSearchEnv.step")
        if self._done:
            raise EnvStateError(
                f"episode of task {self._task.id!r} is over; call reset(task)", where="WebSearchEnv.step"
            )
        self._steps += 1
        info: dict[str, Any] = {"instruction": self._task.instruction, "valid_actions": None, "success": None}
        reward, done = 0.0, False
        parsed = parse_action(action)
        if parsed is None:
            obs = f"Invalid action: {shown_action(action)}. Use Search[entity], Lookup[keyword] or Finish[answer]."
        else:
            verb, arg = parsed
            if verb == "finish":
                gold = self._task.payload["answer"]
                em = normalize_answer(arg) == normalize_answer(gold)
                reward, done = (1.0 if em else 0.0), True
                info.update(success=em, em=em, f1=answer_f1(arg, gold), answer=arg)
                obs = "Episode finished, reward = " + str(int(reward))
            else:
                obs = self._browser.tool(verb, arg)
        if not done and self._steps >= self.max_steps:
            done = True
            info.update(success=False, em=False, f1=0.0, answer=None)
            obs += f"\nStep limit ({self.max_steps}) reached without Finish[answer]."
        info["page"] = self._browser.page
        self._done = done
        return StepResult(obs, reward, done, info)

    def gold_actions(self, task: Task) -> list[str] | None:
        """Search each supporting-fact title, then Finish with the gold answer."""
        titles = task.payload.get("supporting_titles") or []
        return [f"Search[{t}]" for t in titles] + [f"Finish[{task.payload['answer']}]"]

    def close(self) -> None:
        """Nothing is held but the (shared, cached) corpus."""
        self._task, self._done = None, True
        self._browser.reset()
