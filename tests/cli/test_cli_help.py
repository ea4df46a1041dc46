"""The command line as a new user meets it (issue 34 item 6): every command and argument
described, defaults shown as values with the setting behind them, a bad value or a wrong flag
refused with the command's own usage, one way to print a cluster id, labelled figures in
``demo``, and API keys written only where asked, readable by their owner alone. No Ray."""

from __future__ import annotations

import argparse
import json
import stat
import subprocess
import sys

import pytest

from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.cli.parser import build_parser
from lifemem_ray.cli.setting_flags import setting_default
from lifemem_ray.core.errors import ConfigError
from lifemem_ray.core.ids import ID_SEQ_BITS, id_label
from lifemem_ray.service.auth import KeyRing, entries_from_environ, hash_key


def cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lifemem_ray.cli", *args], capture_output=True, text=True, timeout=300, cwd=cwd
    )


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """Every command's parser, nested ones (``keys new``) too, with its name path."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name), sub
                yield from commands(sub, (*path, name))


def test_every_command_and_argument_is_described():
    found = list(commands(build_parser()))
    assert len(found) >= 18
    for path, parser in found:
        assert parser.description and len(parser.description) > 40, f"{' '.join(path)}: no description"
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            assert action.help, f"lifemem-ray {' '.join(path)} {action.dest}: no help"


def test_defaults_are_shown_as_values_with_their_setting():
    help_text = " ".join(cli("serve", "--help").stdout.split())
    assert "number of shards (default: 2, setting cluster.shards, 1-1024)" in help_text
    assert "HTTP port (default: 8000, setting http.port, 1-65535)" in help_text
    retrieve = " ".join(cli("retrieve", "--help").stdout.split())
    assert f"(default: {DeploymentConfig().retrieval.k}, setting retrieval.k, 1-1024)" in retrieve
    assert setting_default("experiment.workers")[0] == 2
    with pytest.raises(ConfigError, match=r"no setting 'cluster\.nope'"):
        setting_default("cluster.nope")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["serve", "--store", "x", "--shards", "0"], "argument --shards: must be within [1, 1024], got 0"),
        (
            ["restore", "snap", "--store", "x", "--shards", "2000"],
            "argument --shards: must be within [1, 1024], got 2000",
        ),
        (["serve", "--port", "http"], "argument --port: expected an integer, got 'http'"),
        (["retrieve", "t", "--env", "e", "-k", "0"], "argument -k: must be within [1, 1024], got 0"),
        (["run", "--workers", "0"], "argument --workers: must be within [1, 256], got 0"),
        (["retrieve", "t", "--env", "e", "--bogus"], "unrecognized arguments: --bogus"),
        (["stats", "--store", "x", "--verbos"], "unrecognized arguments: --verbos"),
    ],
)
def test_a_bad_value_or_a_wrong_flag_is_refused_with_the_commands_usage(argv, message):
    proc = cli(*argv)
    assert proc.returncode == 2, proc
    assert proc.stderr.startswith(f"usage: lifemem-ray {argv[0]} "), proc.stderr
    assert f"lifemem-ray {argv[0]}: error: {message}" in proc.stderr


def test_a_shard_count_of_zero_is_refused_by_the_python_api_too():
    with pytest.raises(ConfigError, match=r"shards: cluster.shards: must be within \[1, 1024\], got 0"):
        DeploymentConfig().shard_count(0)
    assert DeploymentConfig().shard_count(None) == 2 and DeploymentConfig().shard_count(3) == 3


def test_a_cluster_id_is_printed_one_way():
    assert id_label(10) == "10" and id_label((2 << ID_SEQ_BITS) | 7) == "2:7" and id_label(None) == "-"


def test_demo_labels_its_figures(tmp_path):
    proc = cli("demo", "--store", str(tmp_path / "demo"))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "cohesion R (the mean resultant length" in " ".join(out.split())
    assert "R=" not in out
    clusters = [line for line in out.splitlines() if line.startswith("  cluster ")]
    assert clusters and all(", cohesion R = " in line and ": n = " in line for line in clusters)
    assert "  similarity  cluster  task" in out


def test_keys_are_written_only_where_asked_and_readable_by_their_owner(tmp_path):
    printed = cli("keys", "new", "--tenant", "acme", "--scopes", "read", "--json", cwd=tmp_path)
    assert printed.returncode == 0 and json.loads(printed.stdout)["key"].startswith("lmk_")
    assert list(tmp_path.iterdir()) == [], "nothing written without --key-file/--entries"
    key_file, entries = tmp_path / "acme.key", tmp_path / "keys.json"
    made = cli(
        "keys",
        "new",
        "--tenant",
        "acme",
        "--scopes",
        "read,write",
        "--key-file",
        str(key_file),
        "--entries",
        str(entries),
        "--json",
    )
    assert made.returncode == 0, made.stderr
    assert "key" not in json.loads(made.stdout), "a key written to a file is not printed"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600 and stat.S_IMODE(entries.stat().st_mode) == 0o600
    key = key_file.read_text().strip()
    assert key not in entries.read_text(), "the keys file holds the hash only"
    ring = KeyRing.from_entries(entries_from_environ({"LIFEMEM_API_KEYS": str(entries)}))
    assert ring.authenticate(f"Bearer {key}").tenant == "acme"
    again = cli(
        "keys", "new", "--tenant", "b", "--scopes", "read", "--key-file", str(key_file), "--entries", str(entries)
    )
    assert again.returncode == 1 and "exists; name a new file" in again.stderr
    assert key_file.read_text().strip() == key and len(json.loads(entries.read_text())) == 1
    second = cli(
        "keys",
        "new",
        "--tenant",
        "b",
        "--scopes",
        "read",
        "--key-file",
        str(tmp_path / "b.key"),
        "--entries",
        str(entries),
    )
    assert second.returncode == 0 and len(json.loads(entries.read_text())) == 2
    assert hash_key((tmp_path / "b.key").read_text().strip()) in entries.read_text()
    entries.write_text("{not json")
    broken = cli(
        "keys",
        "new",
        "--tenant",
        "c",
        "--scopes",
        "read",
        "--key-file",
        str(tmp_path / "c.key"),
        "--entries",
        str(entries),
    )
    assert broken.returncode == 1 and "not valid JSON" in broken.stderr
    assert not (tmp_path / "c.key").exists(), "a key whose entry could not be kept is not left behind"
