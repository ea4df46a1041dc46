"""Errors carry the location they name as data (``LifeMemError.where``), never only in their
message's text: a raise whose message starts with a field path (``"steps[0]: ..."``,
``f"{where}: ..."``) must give it as ``where=`` instead, so the front door and a form can read
it without parsing the message."""

from __future__ import annotations

import re

from test_error_discipline import ROOT, library_files

PATH = r"[A-Za-z_]\w*(?:\[\{?\w+\}?\])*(?:\.[A-Za-z_]\w*(?:\[\{?\w+\}?\])*)*"
LOCATION = r"(?:\{(?:where|at|what)\}(?:\.[A-Za-z_]\w*|\[\{?\w+\}?\])*|" + PATH + r")"
LEADING = re.compile(r'\b\w+Error\(\s*f?"' + LOCATION + r": ")
SENTENCES = ("shared", "trajectory", "key", "scope")  # words that begin a sentence, not a field path


def test_no_error_keeps_its_location_only_in_its_message():
    found = []
    for path in library_files():
        text = path.read_text(encoding="utf-8")
        for match in LEADING.finditer(text):
            head = match.group(0).split('"', 1)[1].split(":")[0]
            if head in SENTENCES:
                continue
            line = text.count("\n", 0, match.start()) + 1
            found.append(f"{path.relative_to(ROOT)}:{line}: {match.group(0)!r}")
    assert found == [], "give the location as where=...:\n" + "\n".join(found)
