"""Tenants: whose a trajectory is, and the keys that keep tenants apart inside a store.

Every stored trajectory belongs to one tenant (:data:`DEFAULT_TENANT` unless it says
otherwise), and every query is asked for one tenant. Inside a store the engine partitions by
a *scope* (one tenant's one environment) instead of the bare environment, and indexes ids by
a tenant-qualified *id key*:

* ``scope(tenant, env)`` is ``env`` for the default tenant (stores written before tenants
  existed keep their bytes and meaning) and ``tenant + SEP + env`` otherwise;
* ``id_key(tenant, id)`` likewise for trajectory ids.

``SEP`` is the NUL character, which no id, environment or tenant name may contain
(:func:`lifemem_ray.core.model._check_str` refuses it), so a key splits back unambiguously and two
tenants may use the same id or environment name without meeting. Because FAISS sub-indices,
cluster profiles (``ClusterRecord.envs``) and candidate searches are all per scope, a query
of one tenant never reaches another's vectors, and clusters never mix tenants.

>>> scope("default", "alfworld"), scope("acme", "alfworld") == "acme\\x00alfworld"
('alfworld', True)
>>> split_scope(scope("acme", "alfworld")), split_scope("alfworld")
(('acme', 'alfworld'), ('default', 'alfworld'))
>>> caller_id(id_key("acme", "t-1"))
't-1'
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from lifemem_ray.core.errors import TenantError

__all__ = [
    "DEFAULT_TENANT",
    "SEP",
    "caller_id",
    "check_tenant",
    "display_envs",
    "id_key",
    "is_name",
    "is_pool",
    "pool",
    "record_tenant",
    "scope",
    "scope_tenant",
    "search_targets",
    "split_scope",
    "tenant_prefix",
]

DEFAULT_TENANT = "default"
SEP = "\x00"
# A tenant or key name, matched against the WHOLE string (re.fullmatch): with re.match and
# "$", "acme\n" passed, since "$" also matches before a final newline.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def is_name(value: Any) -> bool:
    """Whether ``value`` is a tenant or key name: 1-64 characters, letters, digits, ``_ . -``,
    starting with a letter or digit, and nothing else (no final newline either).

    >>> is_name("acme"), is_name("acme\\n"), is_name("-x")
    (True, False, False)
    """
    return isinstance(value, str) and _NAME.fullmatch(value) is not None


def check_tenant(value: Any, where: str = "tenant", *, stored: bool = False) -> str:
    """``value`` when it is a valid tenant name (1-64 characters: letters, digits, ``_ . -``,
    starting with a letter or digit), else :class:`TenantError` (a ValueError) naming ``where``.

    ``stored``: for removals only, also a name that versions before this one stored by mistake
    (a valid name and one final newline, which their ``$``-anchored check let through), so that
    an operator can still delete what is stored under it; nothing new is ever stored under one."""
    if not isinstance(value, str):
        raise TenantError(f"expected a tenant name (a string), got {type(value).__name__}", where=where)
    if not is_name(value) and not (stored and value.endswith("\n") and is_name(value[:-1])):
        raise TenantError(
            f"{value[:80]!r} is not a tenant name (1-64 characters: letters, digits, '_', '.', '-', "
            "starting with a letter or digit)",
            where=where,
        )
    return value


def _plain(value: str, what: str) -> str:
    if SEP in value:
        raise TenantError(f"{value[:80]!r} contains a NUL character", where=what)
    return value


def scope(tenant: str, env: str) -> str:
    """The partition key of ``tenant``'s environment ``env`` (``env`` itself for the default tenant)."""
    _plain(env, "env")
    return env if tenant == DEFAULT_TENANT else tenant + SEP + env


def id_key(tenant: str, trajectory_id: str) -> str:
    """The store's key of ``tenant``'s trajectory id (the id itself for the default tenant). An
    id with a NUL character is refused: no stored id has one, and it could name another
    tenant's key."""
    _plain(trajectory_id, "id")
    return trajectory_id if tenant == DEFAULT_TENANT else tenant + SEP + trajectory_id


def split_scope(key: str) -> tuple[str, str]:
    """(tenant, env) of a scope, or (tenant, id) of an id key."""
    tenant, sep, rest = key.partition(SEP)
    return (tenant, rest) if sep else (DEFAULT_TENANT, key)


def scope_tenant(key: str) -> str:
    """The tenant of a scope or id key."""
    return key.partition(SEP)[0] if SEP in key else DEFAULT_TENANT


def caller_id(key: str) -> str:
    """The id as its tenant gave it (an id key without its tenant)."""
    return key.rpartition(SEP)[2]


def tenant_prefix(tenant: str) -> str:
    """What every id key and scope of a non-default ``tenant`` starts with ("" for the default)."""
    return "" if tenant == DEFAULT_TENANT else tenant + SEP


def pool(tenant: str) -> str:
    """The search target "every environment of ``tenant``" (pooled retrieval): a scope with an
    empty environment, which no stored scope is."""
    return tenant + SEP


def is_pool(target: str | None) -> bool:
    return target is not None and target.endswith(SEP)


def search_targets(tenant: str, envs: Iterable[str | None]) -> list[str]:
    """What a query of ``tenant`` searches per environment: the scope, or the tenant's pool for None."""
    check_tenant(tenant, "tenant")
    return [pool(tenant) if env is None else scope(tenant, env) for env in envs]


def record_tenant(envs: Mapping[str, int] | Iterable[str]) -> str | None:
    """The tenant of a cluster from its scopes (``ClusterRecord.envs``); None when it has none
    (an empty cluster). A cluster never holds two tenants (every candidate search is per tenant)."""
    for key in envs:
        return scope_tenant(key)
    return None


def display_envs(envs: Mapping[str, int]) -> dict[str, int]:
    """A cluster's scope counts as environment counts (the tenant left out), for people and prompts."""
    if not any(SEP in key for key in envs):
        return dict(envs)
    out: dict[str, int] = {}
    for key, n in envs.items():
        env = split_scope(key)[1]
        out[env] = out.get(env, 0) + n
    return out
