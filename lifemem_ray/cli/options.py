"""What every command shares: its settings from --config / --set / the LLM flags, and its output
(a readable report or ``--json``; stored text is escaped before it reaches a terminal)."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from typing import Any

from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.engine.memory_config import ConfigError


def set_overrides(args: argparse.Namespace) -> dict[str, str]:
    overrides: dict[str, Any] = {}
    for item in args.set or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r}: expected SECTION.KEY=VALUE")
        overrides[key.strip()] = value
    return overrides


def config_from_args(args: argparse.Namespace) -> DeploymentConfig:
    overrides = {k: v for k, v in set_overrides(args).items() if not k.startswith("experiment.")}
    if getattr(args, "llm_base_url", None):
        overrides["llm.base_url"] = args.llm_base_url
        overrides.setdefault("llm.backend", "openai")
    if getattr(args, "llm_model", None):
        overrides["llm.model"] = args.llm_model
    return DeploymentConfig.load(args.config, overrides=overrides)


# Characters a terminal may act on (escape sequences, C1 controls, bidirectional overrides):
# stored text is untrusted, so it is shown escaped, never interpreted. Newline and tab stay.
TERMINAL_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """``text`` safe to print on a terminal: each such character shown as ``\\uNNNN`` (also a
    valid escape inside a JSON string, so JSON output stays JSON)."""
    return TERMINAL_UNSAFE.sub(lambda m: f"\\u{ord(m.group(0)):04x}", text)


def emit(args: argparse.Namespace, data: Any, text: Callable[[], str]) -> None:
    if args.json:
        print(printable(json.dumps(data, ensure_ascii=False, indent=2)))  # JSON escapes C0, not C1 or bidi
    else:
        print(printable(text()))


def progress(total: int, desc: str, args: argparse.Namespace) -> Any:
    from tqdm import tqdm

    # A bar on an interactive terminal; silent in logs and pipes (tqdm's disable=None).
    return tqdm(total=total, desc=desc, unit="traj", file=sys.stderr, disable=None if not args.quiet else True)


# -- the sharded deployment --------------------------------------------------------------
def remote(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "address", None) or getattr(args, "namespace", None))
