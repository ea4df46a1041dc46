"""The settings reference's check and rewrite (lifemem_ray.core.settings_reference) on a page
that drifted from its code; the project's own page: tests/actors/test_configuration_page.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from lifemem_ray.core.settings import Section
from lifemem_ray.core.settings_reference import check_document, rewrite_document


@dataclass
class Probe(Section):
    NAME = "probe"
    BOUNDS: ClassVar[dict[str, tuple[float, float]]] = {"size": (1, 10_000), "rate": (0.01, 1.0)}
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"mode": ("a", "b")}
    size: int = 4  # how many
    rate: float = 0.5
    mode: str = "a"  # which one
    name: str = ""


PAGE = """## `[probe]`

| key | default | bounds | meaning |
|---|---|---|---|
| `probe.size` | 8 (eight) | 1-100 | how many |
| `probe.rate` | 0.5 | 0.01-1 | the rate |
| `probe.name` | `""` | at most 10 characters | a name |
| `probe.gone` | 1 | 1-2 | removed |
"""


def test_a_page_that_drifted_from_the_code_is_named_key_by_key_and_rewritten():
    problems = check_document(PAGE, [(Probe, True)])
    assert problems == [
        "probe.size: the document says default 8 (eight), the code 4",
        "probe.size: the document says bounds 1-100, the code 1-10,000",
        "probe.mode: missing from the document",
        "probe.gone: documented, but no such setting",
    ]
    fixed = rewrite_document(PAGE, [(Probe, True)])
    assert "| `probe.size` | 4 | 1-10,000 | how many |" in fixed  # the annotation went with the old value
    assert '| `probe.name` | `""` | at most 10 characters | a name |' in fixed  # prose bounds kept
    assert check_document(fixed, [(Probe, True)]) == [
        "probe.mode: missing from the document",
        "probe.gone: documented, but no such setting",
    ]
