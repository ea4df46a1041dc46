"""The Wikipedia tools of ReAct's HotpotQA and FEVER environments over an offline corpus.

ReAct (Yao et al., 2023) gives its HotpotQA and FEVER agents the same three actions over
live Wikipedia; here the pages are the paragraphs of a HotpotQA distractor-format JSONL file
(:class:`Corpus`) and the rules of the two tools live once, in :class:`WikiBrowser`, which
both :mod:`lifemem_ray.lab.envs.websearch` and :mod:`lifemem_ray.lab.envs.fever` call:

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

:func:`parse_action` takes the first ``Search[...]``/``Lookup[...]``/``Finish[...]`` of an
action (a ReAct label such as ``Action 2:`` or a preceding thought is allowed); what
``Finish`` means is each environment's own. Page text is returned as it is: it is untrusted
data, fenced by the memory and the prompts that show it, never executed.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import unicodedata
from collections import Counter
from pathlib import Path
from typing import Any, ClassVar

from lifemem_ray.lab.envs.base import TaskError
from lifemem_ray.lab.envs.shared_data import find_data_file, json_lines

__all__ = [
    "CORPUS_ENV_VAR",
    "MAX_ECHO",
    "SEARCH_SENTENCES",
    "Corpus",
    "WikiBrowser",
    "fold",
    "parse_action",
    "resolve_corpus_path",
    "shown_action",
    "title_key",
    "tokens",
]

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


def fold(text: str) -> str:
    """Case-, accent- and space-insensitive form of a title or query."""
    text = unicodedata.normalize("NFKD", text)
    text = "".join(ch for ch in text if not unicodedata.combining(ch))
    return " ".join(text.casefold().split())


def title_key(text: str) -> str:
    """A title without its parenthesised qualifier and punctuation: 'Viva (UK and Ireland)' -> 'viva'."""
    return " ".join(_TOKEN.findall(_PAREN.sub(" ", fold(text))))


def _cut(text: str) -> str:
    return text if len(text) <= MAX_ECHO else text[:MAX_ECHO] + "..."


def tokens(text: str) -> list[str]:
    """The folded word tokens of ``text`` (what BM25 indexes and queries)."""
    return _TOKEN.findall(fold(text))


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
            self.by_fold.setdefault(fold(t), t)
            self.by_key.setdefault(title_key(t), []).append(t)
        self._keys = list(self.by_key)
        self.postings: dict[str, dict[int, int]] = {}
        self.lengths: list[int] = []
        for i, t in enumerate(self.titles):
            toks = tokens(t) * 3 + tokens(" ".join(pages[t]))
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
        for _, where, row in json_lines(path):
            if not isinstance(row, dict):
                raise TaskError("expected an object", where=where)
            missing = [k for k in ("id", "question", "answer", "supporting_facts", "context") if k not in row]
            if missing:
                raise TaskError(f"missing field(s) {', '.join(missing)}", where=where)
            qid = str(row["id"])
            if qid in seen:
                raise TaskError(f"duplicate question id {qid!r}", where=where)
            seen.add(qid)
            try:
                for title, sentences in row["context"]:
                    if not isinstance(title, str) or not isinstance(sentences, list):
                        raise TaskError("context entries must be [title, [sentences]]", where=where)
                    sents = [str(s).strip() for s in sentences if str(s).strip()]
                    if title not in pages or len(" ".join(sents)) > len(" ".join(pages[title])):
                        pages[title] = sents
                sup = [(str(t), int(i)) for t, i in row["supporting_facts"]]
            except (TypeError, ValueError):
                raise TaskError(
                    "context must be [[title, [sentences]], ...] and supporting_facts [[title, index], ...]",
                    where=where,
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
        for tok in set(tokens(query)[:MAX_QUERY_TOKENS]):
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
        folded = fold(entity)
        if folded in self.by_fold:
            return self.by_fold[folded], True, []
        hits = self.bm25(entity, N_SIMILAR)
        ranked = [t for _, t in hits]
        key = title_key(entity)
        if key in self.by_key:
            cands = self.by_key[key]
            pick = next((t for t in ranked if t in cands), cands[0])
            return pick, False, []
        close = difflib.get_close_matches(key, self._keys, n=1, cutoff=0.88) if key else []
        if close:
            cands = self.by_key[close[0]]
            return next((t for t in ranked if t in cands), cands[0]), False, []
        if ranked:
            q_toks = set(tokens(entity)) - _STOP
            t_toks = set(tokens(_PAREN.sub(" ", ranked[0]))) - _STOP
            # The query names the page and more ('VIVA Media AG' -> 'VIVA Media'), or most of its title.
            if q_toks and t_toks and (t_toks <= q_toks or (q_toks <= t_toks and 2 * len(q_toks) >= len(t_toks) >= 2)):
                return ranked[0], False, []
        return None, False, ranked


def resolve_corpus_path(corpus_path: str | os.PathLike[str] | None, owner: str = "WebSearchEnv") -> Path:
    """The argument, else $LIFEMEM_HOTPOTQA, else the shared data folder (the one rule of
    :mod:`lifemem_ray.lab.envs.shared_data`); EnvUnavailable names them (and ``owner``, the
    environment asking)."""
    return find_data_file(
        owner, corpus_path, CORPUS_ENV_VAR, _RELATIVE, "HotpotQA corpus (a distractor-format JSONL)", "corpus_path"
    )


# --------------------------------------------------------------------------- the tools


def parse_action(action: object) -> tuple[str, str] | None:
    """(verb in lower case, argument stripped) of the first ``Search/Lookup/Finish[...]`` in
    ``action``; None when there is none (or ``action`` is not a string)."""
    m = _ACTION.search(action) if isinstance(action, str) else None
    return None if m is None else (m.group(1).lower(), m.group(2).strip())


def shown_action(action: object) -> str:
    """How an invalid action is echoed in its observation: cut to ``MAX_ECHO`` characters, or its type."""
    return _cut(action) if isinstance(action, str) else type(action).__name__


class WikiBrowser:
    """Search and Lookup over a :class:`Corpus` for one episode at a time: the page last found
    and the Lookup cursor on it (both cleared by :meth:`reset`)."""

    def __init__(self, corpus: Corpus) -> None:
        self.corpus = corpus
        self.page: str | None = None
        self._lookup: tuple[str, list[str], int] | None = None

    def reset(self) -> None:
        """A new episode: no page, no Lookup cursor."""
        self.page, self._lookup = None, None

    def tool(self, verb: str, arg: str) -> str:
        """The observation of ``Search[arg]`` or ``Lookup[arg]`` (``verb`` as :func:`parse_action` gives it)."""
        if not arg:
            return f"Invalid action: {verb.capitalize()}[...] needs an argument."
        return self.search(arg) if verb == "search" else self.lookup(arg)

    def search(self, entity: str) -> str:
        """The matched page's first sentences (it becomes the current page), or the similar titles."""
        title, exact, similar = self.corpus.find(entity)
        if title is None:
            return f"Could not find {_cut(entity)}. Similar: {similar}."
        self.page, self._lookup = title, None
        text = " ".join(self.corpus.pages[title][:SEARCH_SENTENCES])
        return text if exact else f"[{title}] {text}"

    def lookup(self, keyword: str) -> str:
        """The next sentence of the current page containing ``keyword`` (case-insensitive)."""
        if self.page is None:
            return "No page to look in: Search[entity] first."
        if self._lookup is None or self._lookup[0] != keyword.lower():
            sents = [s for s in self.corpus.pages[self.page] if keyword.lower() in s.lower()]
            self._lookup = (keyword.lower(), sents, 0)
        kw, sents, i = self._lookup
        if i >= len(sents):
            return "No more results."
        self._lookup = (kw, sents, i + 1)
        return f"(Result {i + 1} / {len(sents)}) {sents[i]}"
