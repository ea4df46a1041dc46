"""The command line against a running deployment (``--address`` / ``--namespace``): bad input
gets the same answers as local ingest, standard input works, and joining by address keeps Ray's
token authentication on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from lifemem_ray.lab.synthetic import generate

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lifemem_ray.cli", *args],
        capture_output=True,
        text=True,
        timeout=600,
        input=stdin,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def test_remote_ingest_answers_bad_input_as_local_ingest(deployment, ray_local, tmp_path):
    client, _ = deployment(shards=2)
    remote = ["--address", ray_local.get_runtime_context().gcs_address, "--namespace", client.namespace]
    lines = [
        json.dumps(t.to_dict()) for t in generate(40, seed=4, envs=["shop", "sql"], length_scale=0.1, id_prefix="r")
    ]
    late = tmp_path / "late.jsonl"
    late.write_text(
        "\n".join(
            [*lines[:30], '{"env": "shop", "task": "t", "steps": [{"action": "a"}], "task": "dup key"}', *lines[30:]]
        )
        + "\n"
    )
    local = _cli("ingest", str(late), "--store", str(tmp_path / "local"))
    far = _cli("ingest", str(late), *remote)
    assert local.returncode == far.returncode == 1
    assert (
        local.stderr == far.stderr
        and f"{late}:31:" in far.stderr
        and "nothing of" in far.stderr
        and "Traceback" not in far.stderr
    )
    assert client.stats()["trajectories"] == 0
    bad_utf8 = tmp_path / "utf8.jsonl"
    bad_utf8.write_bytes(("\n".join(lines[:3]) + "\n").encode() + b'{"env": "shop", "task": "\xff"}\n')
    local, far = (
        _cli("ingest", str(bad_utf8), "--store", str(tmp_path / "local2")),
        _cli("ingest", str(bad_utf8), *remote),
    )
    assert (
        local.returncode == far.returncode == 1
        and local.stderr == far.stderr
        and f"{bad_utf8}:4: not UTF-8" in far.stderr
    )
    # Standard input, and --skip-invalid: the bad record is left out and listed, the rest stored.
    ok = _cli("ingest", "-", *remote, "--skip-invalid", "--json", stdin=late.read_text())
    assert ok.returncode == 0, ok.stderr[-2000:]
    report = json.loads(ok.stdout)
    assert report["added"] == 40 and report["invalid"] == 1 and "<stdin>:31:" in report["errors"][0]
    assert client.stats()["trajectories"] == 40
    # An id stored with other content: refused by file and line, or left out, as locally.
    local = str(tmp_path / "local3")
    assert _cli("ingest", "-", "--store", local, "--skip-invalid", stdin=late.read_text()).returncode == 0
    changed = json.loads(lines[5])
    changed["task"] += " (edited)"
    fresh = [json.dumps(t.to_dict()) for t in generate(2, seed=9, envs=["shop"], length_scale=0.1, id_prefix="n")]
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("\n".join([fresh[0], json.dumps(changed), fresh[1]]) + "\n")
    here, far = _cli("ingest", str(mixed), "--store", local), _cli("ingest", str(mixed), *remote)
    assert here.returncode == far.returncode == 1 and here.stderr == far.stderr and f"{mixed}:2:" in far.stderr
    here = json.loads(_cli("ingest", str(mixed), "--store", local, "--skip-invalid", "--json").stdout)
    far = json.loads(_cli("ingest", str(mixed), *remote, "--skip-invalid", "--json").stdout)
    assert here["added"] == far["added"] == 2 and here["errors"] == far["errors"] and f"{mixed}:2:" in far["errors"][0]
    deep = _cli("check", "--deep", *remote)
    assert deep.returncode == 0 and deep.stdout.startswith("ok: 42 trajectories"), deep.stdout + deep.stderr[-1000:]
    assert client.verify(deep=True)["ok"]


def test_joining_by_address_sends_the_token(deployment, ray_local):
    """Ray turns token authentication on by itself only for a cluster it found by searching; a
    command given --address (with RAY_AUTH_MODE unset) turns it on where a token exists, so the
    session's token-protected cluster accepts it. Before: refused ("Authentication token is
    missing"). A client that sends no token is still refused, and told why."""
    client, _ = deployment(shards=1)
    remote = ["--address", ray_local.get_runtime_context().gcs_address, "--namespace", client.namespace, "--json"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    done = subprocess.run(
        [sys.executable, "-m", "lifemem_ray.cli", "stats", *remote],
        capture_output=True,
        text=True,
        timeout=600,
        env={**env, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0 and json.loads(done.stdout)["trajectories"] == 0, done.stderr[-2000:]
    tokenless = subprocess.run(
        [sys.executable, "-m", "lifemem_ray.cli", "stats", *remote],
        capture_output=True,
        text=True,
        timeout=600,
        env={**env, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"},
    )
    assert tokenless.returncode == 1 and "refused this client" in tokenless.stderr, tokenless.stderr[-2000:]
    assert "RAY_AUTH_MODE=disabled" in tokenless.stderr
