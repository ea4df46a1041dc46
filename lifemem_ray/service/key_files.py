"""Where ``lifemem-ray keys new`` writes what it makes, only where the user asked: the key in a
file of its own, readable by its owner alone (created with mode 0600, never over a file that
exists), and its entry (the SHA-256, no secret) added to a keys file for ``LIFEMEM_API_KEYS``,
replaced atomically so that a server reading it never sees half a list.

>>> import tempfile, os
>>> from lifemem_ray.service.auth import new_key
>>> folder = tempfile.mkdtemp()
>>> key, entry = new_key("acme", "read")
>>> write_key_file(os.path.join(folder, "acme.key"), key)
>>> oct(os.stat(os.path.join(folder, "acme.key")).st_mode & 0o777)
'0o600'
>>> add_entry(os.path.join(folder, "keys.json"), entry)
1
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from lifemem_ray.core.errors import ConfigError, PathExistsError
from lifemem_ray.service.auth import KeyEntry, parse_key_entries

__all__ = ["add_entry", "write_key_file"]


def write_key_file(path: str | os.PathLike[str], key: str) -> None:
    """``key`` written to a new file at ``path``, readable and writable by its owner alone.

    Args:
        path: the file to create (its folder must exist).
        key: the secret.

    Raises:
        PathExistsError: ``path`` exists (nothing written: a key is never overwritten).
        OSError: the file cannot be created.
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise PathExistsError(f"--key-file {path}: exists; name a new file (a key is never overwritten)") from None
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        os.fchmod(out.fileno(), 0o600)  # whatever the umask
        out.write(key + "\n")
        out.flush()
        os.fsync(out.fileno())


def add_entry(path: str | os.PathLike[str], entry: KeyEntry) -> int:
    """``entry`` added to the JSON list of key entries at ``path`` (created when missing),
    the file replaced atomically, its mode kept (0600 when new).

    Args:
        path: the keys file (what ``LIFEMEM_API_KEYS`` names).
        entry: the new key's entry.

    Returns:
        How many entries the file holds now.

    Raises:
        ConfigError: the file holds no valid list of entries, or one with the same name or hash.
    """
    target = Path(path)
    entries: list[KeyEntry] = []
    mode = 0o600
    if target.exists():
        try:
            entries = parse_key_entries(json.loads(target.read_text(encoding="utf-8")), f"--entries {target}")
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--entries {target}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        mode = target.stat().st_mode & 0o777
    entries = parse_key_entries([*entries, entry], f"--entries {target}")
    staging = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            os.fchmod(out.fileno(), mode)
            json.dump([e.to_dict() for e in entries], out, indent=2)
            out.write("\n")
            out.flush()
            os.fsync(out.fileno())
        os.replace(staging, target)
    finally:
        staging.unlink(missing_ok=True)
    return len(entries)
