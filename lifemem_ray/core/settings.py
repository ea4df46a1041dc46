"""Typed settings, loaded the same way in every layer.

A layer declares its settings as :class:`Section` dataclasses (one TOML table each, every
number with hard bounds) and gathers them in a :class:`Settings` dataclass: the engine's
``MemoryConfig``, the Ray deployment's ``DeploymentConfig`` (which adds its own sections to
the engine's), the experiment's. Sources, later ones winning: the defaults < a TOML file <
environment variables ``LIFEMEM_<SECTION>_<KEY>`` (``LIFEMEM_EVOLUTION_TOP_K=8``) < explicit
overrides (``{"evolution.top_k": 8}``, what ``--set`` and CLI flags give). Every value is
checked where it is set; an error names the source and the key
(``c.toml: evolution.top_k: expected an integer``).

>>> from dataclasses import dataclass, field
>>> @dataclass
... class Search(Section):
...     NAME = "search"
...     BOUNDS = {"k": (1, 100)}
...     k: int = 4
>>> @dataclass
... class Demo(Settings):
...     search: Search = field(default_factory=Search)
>>> Demo.load(environ={"LIFEMEM_SEARCH_K": "8"}).search.k
8
>>> Demo().replace({"search.k": 500})
Traceback (most recent call last):
...
lifemem_ray.core.errors.ConfigError: override: search.k: must be within [1, 100], got 500
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from lifemem_ray.core.errors import ConfigError

__all__ = [
    "ConfigError",
    "Section",
    "Settings",
    "check_bound",
    "choice",
    "coerce",
    "in_range",
    "load_section",
    "positive",
    "read_toml",
]

S = TypeVar("S", bound="Settings")
T = TypeVar("T", bound="Section")


class Section:
    """A table of settings (a dataclass): its TOML name, the hard bounds of its numbers
    (``key: (low, high)``, both included: far from every sensible value, so that a typo cannot
    hang a process, with a timeout of inf, or exhaust it, with a k of 1e23), the values each of
    its text choices takes (``CHOICES``), and its own rules. Bounds and choices are data: the
    settings reference (``docs/configuration.md``) is checked against them."""

    NAME: ClassVar[str] = ""
    BOUNDS: ClassVar[dict[str, tuple[float, float]]] = {}
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {}  # key -> the values a text setting takes

    def validate(self) -> None:
        """Rules between this section's keys (bounds are checked apart, where values are set)."""

    def checked(self: T) -> T:
        """This section, its numbers within their bounds and its rules kept (a section built in
        Python, not loaded, is checked here); ConfigError naming the key otherwise."""
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            check_bound(self.BOUNDS.get(f.name), getattr(self, f.name), f"{self.NAME}.{f.name}")
        for name, choices in self.CHOICES.items():
            choice(self, name, choices)
        self.validate()
        return self


class Settings:
    """Sections gathered (a dataclass whose fields are :class:`Section` instances).

    ``FOREIGN``: tables a shared run file may hold that other layers own (the engine's config
    passes over ``[cluster]`` and ``[http]``); any other unknown table is an error."""

    FOREIGN: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def sections(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]

    @classmethod
    def bounds(cls) -> dict[str, tuple[float, float]]:
        """Every number's bounds, as ``"section.key": (low, high)``."""
        out: dict[str, tuple[float, float]] = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.default_factory is dataclasses.MISSING:
                continue  # not a section: each section field is declared with default_factory=its class
            section = f.default_factory()
            out.update({f"{f.name}.{key}": bound for key, bound in section.BOUNDS.items()})
        return out

    def validate(self: S) -> S:
        """Every section's bounds and rules, then :meth:`check` (rules between sections)."""
        for name in self.sections():
            getattr(self, name).checked()
        self.check()
        return self

    def check(self) -> None:
        """Rules between sections (none by default)."""

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    def replace(self: S, overrides: Mapping[str, Any], source: str = "override") -> S:
        """A copy with dotted-key overrides applied (``{"evolution.top_k": 8}``), validated."""
        new = self.copy()
        for dotted, value in overrides.items():
            new.set(dotted, value, source)
        return new.validate()

    def copy(self: S) -> S:
        return type(self)(**{s: dataclasses.replace(getattr(self, s)) for s in self.sections()})

    def set(self, dotted: str, value: Any, source: str) -> None:
        """Set ``section.key`` from ``source`` (named in errors), checked and bounded."""
        section_name, _, key = dotted.partition(".")
        if section_name not in self.sections() or not key:
            raise ConfigError(
                f"{source}: unknown setting '{dotted}' (use section.key; sections: {', '.join(self.sections())})"
            )
        set_key(getattr(self, section_name), key, value, source)

    @classmethod
    def load(
        cls: type[S],
        path: str | os.PathLike[str] | None = None,
        *,
        environ: Mapping[str, str] | None = None,
        overrides: Mapping[str, Any] | None = None,
    ) -> S:
        """Defaults, then the TOML file (its tables, or the same under ``[memory.*]``), then
        ``LIFEMEM_*`` variables, then overrides."""
        config = cls()
        if path is not None:
            path = Path(path)
            data = read_toml(path)
            data = data.get("memory", data)
            for name, table in data.items():
                if name not in cls.sections():
                    if isinstance(table, dict) and name not in cls.FOREIGN:
                        raise ConfigError(f"{path}: unknown section [{name}]; known: {', '.join(cls.sections())}")
                    continue
                if not isinstance(table, dict):
                    raise ConfigError(f"{path}: '{name}' must be a table")
                for key, value in table.items():
                    config.set(f"{name}.{key}", value, str(path))
        for name in cls.sections():
            apply_environ(getattr(config, name), environ)
        for dotted, value in (overrides or {}).items():
            config.set(dotted, value, "override")
        return config.validate()


def set_key(section: Section, key: str, value: Any, source: str) -> None:
    """Set one key of ``section`` from ``source``: coerced to the key's type, bounded."""
    fields = {f.name for f in dataclasses.fields(section)}  # type: ignore[arg-type]
    dotted = f"{section.NAME}.{key}"
    if key not in fields:
        raise ConfigError(f"{source}: unknown setting '{dotted}'; known in [{section.NAME}]: {', '.join(fields)}")
    value = coerce(value, getattr(type(section)(), key), f"{source}: {dotted}")
    check_bound(section.BOUNDS.get(key), value, f"{source}: {dotted}")
    setattr(section, key, value)


def apply_environ(section: Section, environ: Mapping[str, str] | None = None) -> None:
    """Set ``section``'s keys named by ``LIFEMEM_<SECTION>_<KEY>`` variables."""
    env = os.environ if environ is None else environ
    prefix = f"LIFEMEM_{section.NAME.upper()}_"
    fields = {f.name for f in dataclasses.fields(section)}  # type: ignore[arg-type]
    for name, value in env.items():
        if name.startswith(prefix) and name[len(prefix) :].lower() in fields:
            set_key(section, name[len(prefix) :].lower(), value, name)


def load_section(
    section: T,
    path: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> T:
    """One section alone: defaults < the file's ``[NAME]`` table < ``LIFEMEM_NAME_*`` <
    overrides (keys without the section's name); bounded, then validated."""
    if path is not None:
        path = Path(path)
        table = read_toml(path).get(section.NAME, {})
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: '{section.NAME}' must be a table")
        for key, value in table.items():
            set_key(section, key, value, str(path))
    apply_environ(section, environ)
    for key, value in (overrides or {}).items():
        set_key(section, key, value, "override")
    return section.checked()


def read_toml(path: Path) -> dict[str, Any]:
    """A TOML file's tables; a missing or malformed file is a ConfigError naming it."""
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}): save the config file as UTF-8") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file: {exc.strerror or exc}") from None


def check_bound(bound: tuple[float, float] | None, value: Any, where: str) -> None:
    """Refuse a number outside ``bound`` (NaN and infinities included); None: unbounded."""
    if bound is None or isinstance(value, (bool, str)):
        return
    low, high = bound
    if not (isinstance(value, (int, float)) and math.isfinite(value) and low <= value <= high):
        raise ConfigError(f"must be within [{low:g}, {high:g}], got {value!r}", where=where)


def coerce(value: Any, default: Any, where: str) -> Any:
    """``value`` as the type of the key's ``default``: booleans from true/false words,
    numbers from their text, lists from a JSON list (or, for lists of strings, comma-separated
    text), tables from JSON text (what an environment variable or ``--set`` gives)."""
    kind = type(default)
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
            return True
        if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"expected true or false, got {value!r}", where=where)
    if kind in (int, float):
        return _number(value, kind, where)
    if kind is list:
        return _list(value, where)
    if kind is dict:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ConfigError(
                    f"expected a table (JSON in a variable): {exc.msg} at {exc.pos}", where=where
                ) from None
        if not isinstance(value, dict):
            raise ConfigError(f"expected a table, got {value!r}", where=where)
        return value
    if not isinstance(value, str):
        raise ConfigError(f"expected a string, got {value!r}", where=where)
    return value


def _number(value: Any, kind: type, where: str) -> Any:
    what = "an integer" if kind is int else "a number"
    if isinstance(value, bool):
        raise ConfigError(f"expected {what}, got {value!r}", where=where)
    if isinstance(value, int) or (kind is float and isinstance(value, float)):
        return kind(value)
    if isinstance(value, str):
        try:
            return kind(value.strip())
        except ValueError:
            pass
    raise ConfigError(f"expected {what}, got {value!r}", where=where)


def _list(value: Any, where: str) -> list[Any]:
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ConfigError(
                    f"expected a JSON list, got text that is not JSON ({exc.msg} at {exc.pos})",
                    where=where,
                ) from None
        else:  # a comma-separated list of names (LIFEMEM_EXPERIMENT_ENVS=twx-coin,sql)
            value = [v.strip() for v in text.split(",") if v.strip()]
    if not isinstance(value, list):
        raise ConfigError(f"expected a list, got {type(value).__name__}", where=where)
    return list(value)


def positive(section: Section, *names: str) -> None:
    """Each named key of ``section`` is > 0."""
    for name in names:
        if getattr(section, name) <= 0:
            raise ConfigError(f"{section.NAME}.{name}: must be > 0, got {getattr(section, name)!r}")


def in_range(section: Section, name: str, low: float, high: float) -> None:
    value = getattr(section, name)
    if not low <= value <= high:
        raise ConfigError(f"{section.NAME}.{name}: must be within [{low}, {high}], got {value!r}")


def choice(section: Section, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(section, name)
    if value not in choices:
        raise ConfigError(f"must be one of {', '.join(choices)}; got {value!r}", where=f"{section.NAME}.{name}")
