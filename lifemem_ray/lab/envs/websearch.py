"""HotpotQA in the ReAct style on an offline corpus: Search[entity], Lookup[keyword], Finish[answer].

ReAct's HotpotQA environment searches live Wikipedia; here the corpus is the union
of the questions' own context paragraphs (HotpotQA distractor setting: the gold
paragraphs plus distractors), so episodes run offline and reproducibly.

* ``Search[entity]``: the paragraph whose title matches ``entity`` (exact title,
  case- and space-insensitive; else the same title without punctuation, accents or
  a parenthesised qualifier; else a near spelling; else the best BM25 hit over
  titles and text when the query contains its title, or most of it). The
  observation is the paragraph's first five sentences (prefixed by the page title
  when the match was not exact). No match: ``Could not find <entity>. Similar:
  [titles]`` with the five best BM25 titles.
* ``Lookup[keyword]``: ReAct semantics: ``(Result i / n) <sentence>``, the next
  sentence of the current paragraph containing ``keyword`` (case-insensitive);
  the same keyword again moves on; ``No more results.`` at the end.
* ``Finish[answer]``: ends the episode; reward 1 on an exact match after HotpotQA's
  answer normalisation (lower case, no punctuation or articles); ``info["f1"]``
  has HotpotQA's token F1.

An action may carry a ReAct label (``Action 2: Search[x]``) or a preceding
thought; the first ``Search[...]``/``Lookup[...]``/``Finish[...]`` is taken.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import random
import re
import string
import unicodedata
from collections import Counter
from pathlib import Path
from typing import Any, ClassVar

from lifemem_ray.core.errors import InvalidArgumentError
from lifemem_ray.lab.envs.base import Environment, EnvStateError, EnvUnavailable, StepResult, Task, TaskError

__all__ = ["DEFAULT_CORPUS", "Corpus", "WebSearchEnv", "answer_f1", "normalize_answer"]

DEFAULT_CORPUS = Path("/work/shared/data/hotpotqa/distractor-dev-100.jsonl")
CORPUS_ENV_VAR = "LIFEMEM_HOTPOTQA"
_RELATIVE = Path("data") / "hotpotqa" / "distractor-dev-100.jsonl"
SEARCH_SENTENCES = 5
N_SIMILAR = 5
MAX_QUERY_TOKENS = 64
MAX_ECHO = 200  # characters of an argument repeated in an observation

_ACTION = re.compile(r"\b(search|lookup|finish)\s*\[(.*)\]", re.I)
_TOKEN = re.compile(r"\w+")
_PAREN = re.compile(r"\s*\([^)]*\)\s*")
_STOP = frozenset(
    [
        "a",
        "an",
        "the",
        "of",
        "in",
        "on",
        "at",
        "to",
        "for",
        "and",
        "or",
        "is",
        "was",
        "are",
        "what",
        "who",
        "which",
        "when",
        "where",
        "how",
        "did",
        "does",
        "do",
        "by",
        "with",
        "from",
        "as",
    ]
)


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


# --------------------------------------------------------------------------- corpus


def _fold(text: str) -> str:
    """Case-, accent- and space-insensitive form of a title or query."""
    text = unicodedata.normalize("NFKD", text)
    text = "".join(ch for ch in text if not unicodedata.combining(ch))
    return " ".join(text.casefold().split())


def _key(text: str) -> str:
    """A title without its parenthesised qualifier and punctuation: 'Viva (UK and Ireland)' -> 'viva'."""
    return " ".join(_TOKEN.findall(_PAREN.sub(" ", _fold(text))))


def _cut(text: str) -> str:
    return text if len(text) <= MAX_ECHO else text[:MAX_ECHO] + "..."


def _tokens(text: str) -> list[str]:
    return _TOKEN.findall(_fold(text))


class Corpus:
    """Paragraphs by title with a BM25 index over title (weighted x3) and text; one per file, shared."""

    _cache: ClassVar[dict[tuple[str, int, int], Corpus]] = {}  # shared by every instance, on purpose

    def __init__(self, questions: list[dict[str, Any]], pages: dict[str, list[str]]) -> None:
        self.questions = questions
        self.pages = pages
        self.titles = list(pages)
        self.by_fold: dict[str, str] = {}
        self.by_key: dict[str, list[str]] = {}
        for t in self.titles:
            self.by_fold.setdefault(_fold(t), t)
            self.by_key.setdefault(_key(t), []).append(t)
        self._keys = list(self.by_key)
        self.postings: dict[str, dict[int, int]] = {}
        self.lengths: list[int] = []
        for i, t in enumerate(self.titles):
            toks = _tokens(t) * 3 + _tokens(" ".join(pages[t]))
            self.lengths.append(len(toks))
            for tok, n in Counter(toks).items():
                self.postings.setdefault(tok, {})[i] = n
        self.avg_len = sum(self.lengths) / max(1, len(self.lengths))

    @classmethod
    def load(cls, path: Path) -> Corpus:
        """Read a HotpotQA-format JSONL file (cached per path, size and mtime)."""
        st = path.stat()
        key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
        if key not in cls._cache:
            cls._cache[key] = cls._read(path)
        return cls._cache[key]

    @classmethod
    def _read(cls, path: Path) -> Corpus:
        questions: list[dict[str, Any]] = []
        pages: dict[str, list[str]] = {}
        seen: set[str] = set()
        with path.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise TaskError(f"{where}: not JSON ({exc.msg})") from None
                if not isinstance(row, dict):
                    raise TaskError(f"{where}: expected an object")
                missing = [k for k in ("id", "question", "answer", "supporting_facts", "context") if k not in row]
                if missing:
                    raise TaskError(f"{where}: missing field(s) {', '.join(missing)}")
                qid = str(row["id"])
                if qid in seen:
                    raise TaskError(f"{where}: duplicate question id {qid!r}")
                seen.add(qid)
                try:
                    for title, sentences in row["context"]:
                        if not isinstance(title, str) or not isinstance(sentences, list):
                            raise TaskError(f"{where}: context entries must be [title, [sentences]]")
                        sents = [str(s).strip() for s in sentences if str(s).strip()]
                        if title not in pages or len(" ".join(sents)) > len(" ".join(pages[title])):
                            pages[title] = sents
                    sup = [(str(t), int(i)) for t, i in row["supporting_facts"]]
                except (TypeError, ValueError):
                    raise TaskError(
                        f"{where}: context must be [[title, [sentences]], ...] and supporting_facts [[title, index], ...]"
                    ) from None
                questions.append({**row, "id": qid, "supporting_facts": sup})
        if not questions:
            raise TaskError(f"{path}: no questions")
        for q in questions:
            for title, _ in q["supporting_facts"]:
                if title not in pages:
                    raise TaskError(f"{path}: question {q['id']!r} cites {title!r}, which no context paragraph has")
        return cls(questions, pages)

    def bm25(self, query: str, k: int) -> list[tuple[float, str]]:
        """The ``k`` best (score, title) over titles and text (k1=1.2, b=0.75)."""
        n = len(self.titles)
        scores: dict[int, float] = {}
        for tok in set(_tokens(query)[:MAX_QUERY_TOKENS]):
            post = self.postings.get(tok)
            if not post:
                continue
            idf = math.log(1 + (n - len(post) + 0.5) / (len(post) + 0.5))
            for doc, tf in post.items():
                norm = tf * 2.2 / (tf + 1.2 * (0.25 + 0.75 * self.lengths[doc] / self.avg_len))
                scores[doc] = scores.get(doc, 0.0) + idf * norm
        best = sorted(scores.items(), key=lambda x: (-x[1], x[0]))[:k]
        return [(s, self.titles[d]) for d, s in best]

    def find(self, entity: str) -> tuple[str | None, bool, list[str]]:
        """(title or None, whether the title matched exactly, similar titles)."""
        entity = entity[: MAX_ECHO * 2]  # titles are short; a runaway argument must not cost seconds
        folded = _fold(entity)
        if folded in self.by_fold:
            return self.by_fold[folded], True, []
        hits = self.bm25(entity, N_SIMILAR)
        ranked = [t for _, t in hits]
        key = _key(entity)
        if key in self.by_key:
            cands = self.by_key[key]
            pick = next((t for t in ranked if t in cands), cands[0])
            return pick, False, []
        close = difflib.get_close_matches(key, self._keys, n=1, cutoff=0.88) if key else []
        if close:
            cands = self.by_key[close[0]]
            return next((t for t in ranked if t in cands), cands[0]), False, []
        if ranked:
            q_toks = set(_tokens(entity)) - _STOP
            t_toks = set(_tokens(_PAREN.sub(" ", ranked[0]))) - _STOP
            # The query names the page and more ('VIVA Media AG' -> 'VIVA Media'), or most of its title.
            if q_toks and t_toks and (t_toks <= q_toks or (q_toks <= t_toks and 2 * len(q_toks) >= len(t_toks) >= 2)):
                return ranked[0], False, []
        return None, False, ranked


def resolve_corpus_path(corpus_path: str | os.PathLike[str] | None) -> Path:
    """The argument, else $LIFEMEM_HOTPOTQA, else the shared data folder; EnvUnavailable names them."""
    if corpus_path is not None:
        path = Path(corpus_path)
        if not path.is_file():
            raise EnvUnavailable(
                f"WebSearchEnv: corpus file {path} does not exist (a HotpotQA distractor-format JSONL)"
            )
        return path
    env_value = os.environ.get(CORPUS_ENV_VAR)
    if env_value:
        path = Path(env_value)
        if not path.is_file():
            raise EnvUnavailable(f"WebSearchEnv: ${CORPUS_ENV_VAR}={env_value} is not a file")
        return path
    candidates = []
    if os.environ.get("LIFEMEM_SHARED_DIR"):
        candidates.append(Path(os.environ["LIFEMEM_SHARED_DIR"]) / _RELATIVE)
    candidates += [Path(__file__).resolve().parents[4] / "shared" / _RELATIVE, DEFAULT_CORPUS]
    for path in candidates:
        if path.is_file():
            return path
    raise EnvUnavailable(
        f"WebSearchEnv: no HotpotQA corpus; set ${CORPUS_ENV_VAR} to a HotpotQA distractor JSONL "
        f"(looked in {', '.join(str(p) for p in candidates)})"
    )


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
            raise InvalidArgumentError(f"WebSearchEnv: train_fraction must be in [0, 1], got {train_fraction!r}")
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
            raise InvalidArgumentError(f"WebSearchEnv: max_steps must be an integer >= 1, got {max_steps!r}")
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
        self._page: str | None = None
        self._lookup: tuple[str, list[str], int] | None = None

    def tasks(self, split: str = "train", limit: int | None = None, seed: int = 0) -> list[Task]:
        """The split's questions: file order for ``seed=0``, else shuffled by ``seed``."""
        if split not in self._tasks:
            raise InvalidArgumentError(f"WebSearchEnv.tasks: split must be 'train' or 'test', got {split!r}")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise InvalidArgumentError(f"WebSearchEnv.tasks: limit must be None or an integer >= 0, got {limit!r}")
        out = list(self._tasks[split])
        if seed:
            random.Random(seed).shuffle(out)
        return out if limit is None else out[:limit]

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Start a question; the observation is the question and the action formats."""
        if not isinstance(task, Task):
            raise TaskError(f"WebSearchEnv.reset: expected a Task, got {type(task).__name__}")
        if task.env != self.name:
            raise TaskError(
                f"WebSearchEnv.reset: task {task.id!r} belongs to environment {task.env!r}, not {self.name!r}"
            )
        if not isinstance(task.payload.get("answer"), str):
            raise TaskError(f"WebSearchEnv.reset: task {task.id!r} payload lacks its answer (a string)")
        self._task, self._done, self._steps = task, False, 0
        self._page, self._lookup = None, None
        obs = (
            f"Question: {task.instruction}\n"
            "Actions: Search[entity] (a page of the corpus), Lookup[keyword] (next sentence with it on the current page), "
            "Finish[answer]."
        )
        return obs, {"instruction": task.instruction, "valid_actions": None, "success": None}

    def step(self, action: str) -> StepResult:
        """One Search, Lookup or Finish; anything else is an invalid action (a step)."""
        if self._task is None:
            raise EnvStateError("WebSearchEnv.step: no episode running; call reset(task) first")
        if self._done:
            raise EnvStateError(f"WebSearchEnv.step: episode of task {self._task.id!r} is over; call reset(task)")
        self._steps += 1
        info: dict[str, Any] = {"instruction": self._task.instruction, "valid_actions": None, "success": None}
        reward, done = 0.0, False
        m = _ACTION.search(action) if isinstance(action, str) else None
        if m is None:
            shown = _cut(action) if isinstance(action, str) else type(action).__name__
            obs = f"Invalid action: {shown}. Use Search[entity], Lookup[keyword] or Finish[answer]."
        else:
            verb, arg = m.group(1).lower(), m.group(2).strip()
            if verb == "finish":
                gold = self._task.payload["answer"]
                em = normalize_answer(arg) == normalize_answer(gold)
                reward, done = (1.0 if em else 0.0), True
                info.update(success=em, em=em, f1=answer_f1(arg, gold), answer=arg)
                obs = "Episode finished, reward = " + str(int(reward))
            elif not arg:
                obs = f"Invalid action: {verb.capitalize()}[...] needs an argument."
            elif verb == "search":
                obs = self._search(arg)
            else:
                obs = self._do_lookup(arg)
        if not done and self._steps >= self.max_steps:
            done = True
            info.update(success=False, em=False, f1=0.0, answer=None)
            obs += f"\nStep limit ({self.max_steps}) reached without Finish[answer]."
        info["page"] = self._page
        self._done = done
        return StepResult(obs, reward, done, info)

    def _search(self, entity: str) -> str:
        title, exact, similar = self.corpus.find(entity)
        if title is None:
            return f"Could not find {_cut(entity)}. Similar: {similar}."
        self._page, self._lookup = title, None
        text = " ".join(self.corpus.pages[title][:SEARCH_SENTENCES])
        return text if exact else f"[{title}] {text}"

    def _do_lookup(self, keyword: str) -> str:
        if self._page is None:
            return "No page to look in: Search[entity] first."
        if self._lookup is None or self._lookup[0] != keyword.lower():
            sents = [s for s in self.corpus.pages[self._page] if keyword.lower() in s.lower()]
            self._lookup = (keyword.lower(), sents, 0)
        kw, sents, i = self._lookup
        if i >= len(sents):
            return "No more results."
        self._lookup = (kw, sents, i + 1)
        return f"(Result {i + 1} / {len(sents)}) {sents[i]}"

    def gold_actions(self, task: Task) -> list[str] | None:
        """Search each supporting-fact title, then Finish with the gold answer."""
        titles = task.payload.get("supporting_titles") or []
        return [f"Search[{t}]" for t in titles] + [f"Finish[{task.payload['answer']}]"]

    def close(self) -> None:
        """Nothing is held but the (shared, cached) corpus."""
        self._task, self._done, self._page, self._lookup = None, True, None, None
