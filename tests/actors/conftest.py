"""Every test in this folder is marked ``ray`` (the root conftest, by folder) and may use the Ray
fixtures below; a run without Ray (``-m "not ray"``) does not collect this folder.

The Ray layer's tests reuse the helpers of the tests of the layers below it (``from test_conflicts
import _gen``: by module name, as pytest imports test modules), so those folders are on the path.
Never the other way round: a Ray-free test imports nothing from here."""

import sys
from pathlib import Path

from support.ray_fixtures import config, deployment, ray_local, ray_metrics_url

__all__ = ["config", "deployment", "ray_local", "ray_metrics_url"]

for _layer in ("core", "llm", "engine", "service", "lab", "episodes", "docs_and_packaging"):
    _folder = str(Path(__file__).resolve().parents[1] / _layer)
    if _folder not in sys.path:
        sys.path.append(_folder)
