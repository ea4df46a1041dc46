"""Deployments and their durable addresses, through Ray: one durable address serves one
deployment (a second is refused at serve, naming the owner), a shard whose log another writer
took over says so in ``status`` and refuses writes, and a restore is all or nothing (killed at
any point it leaves no deployment to reach, and the same command finishes it)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.common import SMALL_ACTORS

from lifemem_ray.core.errors import DeploymentExistsError, DeploymentNotFoundError, PathExistsError
from lifemem_ray.engine.memory import Memory
from lifemem_ray.engine.store.log_errors import DurableAddressOwnedError, LogForkedError
from lifemem_ray.lab.synthetic import generate, text_vectors

ROOT = Path(__file__).resolve().parents[3]


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lifemem_ray.cli", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )


def _data(n: int, seed: int):
    trajs = list(generate(n, seed=seed, envs=["shop", "sql"], length_scale=0.2, id_prefix=f"d{seed}-"))
    return trajs, text_vectors([t.task for t in trajs], dim=384)


def _log_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _writers(address: Path) -> set[str]:
    """The owners of every entry of every shard log under ``address``."""
    from lifemem_ray.engine.store.shared_log import SharedLog

    owners = set()
    for folder in sorted(p for p in address.iterdir() if p.is_dir()):
        log = SharedLog(str(folder))
        owners |= {log.read_entry(seq).writer.owner for seq in log.sequence_numbers()}
    return owners


def test_a_second_deployment_on_one_durable_address_is_refused_naming_the_owner(deployment, ray_local, tmp_path):
    from lifemem_ray.actors.cluster import deployment as dep

    durable = tmp_path / "durable"
    client, info = deployment(shards=2, store=tmp_path / "first", **{"cluster.durable_uri": str(durable)})
    trajs, vecs = _data(60, seed=1)
    client.add_many(trajs, vecs).result(timeout=300)
    owner = json.loads((durable / client.namespace / "deployment.json").read_text())
    assert owner["store"] == str((tmp_path / "first").resolve())
    before = _log_files(durable)

    # A second deployment, on a Ray head of its own (what `serve` starts when no cluster is named),
    # the same namespace and durable address, as a user would start it: refused before any actor starts.
    config = tmp_path / "second.toml"
    config.write_text(f'[cluster]\ndurable_uri = "{durable}"\nshard_cpus = 0.1\ncoordinator_cpus = 0.1\n')
    alone = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    served = subprocess.run(
        [sys.executable, "-m", "lifemem_ray.cli", "serve", "--store", str(tmp_path / "second"),
         "--namespace", client.namespace, "--config", str(config)],
        capture_output=True, text=True, timeout=600, env={**alone, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert served.returncode != 0, served.stdout
    assert f"belongs to deployment {owner['deployment_id']}" in served.stderr and "Traceback" not in served.stderr
    assert str((tmp_path / "first").resolve()) in served.stderr
    assert _writers(durable / client.namespace) == {owner["deployment_id"]}, "no entry of another deployment"
    assert {p.split("/")[1] for p in _log_files(durable)} == {p.split("/")[1] for p in before}, "no shard log added"
    assert client.stats()["trajectories"] == 60  # the first one serves on, untouched

    # The same, stopped first: still refused (the address belongs to the first store folder).
    dep.stop(client.namespace)
    from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig

    second = DeploymentConfig().replace(
        {"cluster.namespace": client.namespace, "cluster.durable_uri": str(durable), **SMALL_ACTORS}
    )
    with pytest.raises(DurableAddressOwnedError) as refused:
        dep.deploy(tmp_path / "second-again", second, shards=2)
    assert refused.value.owner["deployment_id"] == owner["deployment_id"]
    named = ray_local.util.list_named_actors(all_namespaces=True)
    assert not [a for a in named if a["namespace"] == client.namespace], "no actor was started"
    # The owner's store folder serves again, with everything.
    again = dep.deploy(tmp_path / "first", second)
    assert again["shards"] == info["shards"]
    from lifemem_ray.actors.client.blocking import MemoryClient

    assert MemoryClient(client.namespace, second).stats()["trajectories"] == 60


def test_a_shard_whose_log_was_taken_over_is_deposed_and_status_says_so(deployment, tmp_path):
    from lifemem_ray.actors.cluster.checkpoints import shard_log_uri
    from lifemem_ray.actors.cluster.status import deployment_status, status_table

    durable = tmp_path / "durable"
    client, _ = deployment(shards=1, store=tmp_path / "store", **{"cluster.durable_uri": str(durable)})
    trajs, vecs = _data(30, seed=2)
    client.add_many(trajs[:20], vecs[:20]).result(timeout=300)
    status = deployment_status(client.namespace)
    writer = status["shards"][0]["durable"]["writer"]
    assert status["shards"][0]["health"] == "up" and writer["epoch"] >= 1 and writer["owner"]

    # The shard opened elsewhere by the same deployment (a node given up on, its copy reopened).
    shutil.copytree(tmp_path / "store" / "shard-00", tmp_path / "elsewhere", ignore=shutil.ignore_patterns("*.lock"))
    from lifemem_ray.engine.memory_config import MemoryConfig

    taken = MemoryConfig().replace(
        {
            "store.shared_log_uri": shard_log_uri(str(durable), client.namespace, 0),
            "store.shared_log_owner": writer["owner"],
        }
    )
    with Memory.open(tmp_path / "elsewhere", taken, namespace=1) as other:
        assert other.stats()["trajectories"] == 20
        status = deployment_status(client.namespace)
        assert status["shards"][0]["health"] == "deposed", status["shards"][0]
        assert "taken over" in status["shards"][0]["why"] and "deposed" in status_table(status)
        with pytest.raises(LogForkedError):
            client.add_many(trajs[20:], vecs[20:]).result(timeout=300)
        assert other.stats()["trajectories"] == 20


@pytest.mark.parametrize("killed_at", ["restore.shards_started", "restore.absorbed", "restore.served"])
def test_an_interrupted_restore_serves_nothing_and_the_same_command_finishes_it(ray_local, tmp_path, killed_at):
    from lifemem_ray.actors.client.blocking import MemoryClient
    from lifemem_ray.actors.cluster import deployment as dep
    from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig

    trajs, vecs = _data(300, seed=3)
    with Memory.open(tmp_path / "source") as memory:
        memory.add_many(trajs, vecs)
    namespace = f"restore-{killed_at.split('.')[1]}-{os.getpid()}"
    config = tmp_path / "small.toml"
    config.write_text("[cluster]\nshard_cpus = 0.1\ncoordinator_cpus = 0.1\nembedder_cpus = 0.1\n")
    command = [
        "restore", str(tmp_path / "source"), "--store", str(tmp_path / "restored"), "--shards", "3",
        "--address", ray_local.get_runtime_context().gcs_address, "--namespace", namespace, "--config", str(config),
    ]  # fmt: skip
    killed = _cli(*command, env={"LIFEMEM_FAILPOINTS": killed_at})
    assert killed.returncode == -9, killed.stderr[-2000:]
    try:
        served = DeploymentConfig().replace({"cluster.namespace": namespace, **SMALL_ACTORS})
        if killed_at == "restore.served":  # all of it reachable: only the marker was left to remove
            assert MemoryClient(namespace, served).stats()["trajectories"] == 300
        else:
            with pytest.raises(DeploymentNotFoundError):  # nothing a client can reach
                dep.find_coordinator(namespace)
        refusal = DeploymentExistsError if killed_at == "restore.served" else PathExistsError
        with pytest.raises(refusal, match="already runs" if killed_at == "restore.served" else "interrupted"):
            dep.deploy(tmp_path / "restored", served)
        other = _cli(*[a if a != "3" else "2" for a in command])  # another restore into that folder: refused
        assert other.returncode != 0 and "run that same command again" in other.stderr

        finished = _cli(*command, "--json")
        assert finished.returncode == 0, finished.stderr[-2000:]
        report = json.loads(finished.stdout)
        assert report["resumed"] and report["trajectories"] == 300
        client = MemoryClient(namespace, served)
        stats = client.stats()
        assert stats["trajectories"] == 300 and len(stats["shards"]) == 3
        assert client.verify()["ok"]
        assert not (tmp_path / "restored" / "restoring.json").exists()
    finally:
        dep.stop(namespace)
