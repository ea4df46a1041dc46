"""The ``lifemem-ray`` command line.

Every command prints a readable report, or JSON with ``--json``. Errors go to
stderr as one line naming what is wrong and where, with exit status 1 (2 for
usage errors).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

from lifemem_ray.cli.options import printable
from lifemem_ray.cli.parser import build_parser
from lifemem_ray.core.errors import CommandError, ConfigError
from lifemem_ray.core.model import InvalidTrajectoryError

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        return int(args.func(args) or 0)
    except (ConfigError, InvalidTrajectoryError, CommandError, ValueError, OSError) as exc:
        print(printable(f"lifemem-ray {args.command}: error: {exc}"), file=sys.stderr)
        return 1
    except Exception as exc:  # StoreError and friends: one line, no traceback unless -v
        if args.verbose:
            raise
        print(printable(f"lifemem-ray {args.command}: error: {type(exc).__name__}: {exc}"), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"lifemem-ray {args.command}: interrupted; everything acknowledged so far is stored", file=sys.stderr)
        return 130
