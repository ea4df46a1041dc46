"""The command line, run as a user would: the installed ``lifemem-ray`` script."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lifemem_ray.core.importers import write_jsonl
from lifemem_ray.lab.synthetic import generate

SCRIPT = shutil.which("lifemem-ray") or str(Path(sys.executable).parent / "lifemem-ray")


def run(*args: str, check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([SCRIPT, *args], capture_output=True, text=True, timeout=300, input=stdin)
    if check and proc.returncode != 0:
        raise AssertionError(f"lifemem-ray {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}")
    return proc


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A store filled through the CLI once for the module's read-only commands."""
    root = tmp_path_factory.mktemp("cli")
    data = root / "train.jsonl"
    write_jsonl(generate(40, seed=3, envs=["shop", "wiki_qa", "sql", "retail"], length_scale=0.1), data)
    out = run("ingest", str(data), "--store", str(root / "store"), "--json")
    report = json.loads(out.stdout)
    assert report["added"] == 40 and report["invalid"] == 0
    return root


def test_ingest_is_idempotent_and_reports(store):
    out = run("ingest", str(store / "train.jsonl"), "--store", str(store / "store"), "--json")
    report = json.loads(out.stdout)
    assert report["added"] == 0 and report["duplicates"] == 40
    assert report["store"]["trajectories"] == 40


def test_retrieve_json_shape(store):
    out = run(
        "retrieve",
        "i need running shoes, price lower than 50.00 dollars",
        "--store",
        str(store / "store"),
        "--env",
        "shop",
        "-k",
        "3",
        "--json",
    )
    data = json.loads(out.stdout)
    assert set(data) == {"trajectories", "skills"}
    assert len(data["trajectories"]) == 3
    for hit in data["trajectories"]:
        assert set(hit) == {"id", "env", "task", "score", "cluster_id"} and hit["env"] == "shop"
    assert data["skills"] and all(set(s) == {"cluster_id", "text"} and s["text"] for s in data["skills"])
    text = run("retrieve", "buy shoes", "--store", str(store / "store"), "--env", "shop", "--context")
    assert "Examples of earlier runs" in text.stdout and ", succeeded]" in text.stdout


def test_stats_clusters_export_check(store, tmp_path):
    stats = json.loads(run("stats", "--store", str(store / "store"), "--json").stdout)
    assert stats["trajectories"] == 40 and stats["clusters"] >= 4
    assert set(stats["per_env"]) == {"shop", "wiki_qa", "sql", "retail"}
    assert all(set(v) == {"trajectories", "clusters"} for v in stats["per_env"].values())
    assert {"calls", "tokens", "fallbacks"} <= set(stats["llm"])
    clusters = json.loads(run("clusters", "--store", str(store / "store"), "--env", "sql", "--json").stdout)
    assert clusters and all("sql" in c["envs"] and c["description"] and c["skill"] for c in clusters)
    out = json.loads(run("export", "--store", str(store / "store"), str(tmp_path / "out.jsonl"), "--json").stdout)
    assert out["trajectories"] == 40 and (tmp_path / "out.clusters.jsonl").exists()
    assert json.loads(run("check", "--store", str(store / "store"), "--json").stdout)["ok"] is True
    assert "trajectories" in run("stats", "--store", str(store / "store")).stdout


def test_malformed_records(tmp_path):
    data = tmp_path / "bad.jsonl"
    good = json.dumps({"env": "e", "task": "t", "steps": [{"action": "a"}]})
    data.write_text(good + "\n" + "{not json\n" + json.dumps({"env": "e", "steps": [{"action": "a"}]}) + "\n")
    proc = run("ingest", str(data), "--store", str(tmp_path / "s"), check=False)
    assert proc.returncode == 1
    assert f"{data}:2:" in proc.stderr and "Traceback" not in proc.stderr
    # Nothing of a failed run is stored beyond what was acknowledged before the bad line.
    skipped = run("ingest", str(data), "--store", str(tmp_path / "s2"), "--skip-invalid", "--json")
    report = json.loads(skipped.stdout)
    assert report["invalid"] == 2 and report["valid"] == 1 and len(report["errors"]) == 2
    assert any(":3:" in e and "task" in e for e in report["errors"])


def test_chat_format_with_env_flag_and_stdin(tmp_path):
    record = {
        "task": "Find X",
        "messages": [
            {"role": "user", "content": "Find X"},
            {"role": "assistant", "content": "Thought 1: go\nAction 1: Search[X]"},
            {"role": "user", "content": "Observation 1: X is Y"},
        ],
    }
    lines = "\n".join(json.dumps({**record, "task": f"Find X{i}"}) for i in range(6)) + "\n"
    proc = run(
        "ingest", "-", "--store", str(tmp_path / "s"), "--env", "wiki", "--format", "chat", "--json", stdin=lines
    )
    assert json.loads(proc.stdout)["added"] == 6
    stats = json.loads(run("stats", "--store", str(tmp_path / "s"), "--json").stdout)
    assert stats["per_env"]["wiki"]["trajectories"] == 6


def test_errors_are_one_line(tmp_path):
    proc = run("retrieve", "x", "--store", str(tmp_path / "none"), "--env", "e", check=False)
    assert proc.returncode == 1 and "no memory store" in proc.stderr and "Traceback" not in proc.stderr
    proc = run("stats", "--store", str(tmp_path / "none"), "--set", "evolution.top_k=many", check=False)
    assert proc.returncode == 1 and "evolution.top_k: expected an integer" in proc.stderr
    proc = run("frobnicate", check=False)
    assert proc.returncode == 2


def test_second_writer_gets_a_clear_error(store, tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys,time; from lifemem_ray.engine.memory import Memory; m=Memory.open(sys.argv[1]); print('open', flush=True); time.sleep(60)",
            str(tmp_path / "s"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "open"
        proc = run("ingest", str(store / "train.jsonl"), "--store", str(tmp_path / "s"), check=False)
        assert proc.returncode == 1 and "open for writing by another process" in proc.stderr
    finally:
        holder.kill()
        holder.wait()


def test_demo_runs(tmp_path):
    proc = run("demo", "--store", str(tmp_path / "demo"), "--json")
    report = json.loads(proc.stdout)
    assert report["trajectories"] == 90 and report["clusters"] >= 6
    assert report["retrieval"]["trajectories"] and all(t["env"] == "shop" for t in report["retrieval"]["trajectories"])
    assert report["retrieval"]["skills"]


def test_terminal_control_sequences_in_stored_text_are_shown_escaped(tmp_path):
    from lifemem_ray.core.model import Outcome, Step, Trajectory

    hostile = [
        Trajectory(
            env="shop",
            task=f"buy shoes \x1b[2J\x1b]0;pwned\x07 number {i} \u202eevil",
            steps=(Step(action="search[shoes \x1b[31m]", observation="\x9b2J results"),),
            outcome=Outcome(success=True),
        )
        for i in range(6)
    ]
    write_jsonl(hostile, tmp_path / "h.jsonl")
    store = str(tmp_path / "store")
    run("ingest", str(tmp_path / "h.jsonl"), "--store", store)
    for args in (
        ("retrieve", "buy shoes", "--store", store, "--env", "shop", "--context"),
        ("retrieve", "buy shoes", "--store", store, "--env", "shop", "--json"),
        ("clusters", "--store", store),
        ("clusters", "--store", store, "--json"),
    ):
        out = run(*args).stdout
        assert not any(c in out for c in ("\x1b", "\x9b", "\x07", "\u202e")), args
        assert "\\u001b" in out or args[0] == "clusters"
        if "--json" in args:
            json.loads(out)  # still JSON


def _lines(n: int, seed: int) -> list[str]:
    return [
        json.dumps(t.to_dict())
        for t in generate(n, seed=seed, envs=["shop", "sql"], length_scale=0.1, id_prefix=f"f{seed}")
    ]


def test_ingest_is_all_or_nothing_per_file(tmp_path):
    import gzip

    store = str(tmp_path / "s")
    lines = _lines(300, seed=1)
    late = tmp_path / "late.jsonl"
    late.write_text("\n".join([*lines[:289], "{not json", *lines[289:299]]) + "\n")
    proc = run("ingest", str(late), "--store", store, check=False)
    assert (
        proc.returncode == 1
        and f"{late}:290:" in proc.stderr
        and "nothing of" in proc.stderr
        and "0 record(s) stored" in proc.stderr
    )
    assert "Traceback" not in proc.stderr
    # A compressed file whose checksum fails at its end: nothing of it is stored.
    packed = bytearray(gzip.compress(("\n".join(lines[:120]) + "\n").encode()))
    packed[-8] ^= 0xFF  # the CRC32 in the trailer
    bad_gzip = tmp_path / "crc.jsonl.gz"
    bad_gzip.write_bytes(bytes(packed))
    proc = run("ingest", str(bad_gzip), "--store", store, check=False)
    assert proc.returncode == 1 and str(bad_gzip) in proc.stderr
    proc = run("ingest", str(bad_gzip), "--store", store, "--skip-invalid", "--json")
    assert json.loads(proc.stdout)["added"] == 0
    # A good file first, then a bad one: the summary says what the good one stored.
    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(lines[:5]) + "\n")
    proc = run("ingest", str(good), str(late), "--store", store, check=False)
    assert proc.returncode == 1 and "5 record(s) stored from 1 earlier file(s)" in proc.stderr
    assert json.loads(run("stats", "--store", store, "--json").stdout)["trajectories"] == 5


def test_skip_invalid_skips_and_lists_conflicting_ids(tmp_path):
    store = str(tmp_path / "s")
    lines = _lines(12, seed=2)
    first = tmp_path / "a.jsonl"
    first.write_text("\n".join(lines[:6]) + "\n")
    run("ingest", str(first), "--store", store)
    changed = json.loads(lines[2])
    changed["task"] += " (edited)"
    repeat = json.loads(lines[7])
    repeat["task"] += " (edited)"
    second = tmp_path / "b.jsonl"
    second.write_text("\n".join([lines[6], json.dumps(changed), lines[7], json.dumps(repeat), lines[8]]) + "\n")
    proc = run("ingest", str(second), "--store", store, check=False)
    assert (
        proc.returncode == 1
        and f"{second}:2:" in proc.stderr
        and "already stored with different content" in proc.stderr
    )
    report = json.loads(run("ingest", str(second), "--store", store, "--skip-invalid", "--json").stdout)
    assert report["added"] == 3 and report["invalid"] == 2
    assert any(f"{second}:2:" in e for e in report["errors"]) and any(
        f"{second}:4:" in e and "repeats line 3" in e for e in report["errors"]
    )
    assert json.loads(run("stats", "--store", store, "--json").stdout)["trajectories"] == 9


def test_a_listening_cluster_that_refuses_us_is_reported_as_an_authentication_failure(tmp_path, monkeypatch):
    """The message for a Ray cluster that listens but refused the handshake (checked on its
    parts: starting a second, token-protected cluster here would disturb the session's)."""
    import socket

    from lifemem_ray.actors.cluster.ray_address import answers
    from lifemem_ray.cli.ray_session import refused as _refused

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        assert answers(f"127.0.0.1:{port}")
    finally:
        server.close()
    assert not answers(f"127.0.0.1:{port}") and not answers("auto")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    assert "no token was found" in _refused("10.0.0.1:6379") and "ray get-auth-token" in _refused("10.0.0.1:6379")
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("abc")
    assert f"the token in {tmp_path / '.ray' / 'auth_token'} was not accepted" in _refused("10.0.0.1:6379")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "x")
    assert "RAY_AUTH_TOKEN was not accepted" in _refused("10.0.0.1:6379")


def test_stopping_our_head_forgets_rays_current_cluster_file_only_when_it_names_that_head(tmp_path):
    from lifemem_ray.cli.ray_session import forget_current_cluster as _forget_current_cluster

    current = tmp_path / "ray_current_cluster"
    current.write_text("10.0.0.7:6379")
    _forget_current_cluster("10.0.0.8:6379", current)
    assert current.read_text() == "10.0.0.7:6379", "another cluster's file stays"
    _forget_current_cluster("10.0.0.7:6379", current)
    assert not current.exists(), "the stopped head's file goes, as Ray's own stop command removes it"
    _forget_current_cluster("10.0.0.7:6379", current)  # no file: nothing to do


def test_delete_on_a_mistyped_store_path_creates_nothing(tmp_path):
    missing = tmp_path / "stroe"
    out = run("delete", "some-id", "--store", str(missing), check=False)
    assert out.returncode == 1 and "no memory store here (data.mdb missing)" in out.stderr
    assert not missing.exists()


def test_version_is_the_packages_one_version(capsys):
    from lifemem_ray import __version__
    from lifemem_ray.cli.parser import build_parser

    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"lifemem-ray {__version__}"
