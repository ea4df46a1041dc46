"""docs/configuration.md says what the code declares: every setting, its default and its bounds
(docs/generate_configuration.py writes them from the code; it reads DeploymentConfig, of the
Ray layer)."""

from __future__ import annotations

import runpy

from support.common import ROOT

from lifemem_ray.core.settings_reference import check_document


def test_the_configuration_page_agrees_with_the_code():
    generator = runpy.run_path(str(ROOT / "docs" / "generate_configuration.py"))
    text = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert check_document(text, generator["sections"]()) == []
