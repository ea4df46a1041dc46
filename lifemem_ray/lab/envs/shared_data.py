"""Where an environment finds data that does not ship with the package (the HotpotQA corpus,
the released Mind2Web trajectories, ALFWorld's game files): one rule for every adapter.

In order: the path the caller gives; the environment variable the adapter names; the folder
``$LIFEMEM_SHARED_DIR``; the ``shared/`` folder beside the checkout (the project's layout,
``../shared``; only when running from a checkout, not from an installed wheel);
``/work/shared``. A data file not found is an :class:`EnvUnavailable` that names every place
looked in and how to point at it; a data folder not found is None, for its adapter to say.

Example::

    >>> from pathlib import Path
    >>> from lifemem_ray.lab.envs.shared_data import shared_candidates
    >>> shared_candidates(Path("data/x.jsonl"))[-1]
    PosixPath('/work/shared/data/x.jsonl')
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lifemem_ray.core.errors import EnvUnavailable, TaskError

__all__ = ["SHARED_DIR_ENV_VAR", "find_data_dir", "find_data_file", "json_lines", "shared_candidates"]

SHARED_DIR_ENV_VAR = "LIFEMEM_SHARED_DIR"
CHECKOUT_ROOT = Path(__file__).resolve().parents[3]  # lifemem_ray/lab/envs/ -> the checkout (or site-packages)
FALLBACK_SHARED = Path("/work/shared")


def shared_candidates(relative: Path) -> list[Path]:
    """``relative`` under every shared folder the rule looks in, in order."""
    bases = [Path(os.environ[SHARED_DIR_ENV_VAR])] if os.environ.get(SHARED_DIR_ENV_VAR) else []
    if (CHECKOUT_ROOT / "pyproject.toml").is_file():  # a checkout, not site-packages
        bases.append(CHECKOUT_ROOT.parent / "shared")
    bases.append(FALLBACK_SHARED)
    return [base / relative for base in bases]


def find_data_file(
    owner: str,
    given: str | os.PathLike[str] | None,
    env_var: str,
    relative: Path,
    what: str,
    option: str = "path",
) -> Path:
    """The data file of ``owner`` (an environment's name, for the errors): ``given`` (the
    adapter's keyword option ``option``), else ``$env_var``, else ``relative`` in the shared
    folders. ``what`` says what the file is."""
    if given is not None:
        path = Path(given)
        if not path.is_file():
            raise EnvUnavailable(f"{owner}: {path} does not exist ({what}); pass another {option}= or set ${env_var}")
        return path
    value = os.environ.get(env_var)
    if value:
        path = Path(value)
        if not path.is_file():
            raise EnvUnavailable(f"{owner}: ${env_var}={value} is not a file ({what})")
        return path
    candidates = shared_candidates(relative)
    found = next((path for path in candidates if path.is_file()), None)
    if found is None:
        raise EnvUnavailable(
            f"{owner}: no {what}; pass {option}= or set ${env_var} (looked in {', '.join(map(str, candidates))})"
        )
    return found


def find_data_dir(env_var: str, relative: Path, marker: str) -> Path | None:
    """A data folder: ``$env_var``, else the first shared ``relative`` folder holding ``marker``
    (a file or folder inside it); None when there is none (the caller says what is missing)."""
    if os.environ.get(env_var):
        return Path(os.environ[env_var])
    return next((path for path in shared_candidates(relative) if (path / marker).exists()), None)


def json_lines(path: Path) -> Iterator[tuple[int, str, Any]]:
    """(line number, ``"path:line"``, value) for each non-blank line of a JSONL data file; a
    line that is not JSON is a TaskError naming its place."""
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TaskError(f"not JSON ({exc.msg})", where=where) from None
            yield lineno, where, value
