"""Options checked by a pydantic model, refused as the project's own error with the location as
data: one mechanism for the options every adapter takes (and the REST requests, whose models
FastAPI checks with the same library).

>>> from pydantic import BaseModel, Field
>>> class Probe(BaseModel):
...     k: int = Field(4, ge=1, le=64)
>>> validated(Probe, {"k": 0}, where="memory").where
Traceback (most recent call last):
...
lifemem_ray.core.errors.ConfigError: memory.k: must be within 1..64, got 0
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from lifemem_ray.core.errors import ConfigError, LifeMemError, join_where

__all__ = ["location", "refusal", "validated"]

M = TypeVar("M", bound=BaseModel)


def location(loc: tuple[Any, ...]) -> str:
    """A pydantic error's ``loc`` as the project writes a field path: ``("steps", 0, "action")``
    -> ``steps[0].action``."""
    out = ""
    for part in loc:
        out = f"{out}[{part}]" if isinstance(part, int) else (f"{out}.{part}" if out else str(part))
    return out


def _problem(error: Mapping[str, Any], model: type[BaseModel]) -> str:
    """One error's sentence: the bounds in the project's words where the field declares them."""
    got = error.get("input")
    kind = error["type"]
    if kind in ("greater_than_equal", "less_than_equal", "greater_than", "less_than"):
        field = model.model_fields.get(str(error["loc"][-1])) if error["loc"] else None
        low = high = None
        for rule in field.metadata if field is not None else ():
            low = getattr(rule, "ge", None) if getattr(rule, "ge", None) is not None else low
            high = getattr(rule, "le", None) if getattr(rule, "le", None) is not None else high
        if low is not None and high is not None:
            return f"must be within {low:g}..{high:g}, got {got!r}"
    if kind == "value_error":  # a validator's own refusal: its sentence names the value already
        return str(error.get("ctx", {}).get("error", error["msg"]))
    if kind == "extra_forbidden":
        return f"unknown option; known: {', '.join(sorted(model.model_fields))}"
    return f"{error['msg'][:1].lower()}{error['msg'][1:]}, got {got!r}"


def refusal(
    exc: ValidationError, model: type[BaseModel], where: str | None, error: type[LifeMemError] = ConfigError
) -> LifeMemError:
    """``exc``'s first error as ``error``, its location (under ``where``) as data."""
    first = exc.errors()[0]
    inner = location(tuple(first["loc"]))
    at = join_where(where, inner) if where else inner
    return error(_problem(first, model), where=at or None)


def validated(
    model: type[M], data: Mapping[str, Any], *, where: str | None = None, error: type[LifeMemError] = ConfigError
) -> M:
    """``model`` built from ``data``, or ``error`` naming the first field refused.

    Args:
        model: the options' pydantic model.
        data: the options as given.
        where: what holds them (an environment's config key, a class), put before the field.
        error: the error class to raise (:class:`ConfigError` for configuration).

    Returns:
        The validated model.

    Raises:
        LifeMemError: ``error``, with ``where`` and ``problem`` set.
    """
    try:
        return model.model_validate(dict(data))
    except ValidationError as exc:
        raise refusal(exc, model, where, error) from None
