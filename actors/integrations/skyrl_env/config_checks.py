"""The checks every SkyRL ``env_config`` and row ``extras`` go through: plain mappings, known
keys, bounded numbers, named texts; each failure a ConfigError naming where."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lifemem_ray.core.errors import ConfigError

__all__ = [
    "LAB_KEYS",
    "MEMORY_KEYS",
    "as_mapping",
    "bounded_number",
    "check_keys",
    "max_turns_of",
    "nonempty_name",
    "plain",
    "row_extra",
]

LAB_KEYS = frozenset({"env", "options", "split"})  # LabTextEnv's env_config
MEMORY_KEYS = frozenset(  # MemoryTextEnv's env_config
    {"inner", "inner_config", "memory", "memory_env", "context_in", "task_from", "settle_timeout_s"}
)


def plain(value: Any) -> Any:
    """``value`` as plain dicts and lists (SkyRL passes OmegaConf ``DictConfig``\\ s)."""
    if isinstance(value, str | bytes):
        return value
    if isinstance(value, Mapping):
        return {str(key): plain(item) for key, item in value.items()}
    if isinstance(value, Sequence):
        return [plain(item) for item in value]
    return value


def as_mapping(value: Any, where: str) -> dict[str, Any]:
    """``value`` (None: empty) as a plain dict, or a ConfigError naming ``where``."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"expected a mapping (a dict or a DictConfig), got {type(value).__name__}", where=where)
    return dict(plain(value))


def check_keys(config: Mapping[str, Any], known: frozenset[str], where: str) -> None:
    unknown = sorted(set(config) - known)
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}", where=where)


def nonempty_name(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"expected a non-empty string, got {value!r}", where=where)
    return value.strip()


def bounded_number(value: Any, low: float, high: float, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ConfigError(f"expected a number in {low:g}..{high:g}, got {value!r}", where=where)
    return float(value)


def row_extra(extras: Mapping[str, Any], key: str) -> Any:
    """``extras[key]``, else ``extras["extra_info"][key]`` (where SkyRL datasets keep per-row data)."""
    if key in extras:
        return extras[key]
    info = extras.get("extra_info")
    return info.get(key) if isinstance(info, Mapping) else None


def max_turns_of(extras: Mapping[str, Any], where: str) -> int | None:
    value = extras.get("max_turns")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}['max_turns']: expected an integer >= 1, got {value!r}")
    return value
