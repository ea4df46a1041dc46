"""The defaults and bounds of docs/configuration.md, from the code.

    python docs/generate_configuration.py           # say where the document and the code differ (exit 1)
    python docs/generate_configuration.py --write   # take every default and bound from the code

tests/docs_and_packaging/test_configuration_reference.py runs the check.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.core.settings import Section
from lifemem_ray.core.settings_reference import check_document, rewrite_document
from lifemem_ray.lab.experiment_config import ExperimentConfig

DOCUMENT = Path(__file__).with_name("configuration.md")


def sections() -> list[tuple[type[Section], bool]]:
    """Every settings table a user can set: the deployment's (the engine's and its own), written
    ``section.key``, and the experiment's, written ``key`` under its own heading."""
    tables = [f.default_factory for f in dataclasses.fields(DeploymentConfig)]
    return [*((table, True) for table in tables), (ExperimentConfig, False)]  # type: ignore[misc]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="rewrite the defaults and bounds from the code")
    args = parser.parse_args()
    text = DOCUMENT.read_text(encoding="utf-8")
    if args.write:
        text = rewrite_document(text, sections())
        DOCUMENT.write_text(text, encoding="utf-8")
    problems = check_document(text, sections())
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
