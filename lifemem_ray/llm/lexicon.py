"""The English lexicon that tells plain prose from everything else in generated text (used by
:mod:`lifemem_ray.llm.provenance`).

The words come from the ``english-words`` package (MIT licence; pure data, read offline from
the installed package): the union of its ``web2`` list (Webster's Second International, 1934)
and its ``gcide`` list (GNU's Collaborative International Dictionary of English, built on
Webster's 1913), lower-cased, letters only: 262,866 words. Both dictionaries are older than
computing, and that is what makes them useful here: command names (``sudo``, ``wget``,
``mkfs``), package names, hosts and jargon are not in them, so a generated text that uses them
needs provenance. A few old words that are commands too (``pip``, ``bash``, ``curl``) are
handled by :data:`lifemem_ray.llm.provenance.OPERATOR_WORDS`.

Two additions, both small and documented here:

* inflections: the lists hold headwords (``search``, not ``searched``), so :func:`entries` tries
  the usual English suffixes (``-s``, ``-es``, ``-ies``, ``-ed``, ``-ing``, ``-er``, ``-est``,
  ``-ly``) and a compound of two words of at least three letters each (``workflow``,
  ``checkbox``, ``website``);
* :data:`MODERN_WORDS`: everyday words of today's prose about software that the old
  dictionaries lack (``api``, ``url``, ``etc``). None of them names a command, a host, a
  package manager or a credential.

The words are held as a sorted array of 64-bit string hashes (about 2 MB instead of about 34 MB
of Python strings); every process that checks generated text (an engine, each Ray shard, the
coordinator) loads it once, in well under a second. The hashes are Python's own ``hash`` and
therefore valid in this process only; two words colliding is about a 1 in 10**13 chance.
"""

from __future__ import annotations

import functools
import threading

import numpy as np

__all__ = ["MODERN_WORDS", "SOURCES", "entries", "is_word", "size", "stems"]

SOURCES = ("web2", "gcide")  # word lists of the english-words package
MIN_COMPOUND_PART = 3  # letters of each half of a two-word compound ("workflow" = work + flow)
MODERN_WORDS = frozenset(
    [
        "ack",
        "api",
        "apis",
        "app",
        "apps",
        "url",
        "urls",
        "json",
        "html",
        "csv",
        "pdf",
        "sql",
        "etc",
        "vs",
        "eg",
        "ie",
        "info",
        "ui",
        "faq",
        "wifi",
        "email",
        "emails",
        "inbox",
    ]
)

_lock = threading.Lock()
_hashes: np.ndarray | None = None


def _table() -> np.ndarray:
    """The sorted hashes of every word, loaded on first use (thread-safe, once per process)."""
    global _hashes
    if _hashes is None:
        with _lock:
            if _hashes is None:
                from english_words import get_english_words_set

                words = get_english_words_set(list(SOURCES), alpha=True, lower=True) | MODERN_WORDS
                table = np.fromiter((hash(w) for w in words), dtype=np.int64, count=len(words))
                table.sort()
                _hashes = table
    return _hashes


def size() -> int:
    """How many words the lexicon holds (loads it)."""
    return int(_table().size)


def _listed(word: str) -> bool:
    table = _table()
    key = hash(word)
    at = int(np.searchsorted(table, key))
    return at < table.size and int(table[at]) == key


def stems(word: str) -> tuple[str, ...]:
    """``word`` (lower case) and the headwords it may be an inflection of, most likely first.

    >>> stems("searched")
    ('searched', 'search', 'searche')
    """
    out = [word]
    n = len(word)

    def add(candidate: str) -> None:
        if len(candidate) >= 2 and candidate not in out:
            out.append(candidate)

    for suffix in ("ies", "ied", "ier", "iest", "ily"):
        if n > len(suffix) + 1 and word.endswith(suffix):
            add(word[: -len(suffix)] + "y")  # tries -> try, easily -> easy
    for suffix in ("s", "es", "ed", "er", "ing", "est", "ly", "ally"):
        if n > len(suffix) + 1 and word.endswith(suffix):
            base = word[: -len(suffix)]
            add(base)
            if suffix in ("ed", "er", "ing", "est"):
                add(base + "e")  # used -> use, larger -> large, using -> use
                if len(base) > 2 and base[-1] == base[-2]:
                    add(base[:-1])  # stopped -> stop, running -> run
    return tuple(out)


@functools.lru_cache(maxsize=65536)
def entries(word: str) -> tuple[str, ...] | None:
    """The lexicon entries ``word`` is made of: one (itself, or the headword it inflects) or
    two (a compound, ``workflow`` -> ``work``, ``flow``); None when it is not English by this
    lexicon. Compared in lower case; letters only.

    >>> entries("Searched"), entries("workflows"), entries("wget")
    (('search',), ('work', 'flow'), None)
    """
    word = word.lower()
    if not word.isalpha():
        return None
    for candidate in stems(word):
        if _listed(candidate):
            return (candidate,)
    for cut in range(MIN_COMPOUND_PART, len(word) - MIN_COMPOUND_PART + 1):
        head, tail = word[:cut], word[cut:]
        if _listed(head):
            found = next((t for t in stems(tail) if len(t) >= MIN_COMPOUND_PART and _listed(t)), None)
            if found is not None:
                return (head, found)
    return None


def is_word(word: str) -> bool:
    """Whether ``word`` is English by this lexicon (see :func:`entries`)."""
    return entries(word) is not None
