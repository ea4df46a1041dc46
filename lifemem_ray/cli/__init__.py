"""The ``lifemem-ray`` command line.

Every command prints a readable report, or JSON with ``--json``. Errors go to
stderr as one line naming what is wrong and where, with exit status 1 (2 for
usage errors).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Sequence

from lifemem_ray.cli.options import printable
from lifemem_ray.cli.parser import build_parser, parse_command_line
from lifemem_ray.cli.ray_session import command_lifetime, interrupting_signal
from lifemem_ray.core.errors import CommandError, ConfigError
from lifemem_ray.core.model import InvalidTrajectoryError

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parse_command_line(parser, argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        with command_lifetime():  # SIGINT and SIGTERM end the command; a head it started and did not hand over stops
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
        how, code = ("terminated (SIGTERM)", 143) if interrupting_signal() == signal.SIGTERM else ("interrupted", 130)
        print(f"lifemem-ray {args.command}: {how}; everything acknowledged so far is stored", file=sys.stderr)
        return code
