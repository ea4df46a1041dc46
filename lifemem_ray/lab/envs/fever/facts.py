"""The text rules of the constructed FEVER claims: the facts a sentence holds, which sentence
can be a claim, and how one fact is changed for a REFUTES claim; the claim records.

The claims themselves are built and checked in :mod:`lifemem_ray.lab.envs.fever.claims`,
whose docstring gives the whole construction."""

from __future__ import annotations

import functools
import html
import math
import random
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass

from lifemem_ray.lab.envs.wiki_tools import tokens

__all__ = [
    "DEMONYMS",
    "LABELS",
    "NEI",
    "REFUTES",
    "STOP_WORDS",
    "SUPPORTS",
    "Claim",
    "ClaimSet",
    "Fact",
    "claim_sentence",
    "find_facts",
    "joined_tokens",
    "mentions",
    "plain_text",
    "refute",
    "subject_of",
    "subject_pattern",
    "value_in",
    "with_value",
]

SUPPORTS, REFUTES, NEI = "SUPPORTS", "REFUTES", "NOT ENOUGH INFO"
LABELS = (SUPPORTS, REFUTES, NEI)
MIN_WORDS, MAX_WORDS = 5, 45


def _wordlist(words: str) -> tuple[str, ...]:
    return tuple(words.split())


def _wordset(words: str) -> frozenset[str]:
    return frozenset(words.split())


_MONTHS = _wordlist("January February March April May June July August September October November December")
_LONG_MONTHS = _wordset("January March May July August October December")
_UK = _wordset("British English Scottish Welsh Irish")  # one may be another: never swapped among them
DEMONYMS = _wordset(
    "American British English Scottish Welsh Irish Canadian Australian Japanese German Italian French Swedish "
    "Spanish Indian Korean Chinese Dutch Thai Norwegian Polish Israeli Russian Mexican Austrian Czech Belgian "
    "Romanian Danish Finnish Greek Turkish Brazilian Argentine Portuguese Swiss Hungarian Egyptian Filipino "
    "Pakistani Iranian Nigerian Ukrainian Cuban Chilean Colombian Icelandic"
)
_LANGUAGE_USE = _wordset("language languages word words name names title translation version dub text term")
_QUALIFIERS = _wordset(
    "over under about around approximately nearly almost some roughly than least most up above below "
    "circa c estimated exceeding just only"
)
STOP_WORDS = _wordset(
    "a an the of in on at to for and or is was are were be been by with from as it its he she his her "
    "their they this that which who whom also has had have not"
)
_YEAR = re.compile(r"(?<![\w.,$£€/–-])(1[0-9]{3}|20[0-2][0-9])(?![\w/–%-]|[.,]\d)")
_NUMBER = re.compile(r"(?<![\w.,$£€/#–-])(\d{1,3}(?:,\d{3})+|\d+)(?![\w/–%-]|[.,]\d)")
_MONTH = re.compile(r"\b(" + "|".join(_MONTHS) + r")\b(?=\s+\d)|(?<=\d\s)(" + "|".join(_MONTHS) + r")\b")
_DEMONYM = re.compile(r"\b(" + "|".join(sorted(DEMONYMS)) + r")\b(?=\s+([a-z]+))")
_PERSON = re.compile(r"\((?:born|b\.)\s|\([^()]*\d{3,4}\s*[–-]\s*[^()]*\d{3,4}\s*\)")
_PRONOUN = re.compile(r"^(He|She|It)\s+(?=[a-z])")
_GARBLED = re.compile(r"[{}\[\]|<>]|\s[,.;:)]|\(\s|\(\)")  # markup, or words lost in the dump
_CUTS = ("; ", " who ", " which ", ", where ")
_QUALIFIER_RE = re.compile(r"\b(more|less|fewer)\s+than\s*$|\b(\w+)\s*$", re.I)


@dataclass(frozen=True)
class Fact:
    """A checkable value in a claim sentence: ``kind`` is year, number, month or demonym."""

    kind: str
    start: int
    end: int
    text: str


@dataclass(frozen=True)
class Claim:
    """One constructed claim; ``sentence_index`` is in the source paragraph as the file has it.

    ``construction``: ``sentence`` (SUPPORTS), the kind of fact changed (REFUTES: ``year``,
    ``number``, ``month``, ``demonym``, with ``original`` and ``changed`` values), or what was
    withheld (NOT ENOUGH INFO: ``withheld-page``, ``withheld-sentence``)."""

    id: str
    split: str
    label: str
    text: str
    source_title: str
    sentence_index: int
    subject: str
    construction: str
    original: str = ""
    changed: str = ""


@dataclass
class ClaimSet:
    """The claims of both splits and the pages the environment serves (the file's, less what
    the NOT ENOUGH INFO claims withheld)."""

    claims: list[Claim]
    pages: dict[str, list[str]]

    def split(self, name: str) -> list[Claim]:
        """The claims of split ``name``, in construction order."""
        return [c for c in self.claims if c.split == name]


# --------------------------------------------------------------------------- text rules


def plain_text(text: str) -> str:
    """``text`` without accents, character for character (same length and offsets)."""
    if text.isascii():
        return text
    return "".join(unicodedata.normalize("NFKD", ch)[:1] or ch for ch in text)


def subject_of(title: str) -> str:
    """What a page is about, as a claim names it: its title without a parenthesised qualifier."""
    return " ".join(re.sub(r"\s*\([^)]*\)\s*", " ", html.unescape(title)).split())


@functools.lru_cache(maxsize=4096)
def subject_pattern(subject: str) -> re.Pattern[str] | None:
    words = re.findall(r"\w+", plain_text(subject))
    if not words:
        return None
    return re.compile(r"(?<!\w)" + r"\W+".join(re.escape(w) for w in words) + r"(?!\w)", re.I)


def mentions(text: str, subject: str) -> bool:
    """Whether ``text`` names ``subject`` (its words in order, any case, accents and punctuation)."""
    pattern = subject_pattern(subject)
    return pattern is not None and pattern.search(plain_text(text)) is not None


def _qualified(text: str, start: int) -> bool:
    """Whether the number at ``start`` is approximate or an identifier (*about 300*, *Route 66*)."""
    before = text[:start].rstrip()
    if not before:
        return False
    m = _QUALIFIER_RE.search(before)
    if m is None:
        return False
    if m.group(1):
        return True
    word = m.group(2) or ""
    return word.lower() in _QUALIFIERS or word[:1].isupper() or word.lower() in ("a", "an", "no", "number")


def find_facts(text: str, subject: str = "") -> list[Fact]:
    """The facts of ``text`` outside the spans that name ``subject``, in text order."""
    pattern = subject_pattern(subject) if subject else None
    masked = [(m.start(), m.end()) for m in pattern.finditer(plain_text(text))] if pattern else []
    found: list[Fact] = []
    for m in _YEAR.finditer(text):
        found.append(Fact("year", m.start(), m.end(), m.group(0)))
    for m in _NUMBER.finditer(text):
        value = int(m.group(0).replace(",", ""))
        is_year = "," not in m.group(0) and len(m.group(0)) == 4 and _YEAR.fullmatch(m.group(0))
        if not is_year and value >= 2 and not _qualified(text, m.start()):
            found.append(Fact("number", m.start(), m.end(), m.group(0)))
    for m in _MONTH.finditer(text):
        found.append(Fact("month", m.start(), m.end(), m.group(0)))
    for m in _DEMONYM.finditer(text):
        before = text[: m.start()].rstrip().split()
        if (before and before[-1][:1].isupper()) or m.group(2) in _LANGUAGE_USE:
            continue  # part of a name (South Korean, Latin American) or a language (English name)
        found.append(Fact("demonym", m.start(), m.end(), m.group(1)))
    outside = [f for f in found if not any(f.start < e and s < f.end for s, e in masked)]
    return sorted(outside, key=lambda f: (f.start, f.kind))


def _changeable(text: str, subject: str) -> list[Fact]:
    """The facts of ``text`` a REFUTES claim may change: not ones the subject's name repeats
    (*the 1952 team ... in the 1952 season*: changed, the claim would contradict itself)."""
    named = set(tokens(subject))
    return [f for f in find_facts(text, subject) if not set(tokens(f.text)) & named]


def _is_person(first_sentence: str) -> bool:
    return _PERSON.search(first_sentence) is not None


def _shorten(text: str, subject: str) -> str:
    """``text`` up to its first cut point (``; ``, `` who `` ...) when what is left keeps a fact."""
    best = text
    for cut in _CUTS:
        i = text.find(cut)
        if i > 0:
            head = text[:i].rstrip(" ,") + "."
            if len(head) < len(best) and len(head.split()) >= MIN_WORDS and _changeable(head, subject):
                best = head
    return best


def claim_sentence(title: str, sentences: Sequence[str], index: int) -> str | None:
    """The claim sentence made of ``sentences[index]`` of the page ``title`` (see the module
    docstring), or None when that sentence cannot be one."""
    subject = subject_of(title)
    if len(subject) < 3 or not re.search(r"[A-Za-z]", subject) or not 0 <= index < len(sentences):
        return None
    text = " ".join(html.unescape(sentences[index]).split())
    if not text.endswith(".") or not text[:1].isupper() or _GARBLED.search(text):
        return None
    if text.count('"') % 2 or text.count("(") != text.count(")"):
        return None
    if not mentions(text, subject):
        m = _PRONOUN.match(text)
        first = html.unescape(sentences[0])
        if index != 1 or m is None or not mentions(first, subject):
            return None
        if (m.group(1) == "It") == _is_person(first):
            return None  # He/She on a person's page, It on any other
        text = subject + " " + text[m.end() :]
    text = _shorten(text, subject)
    if not MIN_WORDS <= len(text.split()) <= MAX_WORDS or not _changeable(text, subject):
        return None
    return text


# --------------------------------------------------------------------------- changing a fact


def value_in(value: str, text_tokens: str) -> bool:
    """Whether ``value``'s tokens occur, in order, in ``text_tokens`` (a space-joined token string)."""
    return f" {' '.join(tokens(value))} " in text_tokens


def joined_tokens(texts: Sequence[str]) -> str:
    return " " + " ".join(" ".join(tokens(html.unescape(t))) for t in texts) + " "


def _alternatives(fact: Fact, claim: str, demonyms: dict[str, int], rng: random.Random) -> list[str]:
    """Replacement values for ``fact``, in a seeded order; a nationality drawn by how often the
    corpus uses it (uniform draws would make rare ones a sign of a changed claim)."""
    if fact.kind == "year":
        year = int(fact.text)
        out = [str(year + d) for d in (*range(-9, 0), *range(1, 10)) if year + d <= 2025]
    elif fact.kind == "number":
        n = int(fact.text.replace(",", ""))
        top = 28 if re.match(r"\s+(?:" + "|".join(_MONTHS) + r")\b", claim[fact.end :]) else None  # a day
        out = []
        for share in (0.2, 0.3, 0.5, 1.0):
            step = max(1, math.ceil(n * share))  # at least ``share`` of n: a change of 20 % or more
            for m in (n + step, n - step):
                if m >= 2 and m != n and (top is None or m <= top):
                    out.append(f"{m:,}" if "," in fact.text else str(m))
    elif fact.kind == "month":
        day = re.match(r"\s+(\d{1,2})\b", claim[fact.end :])
        long_only = day is not None and int(day.group(1)) > 28
        out = [m for m in _MONTHS if m != fact.text and (not long_only or m in _LONG_MONTHS)]
    else:
        out = [d for d in sorted(demonyms) if d != fact.text and not (d in _UK and fact.text in _UK)]
        return sorted(out, key=lambda d: -(rng.random() ** (1.0 / demonyms[d])))  # weighted, without replacement
    out = list(dict.fromkeys(out))
    rng.shuffle(out)
    return out


def with_value(claim: str, fact: Fact, value: str) -> str:
    """``claim`` with ``fact`` replaced by ``value`` (and a/an before a nationality agreeing)."""
    before, after = claim[: fact.start], claim[fact.end :]
    if fact.kind == "demonym":
        article = re.search(r"\b([Aa]n?)\s+$", before)
        if article:
            word = (
                ("an" if value[0] in "AEIOU" else "a")
                if article.group(1).islower()
                else ("An" if value[0] in "AEIOU" else "A")
            )
            before = before[: article.start(1)] + word + before[article.end(1) :]
    return before + value + after


def refute(
    claim: str, subject: str, paragraph: str, demonyms: dict[str, int], rng: random.Random
) -> tuple[str, Fact, str] | None:
    """(changed claim, fact changed, new value): the first (seeded) change whose value the
    paragraph does not hold."""
    facts = _changeable(claim, subject)
    rng.shuffle(facts)
    for fact in facts:
        for value in _alternatives(fact, claim, demonyms, rng):
            if not value_in(value, paragraph):
                return with_value(claim, fact, value), fact, value
    return None
