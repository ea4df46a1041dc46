"""The settings reference (``docs/configuration.md``) from the code: each key's default and
bounds as the :class:`~lifemem_ray.core.settings.Section` declares them, checked against the
document or written into it.

The document's tables hold one row per key: ``| `section.key` | default | bounds | meaning |``.
The default and bounds columns come from the code (``BOUNDS`` and ``CHOICES``; a key whose
rule is prose, such as "at most 4,096 printable characters", keeps the document's words); the
meaning column is the document's, and a key the document lacks gets the comment written beside
its field. ``docs/generate_configuration.py`` runs this over the project's settings.

>>> from dataclasses import dataclass
>>> @dataclass
... class Search(Section):
...     NAME = "search"
...     BOUNDS = {"k": (1, 100)}
...     CHOICES = {"mode": ("fast", "exact")}
...     k: int = 4  # results per query
...     mode: str = "fast"  # how to search
>>> [(r.key, r.default, r.bounds) for r in section_rows(Search)]
[('search.k', '4', '1-100'), ('search.mode', '`"fast"`', '`fast`, `exact`')]
>>> check_document("| `search.k` | 8 | 1-100 | results |", [(Search, True)])[0]
'search.k: the document says default 8, the code 4'
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import json
import math
import re
import tokenize
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lifemem_ray.core.settings import Section

__all__ = ["ReferenceRow", "check_document", "format_value", "rewrite_document", "section_rows"]

_ROW = re.compile(
    r"^\| `(?P<key>[A-Za-z_][\w.]*)` \|\s*(?P<default>[^|]*?)\s*\|\s*(?P<bounds>[^|]*?)\s*\|(?P<rest>.*)$"
)
_NOTE = re.compile(r"\s+\([^()]*\)$")  # an annotation after a default: "0 (off)", "16,777,216 (16 MiB)"


@dataclass(frozen=True)
class ReferenceRow:
    """One key as the code declares it: its name in the document, default, bounds (empty: no
    numeric bound and no choices) and the comment beside its field."""

    key: str
    default: str
    bounds: str
    meaning: str


def format_value(value: Any) -> str:
    """A number as the document writes it: integers from 10,000 up with thousands separators
    (a port reads 8000), a whole float as an integer, others as Python writes them;
    ``true``/``false``; texts, lists and tables as JSON in backticks.

    >>> format_value(16_777_216), format_value(8000), format_value(60.0), format_value(0.95), format_value(True)
    ('16,777,216', '8000', '60', '0.95', 'true')
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    if isinstance(value, int):
        return f"{value:,}" if abs(value) >= 10_000 else str(value)
    if isinstance(value, float):
        return repr(value)
    return f"`{json.dumps(value)}`"


def _bounds_text(section: type[Section], name: str) -> str:
    if name in section.BOUNDS:
        low, high = section.BOUNDS[name]
        return f"{format_value(low)}-{format_value(high)}"
    if name in section.CHOICES:
        return ", ".join(f"`{choice}`" for choice in section.CHOICES[name])
    return ""


def field_comments(section: type[Section]) -> dict[str, str]:
    """The comment written after each field's declaration in ``section``'s source."""
    try:
        source = inspect.getsource(section)
    except (OSError, TypeError):  # defined where no source is kept (an interactive session)
        return {}
    out: dict[str, str] = {}
    pending: str | None = None
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.NAME and token.start[1] == 4 and pending is None:
            pending = token.string
        elif token.type == tokenize.COMMENT and pending is not None:
            out.setdefault(pending, token.string.lstrip("# ").strip())
        if token.type in (tokenize.NEWLINE, tokenize.NL):
            pending = None
    return out


def section_rows(section: type[Section], prefixed: bool = True) -> list[ReferenceRow]:
    """The rows of ``section``'s keys, in declaration order (``prefixed``: named
    ``section.key``, else ``key``)."""
    comments = field_comments(section)
    defaults = section()
    rows = []
    for f in dataclasses.fields(section):  # type: ignore[arg-type]
        key = f"{section.NAME}.{f.name}" if prefixed else f.name
        value = getattr(defaults, f.name)
        rows.append(ReferenceRow(key, format_value(value), _bounds_text(section, f.name), comments.get(f.name, "")))
    return rows


def _same_default(documented: str, code: str) -> bool:
    documented = _NOTE.sub("", documented.strip())
    if documented == code:
        return True
    try:
        a, b = float(documented.replace(",", "")), float(code.replace(",", ""))
    except ValueError:
        return False
    return math.isclose(a, b)


def check_document(text: str, sections: Sequence[tuple[type[Section], bool]]) -> list[str]:
    """What the document says otherwise than the code: a key missing, a default or bounds
    that differ, a row naming a key the code lacks; empty when they agree.

    Args:
        text: the document (Markdown).
        sections: each section class and whether its keys are written ``section.key``.

    Returns:
        One sentence per disagreement.
    """
    documented = {m["key"]: m for m in map(_ROW.match, text.splitlines()) if m}
    problems = []
    known = set()
    for section, prefixed in sections:
        for row in section_rows(section, prefixed):
            known.add(row.key)
            found = documented.get(row.key)
            if found is None:
                problems.append(f"{row.key}: missing from the document")
                continue
            if not _same_default(found["default"], row.default):
                problems.append(
                    f"{row.key}: the document says default {found['default'].strip()}, the code {row.default}"
                )
            if row.bounds and found["bounds"].strip() != row.bounds:
                problems.append(f"{row.key}: the document says bounds {found['bounds'].strip()}, the code {row.bounds}")
            if not row.bounds and re.fullmatch(r"[\d,.]+-[\d,.]+", found["bounds"].strip()):
                problems.append(f"{row.key}: the document gives bounds {found['bounds'].strip()}, the code none")
    problems += [f"{key}: documented, but no such setting" for key in documented if key not in known and "." in key]
    return problems


def rewrite_document(text: str, sections: Sequence[tuple[type[Section], bool]]) -> str:
    """``text`` with every known row's default and bounds taken from the code (a default's
    annotation such as "(off)" kept while the value agrees; prose bounds kept where the code
    declares none). Rows for keys the document lacks are not invented here:
    :func:`check_document` names them, with the field's comment as the meaning to start from."""
    rows = {row.key: row for section, prefixed in sections for row in section_rows(section, prefixed)}
    out = []
    for line in text.splitlines():
        m = _ROW.match(line)
        row = rows.get(m["key"]) if m else None
        if m is None or row is None:
            out.append(line)
            continue
        note = _NOTE.search(m["default"].strip())
        default = row.default + (note.group(0) if note and _same_default(m["default"], row.default) else "")
        bounds = row.bounds or m["bounds"].strip()
        out.append(
            f"| `{row.key}` | {default} | {bounds} |{m['rest']}"
            if bounds
            else f"| `{row.key}` | {default} | |{m['rest']}"
        )
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")
