"""Bearer API keys of the HTTP front door: who a request acts as.

A key is a random secret handed to one client; the server keeps only its SHA-256 (a
:class:`KeyEntry`: a non-secret name, the hash, the tenant it is bound to and its scopes).
Keys come from ``[http] api_keys`` of the configuration and from the ``LIFEMEM_API_KEYS``
environment variable (the same entries as JSON, or the path of a JSON file holding them).
A presented key is hashed and compared with every stored hash by :func:`hmac.compare_digest`
(constant time, and every entry is compared, so the time does not say which one matched).

``http.auth = "none"`` turns authentication off: every request acts as the default tenant
with every scope, and the server binds to loopback addresses only (:func:`check_bind`).

>>> key, entry = new_key("acme", ["read", "write"], name="acme-1")
>>> ring = KeyRing.from_entries([entry])
>>> ring.authenticate(f"Bearer {key}").tenant
'acme'
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lifemem_ray.core.errors import AuthError, ConfigError
from lifemem_ray.core.tenancy import check_tenant, is_name
from lifemem_ray.service.principal import SCOPES, Principal

__all__ = [
    "ENV_KEYS",
    "KEY_PREFIX",
    "KeyEntry",
    "KeyRing",
    "check_bind",
    "hash_key",
    "is_loopback",
    "new_key",
    "parse_key_entries",
]

ENV_KEYS = "LIFEMEM_API_KEYS"  # JSON list of key entries, or the path of a JSON file holding one
KEY_PREFIX = "lmk_"  # marks a lifemem key (secret scanners and people recognise it)
NO_AUTH_KEY_ID = "no-auth"
_SHA256 = re.compile(r"[0-9a-f]{64}")  # matched against the whole string
MAX_KEY_CHARS = 512  # a presented key longer than this is refused before hashing


def _default_tenant() -> str:
    from lifemem_ray.core.tenancy import DEFAULT_TENANT

    return DEFAULT_TENANT


def hash_key(key: str) -> str:
    """The SHA-256 (hex) the server stores for ``key``."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class KeyEntry:
    """One stored key: never the key itself."""

    name: str  # non-secret id of the key (logs, metrics, 403 messages)
    sha256: str  # hex SHA-256 of the key
    tenant: str
    scopes: frozenset[str]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "sha256": self.sha256, "tenant": self.tenant, "scopes": sorted(self.scopes)}


def _scopes(value: Any, where: str) -> frozenset[str]:
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items:
        raise ConfigError(f"expected a non-empty list of scopes out of {', '.join(SCOPES)}", where=where)
    got = [s.strip() if isinstance(s, str) else s for s in items]
    bad = [s for s in got if s not in SCOPES]
    if bad:
        raise ConfigError(f"unknown scope(s) {bad}; scopes are {', '.join(SCOPES)}", where=where)
    return frozenset(got)


def parse_key_entries(raw: Any, where: str) -> list[KeyEntry]:
    """Key entries checked: each ``{name, sha256, tenant, scopes}``, names and hashes unique.
    Raises :class:`ConfigError` naming the entry and field (``http.api_keys[2].sha256``)."""
    if not isinstance(raw, (list, tuple)):
        raise ConfigError(
            f"expected a list of {{name, sha256, tenant, scopes}} entries, got {type(raw).__name__}",
            where=where,
        )
    out: list[KeyEntry] = []
    for i, item in enumerate(raw):
        at = f"{where}[{i}]"
        if isinstance(item, KeyEntry):
            out.append(item)
            continue
        if not isinstance(item, Mapping):
            raise ConfigError(f"expected a table {{name, sha256, tenant, scopes}}, got {type(item).__name__}", where=at)
        unknown = set(item) - {"name", "sha256", "tenant", "scopes"}
        if unknown:
            raise ConfigError(
                f"unknown field(s) {sorted(unknown)}; an entry has name, sha256, tenant, scopes", where=at
            )
        name, digest = item.get("name"), item.get("sha256")
        if not isinstance(name, str) or not is_name(name):  # isinstance: for the type checker
            raise ConfigError(f"expected 1-64 letters, digits, '_', '.', '-', got {name!r}", where=f"{at}.name")
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest.lower()):
            raise ConfigError(
                "expected the 64 hex digits of the key's SHA-256 (`lifemem-ray keys new` prints it), "
                "never the key itself",
                where=f"{at}.sha256",
            )
        try:
            tenant = check_tenant(item.get("tenant"), f"{at}.tenant")
        except ValueError as exc:
            raise ConfigError(getattr(exc, "problem", str(exc)), where=getattr(exc, "where", None)) from None
        out.append(KeyEntry(name, digest.lower(), tenant, _scopes(item.get("scopes"), f"{at}.scopes")))
    for attr in ("name", "sha256"):
        seen: set[str] = set()
        for i, entry in enumerate(out):
            value = getattr(entry, attr)
            if value in seen:
                raise ConfigError(f"{where}[{i}].{attr}: the same {attr} as an earlier entry; every key needs its own")
            seen.add(value)
    return out


def entries_from_environ(environ: Mapping[str, str] | None = None) -> list[KeyEntry]:
    """Entries of ``LIFEMEM_API_KEYS``: JSON text (starting with ``[``) or a JSON file's path."""
    env = os.environ if environ is None else environ
    raw = env.get(ENV_KEYS, "").strip()
    if not raw:
        return []
    where = ENV_KEYS
    if not raw.startswith("["):
        path = Path(raw).expanduser()
        where = f"{path} ({ENV_KEYS})"
        try:
            raw = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(
                f"{ENV_KEYS}: neither a JSON list nor a readable file: {path}: {exc.strerror or exc}"
            ) from None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"not valid JSON ({exc.msg} at line {exc.lineno}); expected a list of key entries",
            where=where,
        ) from None
    return parse_key_entries(data, where)


@dataclass(frozen=True)
class KeyRing:
    """The keys a server accepts (hashes only; picklable, so it travels to every replica)."""

    entries: tuple[KeyEntry, ...] = ()
    mode: str = "keys"  # keys | none

    @classmethod
    def from_entries(cls, entries: Sequence[Any], mode: str = "keys") -> KeyRing:
        if mode not in ("keys", "none"):
            raise ConfigError(f"must be 'keys' or 'none', got {mode!r}", where="http.auth")
        checked = parse_key_entries(list(entries), "api keys")
        return cls(tuple(checked), mode)

    @classmethod
    def from_config(cls, http: Any, environ: Mapping[str, str] | None = None) -> KeyRing:
        """The keys of ``[http] api_keys`` plus those of ``LIFEMEM_API_KEYS`` (``http``: an
        :class:`~lifemem_ray.service.http_config.HttpConfig`). With ``auth = "keys"`` and no key at all,
        :class:`ConfigError` says how to make one: a server nobody can use is a mistake."""
        entries = parse_key_entries(http.api_keys, "http.api_keys") + entries_from_environ(environ)
        if http.auth == "keys" and not entries:
            raise ConfigError(
                "http.auth = 'keys' but no API key is configured: make one with `lifemem-ray keys new --tenant T "
                f"--scopes read,write` and put its entry in [http] api_keys or {ENV_KEYS}; or set "
                "http.auth = 'none' for a server without authentication (loopback only)"
            )
        return cls.from_entries(entries, http.auth)

    def authenticate(self, authorization: str | None) -> Principal:
        """The principal of an ``Authorization`` header; :class:`AuthError` when it is missing,
        malformed or names no key. Every entry is compared, in constant time each."""
        if self.mode == "none":
            return Principal(_default_tenant(), frozenset(SCOPES), NO_AUTH_KEY_ID)
        if not authorization:
            raise AuthError("no API key: send 'Authorization: Bearer <key>'")
        scheme, _, key = authorization.strip().partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise AuthError("the Authorization header must be 'Bearer <key>'")
        if len(key) > MAX_KEY_CHARS:
            raise AuthError("the API key is not valid")
        digest = hash_key(key).encode()
        found: KeyEntry | None = None
        for entry in self.entries:
            if hmac.compare_digest(digest, entry.sha256.encode()):
                found = entry
        if found is None:
            raise AuthError("the API key is not valid (unknown, or revoked); ask the operator for a key")
        return Principal(found.tenant, found.scopes, found.name)


def new_key(tenant: str, scopes: Sequence[str] | str, name: str | None = None) -> tuple[str, KeyEntry]:
    """A fresh random key (shown once) and the entry the server stores for it."""
    tenant = check_tenant(tenant, "--tenant")
    checked = _scopes(scopes, "--scopes")
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    name = name or f"{tenant}-{secrets.token_hex(3)}"
    if not is_name(name):
        raise ConfigError(f"--name: expected 1-64 letters, digits, '_', '.', '-', got {name!r}")
    return key, KeyEntry(name, hash_key(key), tenant, checked)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (or ``localhost``)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, mode: str) -> None:
    """Refuse to serve without authentication on anything but loopback."""
    if mode == "none" and not is_loopback(host):
        raise ConfigError(
            f"http.auth = 'none' serves every request as the default tenant with every scope, so it binds to "
            f"loopback only (127.0.0.1, ::1, localhost), not {host!r}; configure API keys (`lifemem-ray keys "
            "new`) to serve on other addresses"
        )
