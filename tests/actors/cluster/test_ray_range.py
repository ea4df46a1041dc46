"""The Ray versions the project accepts (issue 24, item 4): ``ray[data,serve]>=FLOOR`` in
pyproject.toml, and ``.ci/run`` runs the Ray tests again on exactly FLOOR, in a fresh
environment, so the lower bound is a tested claim rather than a guess.

What sets the floor is what the project relies on, and token authentication most of all: the
project never turns it off, and relies on Ray turning it on for the clusters its tests and its
``serve`` start. These tests check that on whatever Ray is installed (the default suite's, and
the floor in ``.ci/run``): a client that sends no token is refused.

Why 2.59.0: Ray has token authentication from 2.52.0, but only from 2.59.0 on does a local
cluster (``ray.init()``, and ``ray start --head`` where a token exists) turn it on without
``RAY_AUTH_MODE=token`` being set; before, both run without authentication (ray-project/ray
#64755, in 2.59.0 as #66248). No version below 2.59.0 is tested."""

from __future__ import annotations

import json
import re
import shutil
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.version import Version
from support.serve_head import (
    end_head,
    plant_dead_address,
    ray_address,
    serve_head_pids,
    short_ray_tmpdir,
    tokenless_client_answer,
)
from support.wheel_env import clean_env, run_in

ROOT = Path(__file__).resolve().parents[3]


def declared_floor() -> Version:
    """The lowest Ray that pyproject.toml's dependencies accept (``ray[...]>=X``)."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    rays = [d for d in deps if re.match(r"ray(\[[^\]]*\])?\s*>=", d)]
    assert len(rays) == 1, f"one `ray[...]>=X` dependency in pyproject.toml, found {rays}"
    return Version(rays[0].split(">=", 1)[1].split(",")[0].strip())


def floor_ci_installs() -> Version:
    """The Ray version .ci/run's range step installs (``RAY_FLOOR=X``)."""
    found = re.findall(r"^RAY_FLOOR=([0-9.]+)\s*(?:#.*)?$", (ROOT / ".ci" / "run").read_text(), flags=re.MULTILINE)
    assert len(found) == 1, "one RAY_FLOOR=X line in .ci/run"
    return Version(found[0])


def test_the_declared_floor_is_the_one_ci_tests():
    assert declared_floor() == floor_ci_installs(), "pyproject's ray>= and .ci/run's RAY_FLOOR name the same version"


def test_the_installed_ray_is_within_the_declared_range():
    assert Version(version("ray")) >= declared_floor()


def test_the_suites_ray_cluster_refuses_a_client_without_the_token(ray_local):
    """The cluster every Ray test runs on (``ray_local``: a plain local ``ray.init()``)."""
    address = ray_local.get_runtime_context().gcs_address
    assert tokenless_client_answer(Path(sys.executable), address) == "refused ConnectionError"


@pytest.mark.slow
def test_a_head_started_by_serve_refuses_a_client_without_the_token(tmp_path):
    """The head ``lifemem-ray serve --store`` starts for itself, with what a user's shell has
    (no RAY_AUTH_MODE; the token file Ray's ``get-auth-token --generate`` keeps)."""
    venv = Path(sys.prefix)  # this environment: its bin/lifemem-ray
    ray_tmp = short_ray_tmpdir()
    plant_dead_address(ray_tmp)  # serve starts its own head even where other Ray clusters run (see serve_head)
    env = clean_env(RAY_TMPDIR=str(ray_tmp))
    ns = ["--namespace", "rangetest"]
    try:
        served = run_in(
            venv,
            "lifemem-ray",
            "serve",
            "--store",
            str(tmp_path / "store"),
            "--shards",
            "1",
            *ns,
            "--json",
            cwd=tmp_path,
            env=env,
            timeout=600,
        )
        assert served.returncode == 0, served.stderr[-4000:]
        assert serve_head_pids(ray_tmp), "serve started a head of its own"
        address = ray_address(ray_tmp)
        assert address and tokenless_client_answer(Path(sys.executable), address) == "refused ConnectionError"
        stopped = run_in(venv, "lifemem-ray", "stop", *ns, "--ray", "--json", cwd=tmp_path, env=env, timeout=300)
        assert stopped.returncode == 0 and json.loads(stopped.stdout)["stopped"] is True, stopped.stderr[-4000:]
    finally:
        leftovers = [pid for pid in serve_head_pids(ray_tmp) if end_head(pid)]
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert not leftovers, f"`lifemem-ray stop --ray` left the head(s) {leftovers} running"
