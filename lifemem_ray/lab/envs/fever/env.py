"""FEVER in the ReAct style on an offline corpus: Search[entity], Lookup[keyword], Finish[label].

FEVER (Thorne et al., 2018) asks whether Wikipedia SUPPORTS or REFUTES a claim, or holds
NOT ENOUGH INFO; ReAct (and the LifeMem paper, which evaluates 100 test claims with at
most 4 steps as a zero-shot transfer from HotpotQA) gives the agent the same Wikipedia
tools as for HotpotQA. Here the tools are those of the ``websearch`` environment,
called from :mod:`lifemem_ray.lab.envs.wiki_tools` (same matching rules, same
observations), over the paragraphs of the same HotpotQA distractor file:

* ``Search[entity]`` / ``Lookup[keyword]``: as in ``websearch``;
* ``Finish[SUPPORTS]``, ``Finish[REFUTES]``, ``Finish[NOT ENOUGH INFO]`` (any case;
  *supported*, *refuted*, *not enough information* and *NEI* are read as these): ends the
  episode, reward 1 for the claim's label, else 0; ``info["success"]`` says which. A Finish
  with another answer is an invalid action (the episode goes on), as is anything that is not
  one of the three actions or is longer than ``MAX_ACTION_CHARS``; each costs a step.

**How it differs from FEVER.** No FEVER claims with their Wikipedia text can be installed
here, so the claims are constructed (:mod:`lifemem_ray.lab.envs.fever.claims`) from the
file's paragraphs (1,000 in the shipped one), not written by people over Wikipedia's 5.4 million pages: a
SUPPORTS claim is a sentence of a paragraph (lightly rewritten: a leading *He/She/It*
replaced by the subject, a trailing clause cut), a REFUTES claim the same with one fact
changed (a year, number, month or nationality), a NOT ENOUGH INFO claim a sentence whose
paragraph (or only that sentence) is then withheld from the served corpus. Labels are
therefore right by construction and checked against what is served, where FEVER's were
annotated; the claims are wordier than FEVER's (whole sentences) and their evidence is
always one sentence of one page. Construction leaves cues that FEVER lacks: with the
defaults, about a quarter of the NOT ENOUGH INFO claims name a subject that has no page
(no page has that name: Search finds none, or a near spelling's page, which never happens to
the other labels), and most of the others have
their page's first sentence withheld (the page then opens mid-story). The claims' wording
does not give the label away: an agent that copies the label of the most similar stored
claim scores at chance. Success rates here measure the same skill (search the subject, read,
compare, pick a label) on an easier and smaller claim set: compare them with the paper's
FEVER column as a trend (with and without memory, transfer from ``websearch``), not as
equal numbers. The default
step limit is ``websearch``'s 8 (the paper used 4: ``max_steps=4``).

Train and test claims come from disjoint source paragraphs; ``n_train`` and ``n_test`` claims
(fewer when the file cannot give them) with labels balanced within each split. Page text
is returned as it is (untrusted; the memory and the prompts fence it).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from lifemem_ray.core.errors import InvalidArgumentError
from lifemem_ray.core.lru import LruCache
from lifemem_ray.lab.envs.base import Environment, EnvStateError, StepResult, Task, TaskError, check_task, select_tasks
from lifemem_ray.lab.envs.fever.claims import build_claims, validate_claims
from lifemem_ray.lab.envs.fever.facts import LABELS, NEI, ClaimSet
from lifemem_ray.lab.envs.wiki_tools import (
    SEARCH_SENTENCES,
    Corpus,
    WikiBrowser,
    parse_action,
    resolve_corpus_path,
    shown_action,
)

__all__ = ["MAX_ACTION_CHARS", "FeverEnv", "parse_label"]

MAX_ACTION_CHARS = 2000  # the ReAct agent's own bound on one action
MAX_CLAIMS = 10_000  # claims asked for per split (a corpus of HotpotQA's size gives a few hundred)
_ALIASES = {
    "SUPPORTS": "SUPPORTS",
    "SUPPORT": "SUPPORTS",
    "SUPPORTED": "SUPPORTS",
    "REFUTES": "REFUTES",
    "REFUTE": "REFUTES",
    "REFUTED": "REFUTES",
    "NOT ENOUGH INFO": NEI,
    "NOT ENOUGH INFORMATION": NEI,
    "NOTENOUGHINFO": NEI,
    "NEI": NEI,
}
_USAGE = "Use Search[entity], Lookup[keyword] or Finish[SUPPORTS|REFUTES|NOT ENOUGH INFO]."
_BUILT: LruCache[tuple[Any, ...], tuple[ClaimSet, Corpus]] = LruCache(8, "FeverEnv builds")  # per file and options


def parse_label(answer: str) -> str | None:
    """The FEVER label ``answer`` names (case, punctuation and spacing ignored), or None."""
    return _ALIASES.get(" ".join(re.sub(r"[^A-Za-z]+", " ", answer).upper().split()))


def _lookups(sentences: list[str], index: int) -> list[str]:
    """The Lookup actions that reach ``sentences[index]``: a word of it that the fewest earlier
    sentences hold, repeated once per earlier match (ReAct's Lookup moves on when repeated)."""
    words = {w for w in re.findall(r"[A-Za-z0-9]{4,}", sentences[index])}
    if not words:
        return []
    before = sentences[:index]
    best = min(words, key=lambda w: (sum(w.lower() in s.lower() for s in before), -len(w), w))
    return [f"Lookup[{best}]"] * (1 + sum(best.lower() in s.lower() for s in before))


def _build(path: Path, n_train: int, n_test: int, seed: int) -> tuple[ClaimSet, Corpus]:
    """The claims and the served corpus, built and checked once per file and options."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns, n_train, n_test, seed)
    built = _BUILT.get(key)  # every worker's environment of one file and options shares one
    if built is None:
        source = Corpus.load(path)
        claims = build_claims(source.pages, n_train=n_train, n_test=n_test, seed=seed)
        problems = validate_claims(claims, source.pages)
        if problems:  # a construction rule and its check disagree: a bug, not bad input
            raise TaskError(
                f"{len(problems)} constructed claim(s) of {path} fail their check: {problems[0]}", where="FeverEnv"
            )
        for split in ("train", "test"):
            if not claims.split(split) and (n_train if split == "train" else n_test):
                raise TaskError(
                    f"{path} gives no {split} claim (too few paragraphs with a dated or numbered "
                    "sentence naming their subject); use a larger HotpotQA distractor file",
                    where="FeverEnv",
                )
        built = (claims, Corpus(source.questions, claims.pages))
        _BUILT.put(key, built)
    return built


class FeverEnv(Environment):
    """ReAct-style fact checking of constructed claims over the HotpotQA paragraphs."""

    name = "fever"

    def __init__(
        self,
        corpus_path: str | os.PathLike[str] | None = None,
        n_train: int = 200,
        n_test: int = 100,
        seed: int = 0,
        max_steps: int = 8,
    ) -> None:
        for arg, value, high in (
            ("n_train", n_train, MAX_CLAIMS),
            ("n_test", n_test, MAX_CLAIMS),
            ("max_steps", max_steps, 1000),
        ):
            low = 1 if arg == "max_steps" else 0
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise InvalidArgumentError(
                    f"{arg} must be an integer in {low}..{high}, got {value!r}", where="FeverEnv"
                )
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise InvalidArgumentError(f"seed must be an integer, got {seed!r}", where="FeverEnv")
        self.corpus_path = resolve_corpus_path(corpus_path, owner="FeverEnv")
        self.claims, self.corpus = _build(self.corpus_path, n_train, n_test, seed)
        self.seed, self.max_steps = seed, max_steps
        self._tasks: dict[str, list[Task]] = {"train": [], "test": []}
        source = Corpus.load(self.corpus_path).pages
        for claim in self.claims.claims:
            found = claim.construction != "withheld-page"
            lookups = _lookups(source[claim.source_title], claim.sentence_index)
            self._tasks[claim.split].append(
                Task(
                    env=self.name,
                    id=claim.id,
                    instruction=(
                        f"Check the claim against the corpus: SUPPORTS, REFUTES or NOT ENOUGH INFO? Claim: {claim.text}"
                    ),
                    split=claim.split,
                    payload={
                        "claim": claim.text,
                        "label": claim.label,
                        "search": claim.source_title if found else claim.subject,
                        "lookups": lookups if claim.sentence_index >= SEARCH_SENTENCES and claim.label != NEI else [],
                    },
                    metadata={
                        "task_type": claim.label,
                        "source_title": claim.source_title,
                        "construction": claim.construction,
                    },
                )
            )
        self._task: Task | None = None
        self._done = True
        self._steps = 0
        self._browser = WikiBrowser(self.corpus)

    def tasks(self, split: str = "train", limit: int | None = None, seed: int = 0) -> list[Task]:
        """The split's claims: construction order (labels balanced in every prefix) for ``seed=0``,
        else shuffled by ``seed``."""
        return select_tasks("FeverEnv", self._tasks, split, limit, seed)

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Start a claim; the observation is the claim and the action formats."""
        check_task("FeverEnv", task, self.name)
        if task.payload.get("label") not in LABELS or not isinstance(task.payload.get("claim"), str):
            raise TaskError(
                f"task {task.id!r} payload lacks its claim or its label ({', '.join(LABELS)})",
                where="FeverEnv.reset",
            )
        self._task, self._done, self._steps = task, False, 0
        self._browser.reset()
        obs = (
            f"Claim: {task.payload['claim']}\n"
            "Actions: Search[entity] (a page of the corpus), Lookup[keyword] (next sentence with it on the current page), "
            "Finish[SUPPORTS], Finish[REFUTES] or Finish[NOT ENOUGH INFO]."
        )
        return obs, {"instruction": task.instruction, "valid_actions": None, "success": None}

    def step(self, action: str) -> StepResult:
        """One Search, Lookup or Finish; anything else is an invalid action (a step)."""
        if self._task is None:
            raise EnvStateError("no episode running; call reset(task) first", where="FeverEnv.step")
        if self._done:
            raise EnvStateError(f"episode of task {self._task.id!r} is over; call reset(task)", where="FeverEnv.step")
        self._steps += 1
        info: dict[str, Any] = {"instruction": self._task.instruction, "valid_actions": None, "success": None}
        reward, done = 0.0, False
        too_long = isinstance(action, str) and len(action) > MAX_ACTION_CHARS
        parsed = None if too_long else parse_action(action)
        if too_long:
            obs = f"Invalid action: longer than {MAX_ACTION_CHARS} characters. {_USAGE}"
        elif parsed is None:
            obs = f"Invalid action: {shown_action(action)}. {_USAGE}"
        elif parsed[0] == "finish":
            label = parse_label(parsed[1])
            if label is None:
                obs = f"Invalid answer: {shown_action(parsed[1])}. Finish with SUPPORTS, REFUTES or NOT ENOUGH INFO."
            else:
                correct = label == self._task.payload["label"]
                reward, done = (1.0 if correct else 0.0), True
                info.update(success=correct, answer=label)
                obs = "Episode finished, reward = " + str(int(reward))
        else:
            obs = self._browser.tool(*parsed)
        if not done and self._steps >= self.max_steps:
            done = True
            info.update(success=False, answer=None)
            obs += f"\nStep limit ({self.max_steps}) reached without Finish[label]."
        info["page"] = self._browser.page
        self._done = done
        return StepResult(obs, reward, done, info)

    def gold_actions(self, task: Task) -> list[str] | None:
        """Search the claim's subject (its page's title), Lookup its sentence when Search does not
        show it, then Finish with the label; within the step limit (Lookups, then the Search, dropped)."""
        payload = task.payload
        if payload.get("label") not in LABELS or not isinstance(payload.get("search"), str):
            return None  # not one of this environment's constructed claims
        plan = [f"Search[{payload['search']}]", *payload.get("lookups", []), f"Finish[{payload['label']}]"]
        if len(plan) > self.max_steps:
            plan = [plan[0], plan[-1]][-self.max_steps :]
        return plan

    def close(self) -> None:
        """Nothing is held but the (shared, cached) claims and corpus."""
        self._task, self._done = None, True
        self._browser.reset()
