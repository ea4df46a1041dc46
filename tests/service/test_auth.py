"""API keys of the HTTP front door, without Ray: hashing, parsing, the environment, the
no-auth mode's loopback rule and the `keys new` command."""

from __future__ import annotations

import json

import pytest

from lifemem_ray.core.errors import AuthError, ConfigError
from lifemem_ray.service.auth import KeyRing, check_bind, hash_key, is_loopback, new_key, parse_key_entries
from lifemem_ray.service.principal import SCOPES


def test_a_new_key_authenticates_as_its_tenant_and_scopes_and_only_its_hash_is_kept():
    key, entry = new_key("acme", "read,write", name="acme-1")
    assert key.startswith("lmk_") and len(key) > 40
    assert entry.sha256 == hash_key(key) and key not in json.dumps(entry.to_dict())
    ring = KeyRing.from_entries([entry.to_dict()])
    who = ring.authenticate(f"Bearer {key}")
    assert (who.tenant, who.scopes, who.key_id) == ("acme", frozenset({"read", "write"}), "acme-1")
    assert ring.authenticate(f"bearer   {key}  ").tenant == "acme"  # the scheme is case-insensitive
    other_key, _ = new_key("acme", ["read"])
    for header, said in (
        (None, "no API key"),
        ("", "no API key"),
        (key, "Bearer <key>"),
        (f"Basic {key}", "Bearer <key>"),
        ("Bearer ", "Bearer <key>"),
        (f"Bearer {other_key}", "not valid"),
        (f"Bearer {key}x", "not valid"),
        ("Bearer " + "a" * 10_000, "not valid"),
    ):
        with pytest.raises(AuthError, match=said):
            ring.authenticate(header)


def test_two_keys_of_two_tenants_are_told_apart():
    ka, ea = new_key("acme", ["read"])
    kb, eb = new_key("globex", ["read", "write", "admin"])
    ring = KeyRing.from_entries([ea, eb])
    assert ring.authenticate(f"Bearer {ka}").tenant == "acme"
    b = ring.authenticate(f"Bearer {kb}")
    assert b.tenant == "globex" and all(b.allows(s) for s in SCOPES)


def test_key_entries_are_checked_naming_the_entry_and_field():
    _, good = new_key("acme", ["read"], name="k1")
    ok = good.to_dict()
    cases = [
        ({**ok, "sha256": "lmk_the_key_itself"}, r"\[0\]\.sha256: .*never the key itself"),
        ({**ok, "tenant": "bad tenant!"}, r"\[0\]\.tenant"),
        ({**ok, "scopes": ["read", "root"]}, r"\[0\]\.scopes: unknown scope"),
        ({**ok, "scopes": []}, r"\[0\]\.scopes"),
        ({**ok, "name": ""}, r"\[0\]\.name"),
        ({**ok, "key": "x"}, r"\[0\]: unknown field"),
        ("text", r"\[0\]: expected a table"),
    ]
    for entry, said in cases:
        with pytest.raises(ConfigError, match=said):
            parse_key_entries([entry], "http.api_keys")
    with pytest.raises(ConfigError, match=r"http.api_keys\[1\]\.name: the same name"):
        parse_key_entries([ok, {**ok, "sha256": "0" * 64}], "http.api_keys")
    with pytest.raises(ConfigError, match=r"http.api_keys\[1\]\.sha256: the same sha256"):
        parse_key_entries([ok, {**ok, "name": "k2"}], "http.api_keys")
    assert (
        parse_key_entries([{**ok, "scopes": "read, write", "sha256": ok["sha256"].upper()}], "x")[0].sha256
        == ok["sha256"]
    )


def test_no_auth_binds_to_loopback_only():
    for host in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"):
        assert is_loopback(host)
        check_bind(host, "none")
    for host in ("0.0.0.0", "::", "10.0.0.5", "example.org", ""):
        assert not is_loopback(host)
        with pytest.raises(ConfigError, match="loopback only"):
            check_bind(host, "none")
        check_bind(host, "keys")
