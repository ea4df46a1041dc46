"""Command-line flags that stand for a setting (``--shards`` for ``cluster.shards``): each one
refuses a value outside the setting's bounds when the command line is read (with the
command's own usage), and its help shows the setting's default as a value, with the key that
sets it in a file, ``--set`` or the environment.

>>> import argparse
>>> p = argparse.ArgumentParser(prog="serve")
>>> _ = setting_flag(p, "--shards", key="cluster.shards", help="number of shards")
>>> p.parse_args(["--shards", "4"]).shards
4
>>> p.parse_args([]).shards is None  # not given: the loaded settings decide
True
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.core.errors import ConfigError
from lifemem_ray.lab.experiment_config import ExperimentConfig

__all__ = ["bounded_value", "setting_default", "setting_flag"]


def setting_default(key: str) -> tuple[Any, tuple[float, float] | None]:
    """The built-in default of setting ``key`` (``section.name``) and its bounds (None: unbounded).

    Raises:
        ConfigError: no such setting.
    """
    section, _, name = key.partition(".")
    if section == ExperimentConfig.NAME:
        holder: Any = ExperimentConfig()
    elif section in DeploymentConfig.sections():
        holder = getattr(DeploymentConfig(), section)
    else:
        raise ConfigError(f"command line: no setting {key!r} for a flag to stand for")
    if not hasattr(holder, name):
        raise ConfigError(f"command line: no setting {key!r} for a flag to stand for")
    return getattr(holder, name), type(holder).BOUNDS.get(name)


def bounded_value(kind: type, bounds: tuple[float, float] | None) -> Callable[[str], Any]:
    """An argparse ``type`` that reads an int or a float and refuses it outside ``bounds``."""
    noun = "an integer" if kind is int else "a number"

    def read(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {noun}, got {text!r}") from None
        if bounds is not None and not bounds[0] <= value <= bounds[1]:
            low, high = (kind(b) for b in bounds)
            raise argparse.ArgumentTypeError(f"must be within [{low}, {high}], got {text}")
        return value

    read.__name__ = kind.__name__
    return read


def setting_flag(parser: argparse.ArgumentParser, *flags: str, key: str, help: str, **kwargs: Any) -> argparse.Action:
    """``parser.add_argument(*flags)`` for a flag standing for setting ``key``: bounded like the
    setting (numbers), its help ending with the default as a value. Not given, it is None and
    the loaded settings (file, environment, ``--set``) decide.

    Args:
        parser: the command's parser.
        flags: the option strings (``"--shards"``).
        key: the setting (``"cluster.shards"``).
        help: what the flag is, without its default.
        kwargs: more of ``add_argument``'s arguments (``metavar``...).

    Returns:
        The argparse action.

    Raises:
        ConfigError: no such setting.
    """
    default, bounds = setting_default(key)
    if isinstance(default, bool):
        raise ConfigError(f"command line: {flags[0]} stands for {key}, a switch: declare it with store_true")
    if isinstance(default, (int, float)):
        kwargs.setdefault("type", bounded_value(type(default), bounds))
    shown = "" if default in ("", None) else f"{default}, "
    within = "" if bounds is None else f", {type(default)(bounds[0])}-{type(default)(bounds[1])}"
    return parser.add_argument(*flags, default=None, help=f"{help} (default: {shown}setting {key}{within})", **kwargs)
