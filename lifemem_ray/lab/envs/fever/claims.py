"""FEVER-style claims constructed from HotpotQA paragraphs, labelled by construction and checked.

FEVER's claims were written by people from Wikipedia sentences and labelled against all of
Wikipedia; none ship here. This module builds claims of the same three kinds from the
paragraphs of a HotpotQA distractor-format file (:class:`~lifemem_ray.lab.envs.wiki_tools.Corpus`),
deterministically for a seed, and :func:`validate_claim` checks each against the corpus the
environment serves (:class:`ClaimSet.pages`):

* a **claim sentence** is a sentence of a paragraph that names the paragraph's subject (its
  title without a parenthesised qualifier), or, right after such a first sentence, starts
  with *He*, *She* or *It* (replaced by the subject: a person's page for *He*/*She*); a
  relative or second clause may be cut off (``; ``, `` who ``, `` which ``, ``, where ``)
  when what is left still holds a fact. It must hold a **fact** outside the subject's name:
  a year, a plain number (no *about*, *over* ... before it), a month of a date, or a
  nationality (*American singer*). Every label is built from such sentences, so the
  claims of the three labels read alike.
* ``SUPPORTS``: the claim sentence itself, which the served paragraph states.
* ``REFUTES``: the claim sentence with one fact changed: a year moved by 1 to 9, a number
  changed by 20 % or more, another month, or another nationality that occurs in the
  corpus (not one of the British Isles' for another); the new value occurs nowhere in the
  source paragraph nor in any served sentence about the subject, and the source sentence,
  which contradicts it, stays served.
* ``NOT ENOUGH INFO``: the claim sentence of a paragraph that is then withheld from the
  served corpus: only that sentence where that suffices (the page stays, without it), else
  the whole paragraph (its subject's name then names no served page); no served sentence
  about the subject (on its page, or naming it) states any of the claim's facts or most of
  its words, and no served sentence anywhere repeats most of its words.

Only sentences that could make a NOT ENOUGH INFO claim are used, for every label (see
:class:`_Builder`). Each source paragraph gives at most one claim and belongs to one split,
so the train and test claims share no source paragraph. Labels cycle in blocks of three (in
a seeded order per block), so any prefix of a split is balanced within one claim per label.
"""

from __future__ import annotations

import hashlib
import html
import math
import random
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from lifemem_ray.core.errors import InvalidArgumentError
from lifemem_ray.lab.envs.fever.facts import (
    DEMONYMS,
    LABELS,
    NEI,
    REFUTES,
    STOP_WORDS,
    SUPPORTS,
    Claim,
    ClaimSet,
    claim_sentence,
    find_facts,
    joined_tokens,
    plain_text,
    refute,
    subject_of,
    subject_pattern,
    value_in,
    with_value,
)
from lifemem_ray.lab.envs.wiki_tools import fold, title_key, tokens

__all__ = ["ClaimChecker", "build_claims", "validate_claim", "validate_claims"]

SUPPORT_SHARE, DUPLICATE_SHARE = 0.5, 0.7  # of a claim's content words, see _served_hits

# --------------------------------------------------------------------------- the served corpus


@dataclass(frozen=True)
class _Row:
    """One sentence as the checks read it: its words, its tokens joined (``" a b "``), its plain text."""

    title: str
    index: int
    words: frozenset[str]
    joined: str
    plain: str


class _Sentences:
    """Every sentence of some pages, with a word index; withheld ones are skipped."""

    def __init__(self, pages: dict[str, list[str]]) -> None:
        self.rows: list[_Row] = []
        self.by_word: dict[str, list[int]] = {}
        self.by_title: dict[str, list[int]] = {}
        self.withheld: set[int] = set()
        for title, sentences in pages.items():
            for i, text in enumerate(sentences):
                text = html.unescape(text)
                toks = tokens(text)
                sid = len(self.rows)
                self.by_title.setdefault(title, []).append(sid)
                for w in set(toks):
                    self.by_word.setdefault(w, []).append(sid)
                self.rows.append(_Row(title, i, frozenset(toks), " " + " ".join(toks) + " ", plain_text(text)))

    def withhold(self, title: str, index: int | None = None) -> None:
        """Leave out sentence ``index`` of ``title``, or all of them."""
        self.withheld.update(sid for sid in self.by_title.get(title, ()) if index in (None, self.rows[sid].index))

    def restore(self, title: str) -> None:
        self.withheld.difference_update(self.by_title.get(title, ()))

    def about(self, title: str, subject: str) -> list[_Row]:
        """The served sentences about ``subject``: those of page ``title`` and those naming it."""
        words = set(tokens(subject))
        ids = set(self.by_title.get(title, ()))
        if words:
            postings = sorted((self.by_word.get(w, []) for w in words), key=len)
            named = set(postings[0]).intersection(*postings[1:])
            pattern = subject_pattern(subject)
            ids |= {sid for sid in named if pattern is not None and pattern.search(self.rows[sid].plain)}
        return [self.rows[sid] for sid in sorted(ids - self.withheld)]

    def sharing(self, words: set[str], share: float) -> list[_Row]:
        """The served sentences holding at least ``share`` of ``words``."""
        need = share * len(words)
        # A sentence with ``need`` of the words has one of the len - need + 1 rarest.
        rare = sorted(words, key=lambda w: (len(self.by_word.get(w, ())), w))[: len(words) - math.ceil(need) + 1]
        ids = {sid for w in rare for sid in self.by_word.get(w, ())} - self.withheld
        return [self.rows[sid] for sid in sorted(ids) if len(words & self.rows[sid].words) >= need]


def _content(text: str, subject: str) -> set[str]:
    return set(tokens(html.unescape(text))) - set(tokens(subject)) - STOP_WORDS


def _served_hits(claim: Claim, index: _Sentences, facts: Sequence[str]) -> list[str]:
    """What the served sentences say about ``claim``: a sentence about the subject (on its page
    or naming it) stating one of ``facts`` or most of the claim's content words, or any sentence
    repeating nearly all of them. Empty: nothing served supports or refutes it."""
    content = _content(claim.text, claim.subject)
    problems = []
    for row in index.about(claim.source_title, claim.subject):
        stated = [f for f in facts if value_in(f, row.joined)]
        if stated or len(content & row.words) >= SUPPORT_SHARE * len(content):
            said = stated or "most of its words"
            problems.append(f"served sentence {row.index} of {row.title!r} is about {claim.subject!r} and has {said}")
    if content:
        for row in index.sharing(content, DUPLICATE_SHARE):
            problems.append(f"served sentence {row.index} of {row.title!r} repeats most of the claim")
    return problems


def _claim_id(title: str, index: int) -> str:
    return "claim-" + hashlib.blake2b(f"{title}\x00{index}".encode(), digest_size=5).hexdigest()


# --------------------------------------------------------------------------- checking


class ClaimChecker:
    """Checks claims against ``served`` (title -> sentences, what the environment serves) and
    ``source`` (the file's pages, which the claims were built from). During construction,
    :meth:`withhold` and :meth:`restore` change what is served."""

    def __init__(self, source: dict[str, list[str]], served: dict[str, list[str]]) -> None:
        self.source = source
        self.served = {t: list(s) for t, s in served.items()}
        self.index = _Sentences(self.served)
        self._folds: dict[str, int] = {}
        self._keys: dict[str, int] = {}
        for t in self.served:
            self._folds[fold(t)] = self._folds.get(fold(t), 0) + 1
            self._keys[title_key(t)] = self._keys.get(title_key(t), 0) + 1

    def withhold(self, title: str, index: int | None = None) -> None:
        """Stop serving sentence ``index`` of ``title`` (as the source has it), or the whole page."""
        self.index.withhold(title, index)
        if index is None:
            del self.served[title]
            self._folds[fold(title)] -= 1
            self._keys[title_key(title)] -= 1
        else:
            self.served[title] = [s for i, s in enumerate(self.source[title]) if i != index]

    def restore(self, title: str) -> None:
        """Serve ``title`` whole again (undo :meth:`withhold`)."""
        self.index.restore(title)
        if title not in self.served:
            self._folds[fold(title)] += 1
            self._keys[title_key(title)] += 1
        self.served[title] = list(self.source[title])

    def check(self, claim: Claim) -> list[str]:
        """What is wrong with ``claim``; empty when it holds (see the module docstring)."""
        where = f"claim {claim.id} ({claim.label}, {claim.source_title!r} sentence {claim.sentence_index})"
        sentences = self.source.get(claim.source_title)
        if claim.label not in LABELS:
            return [f"{where}: unknown label"]
        if sentences is None:
            return [f"{where}: no such source page"]
        base = claim_sentence(claim.source_title, sentences, claim.sentence_index)
        if base is None or claim.subject != subject_of(claim.source_title):
            return [f"{where}: its sentence is not a claim sentence"]
        if claim.label == REFUTES:
            problems = self._check_refuted(claim, base)
        elif claim.text != base:
            problems = ["the text is not its claim sentence"]
        elif claim.label == SUPPORTS:
            problems = self._check_found(claim)
        else:
            problems = self._check_unverifiable(claim)
        return [f"{where}: {p}" for p in problems]

    def _check_found(self, claim: Claim) -> list[str]:
        """The evidence sentence is served on a page that Search[title] finds."""
        served = self.served.get(claim.source_title)
        if served is None or self.source[claim.source_title][claim.sentence_index] not in served:
            return ["its evidence sentence is not served"]
        if self._folds.get(fold(claim.source_title), 0) != 1:
            return ["another served page has the same title"]
        return []

    def _check_refuted(self, claim: Claim, base: str) -> list[str]:
        changes = [
            f for f in find_facts(base, claim.subject) if f.kind == claim.construction and f.text == claim.original
        ]
        if not any(with_value(base, f, claim.changed) == claim.text for f in changes) or claim.text == base:
            return [f"the text is not its claim sentence with {claim.original!r} changed to {claim.changed!r}"]
        if value_in(claim.changed, joined_tokens(self.source[claim.source_title])):
            return [f"the source paragraph holds {claim.changed!r}"]
        for row in self.index.about(claim.source_title, claim.subject):
            if value_in(claim.changed, row.joined):
                return [
                    f"served sentence {row.index} of {row.title!r} is about {claim.subject!r} and has {claim.changed!r}"
                ]
        return self._check_found(claim)

    def _check_unverifiable(self, claim: Claim) -> list[str]:
        served = self.served.get(claim.source_title)
        if claim.construction == "withheld-page":
            if served is not None:
                return ["its source page is served"]
            if self._keys.get(title_key(claim.subject), 0):
                return ["a served page has its subject's name"]
        elif claim.construction == "withheld-sentence":
            if served is None or self.source[claim.source_title][claim.sentence_index] in served:
                return ["its source page is not served without its sentence"]
        else:
            return [f"unknown construction {claim.construction!r}"]
        return _served_hits(claim, self.index, [f.text for f in find_facts(claim.text, claim.subject)])


def validate_claim(claim: Claim, source: dict[str, list[str]], served: dict[str, list[str]]) -> list[str]:
    """What is wrong with one claim against the pages ``served`` (empty: it holds)."""
    return ClaimChecker(source, served).check(claim)


def validate_claims(claims: ClaimSet, source: dict[str, list[str]]) -> list[str]:
    """What is wrong with a claim set: each claim against its served pages, unique ids, and no
    source paragraph in two claims (hence none shared by the splits)."""
    checker = ClaimChecker(source, claims.pages)
    problems = [p for c in claims.claims for p in checker.check(c)]
    for attr in ("id", "source_title"):
        seen: dict[str, str] = {}
        for c in claims.claims:
            value = getattr(c, attr)
            if value in seen:
                problems.append(f"claims {seen[value]} and {c.id} share their {attr} {value!r}")
            seen.setdefault(value, c.id)
    return problems


# --------------------------------------------------------------------------- construction


def _label_cycle(n: int, rng: random.Random) -> list[str]:
    """``n`` labels in blocks of three, each block in a seeded order."""
    out: list[str] = []
    while len(out) < n:
        block = list(LABELS)
        rng.shuffle(block)
        out += block
    return out[:n]


class _Builder:
    """One construction: the candidate sentences of the pages not yet used, and the checker
    whose served pages change as NOT ENOUGH INFO claims withhold theirs.

    Only sentences that could make a NOT ENOUGH INFO claim (nothing else in the corpus states
    their facts) are candidates, for every label: were SUPPORTS and REFUTES claims drawn from
    all sentences, being little cited elsewhere would hint at NOT ENOUGH INFO."""

    KINDS = ("withheld-sentence", "withheld-page")  # preferred first: the page stays, as in FEVER mostly

    def __init__(self, pages: dict[str, list[str]], seed: int) -> None:
        self.rng = random.Random(f"lifemem-fever:{seed}")
        self.checker = ClaimChecker(pages, pages)
        self.candidates: dict[str, list[tuple[int, str, tuple[str, ...]]]] = {}
        for title in sorted(pages):
            found = []
            for i in range(len(pages[title])):
                text = claim_sentence(title, pages[title], i)
                if text and (kinds := tuple(k for k in self.KINDS if self._could_be_nei(title, i, text, k))):
                    found.append((i, text, kinds))
            if found:
                self.rng.shuffle(found)
                self.candidates[title] = found
        self.order = list(self.candidates)
        self.rng.shuffle(self.order)
        text = " ".join(" ".join(s) for s in pages.values())
        counts = Counter(w for w in re.findall(r"\b[A-Z][a-z]+\b", text) if w in DEMONYMS)
        self.demonyms = dict(sorted(counts.items()))

    def _could_be_nei(self, title: str, index: int, text: str, kind: str) -> bool:
        """Whether the sentence makes a NOT ENOUGH INFO claim of ``kind`` (nothing is left withheld)."""
        claim = self._try(title, index, text, NEI, kind, "")
        if claim is not None:
            self.checker.restore(title)
        return claim is not None

    def next_claim(self, label: str, split: str) -> Claim | None:
        """The first claim of ``label`` that an unused page gives and that checks; None if none does."""
        for title in self.order:
            for index, text, kinds in self.candidates[title]:
                for kind in kinds if label == NEI else (label,):
                    claim = self._try(title, index, text, label, kind, split)
                    if claim is not None:
                        self.order.remove(title)
                        return claim
        return None

    def _try(self, title: str, index: int, text: str, label: str, kind: str, split: str) -> Claim | None:
        """The claim of ``label`` that sentence ``index`` of ``title`` makes, if it checks (a NOT
        ENOUGH INFO one leaves its page or sentence withheld)."""
        subject, cid = subject_of(title), _claim_id(title, index)
        if label == SUPPORTS:
            claim = Claim(cid, split, label, text, title, index, subject, "sentence")
        elif label == REFUTES:
            paragraph = joined_tokens(self.checker.source[title])
            changed = refute(text, subject, paragraph, self.demonyms, self.rng)
            if changed is None:
                return None
            new_text, fact, value = changed
            claim = Claim(cid, split, label, new_text, title, index, subject, fact.kind, fact.text, value)
        else:
            if kind == "withheld-sentence" and len(self.checker.source[title]) < 2:
                return None
            claim = Claim(cid, split, label, text, title, index, subject, kind)
            self.checker.withhold(title, None if kind == "withheld-page" else index)
        if self.checker.check(claim):
            if label == NEI:
                self.checker.restore(title)
            return None
        return claim


def build_claims(pages: dict[str, list[str]], *, n_train: int, n_test: int, seed: int = 0) -> ClaimSet:
    """Up to ``n_test`` test and ``n_train`` train claims from ``pages`` (title -> sentences),
    labels balanced (see the module docstring); fewer where the pages cannot give more."""
    for name, n in (("n_train", n_train), ("n_test", n_test)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InvalidArgumentError(f"{name} must be an integer >= 0, got {n!r}", where="build_claims")
    builder = _Builder(pages, seed)
    claims: list[Claim] = []
    for split, n in (("test", n_test), ("train", n_train)):
        exhausted: set[str] = set()
        for label in _label_cycle(n, builder.rng):
            claim = None if label in exhausted else builder.next_claim(label, split)
            if claim is None:
                exhausted.add(label)
            else:
                claims.append(claim)
    return ClaimSet(claims, builder.checker.served)
