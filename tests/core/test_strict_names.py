"""Issue 23, finding 5: names are matched as whole strings. Before, ``check_tenant`` used
``re.match`` with ``$``, which also matches before a final newline: ``ingest --tenant
$'acme\\n'`` stored 50 records under ``acme\\n`` and an operator purging ``acme`` missed them;
key names and hashes had the same pattern. Environment names now refuse control characters.
A store that holds data under such a name from an older version can still be purged."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lifemem_ray.core import tenancy
from lifemem_ray.core.errors import ConfigError, InvalidTrajectoryError, TenantError
from lifemem_ray.core.importers import write_jsonl
from lifemem_ray.core.model import Step, Trajectory
from lifemem_ray.engine.memory import Memory
from lifemem_ray.lab.synthetic import generate, label_vectors
from lifemem_ray.service.auth import new_key, parse_key_entries

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["acme\n", "acme\r\n", "\nacme", "ac\nme", "acme ", "acme\t", "", "-acme", "a" * 65])
def test_tenant_names_are_whole_strings(name):
    assert not tenancy.is_name(name)
    with pytest.raises(TenantError, match="not a tenant name"):
        tenancy.check_tenant(name)
    record = {"env": "shop", "task": "t", "steps": [{"action": "a"}], "tenant": name}
    with pytest.raises(InvalidTrajectoryError):  # every input path builds records with from_dict
        Trajectory.from_dict(record)


def test_key_entries_refuse_a_name_or_hash_with_a_final_newline():
    _, entry = new_key("acme", "read", name="k1")
    good = entry.to_dict()
    assert parse_key_entries([good], "keys")[0].name == "k1"
    for field, value in (("name", "k1\n"), ("sha256", good["sha256"] + "\n"), ("tenant", "acme\n")):
        with pytest.raises(ConfigError, match=rf"keys\[0\]\.{field}"):
            parse_key_entries([{**good, field: value}], "keys")
    with pytest.raises(ConfigError, match="--name"):
        new_key("acme", "read", name="k1\n")


@pytest.mark.parametrize("env", ["shop\n", "sh\nop", "shop\t", "sh\u200bop", "\x1b[31mshop"])
def test_environment_names_refuse_control_characters(env):
    with pytest.raises(InvalidTrajectoryError, match=r"env: .*(control character|surrounding spaces)"):
        Trajectory(env=env, task="t", steps=(Step(action="a"),))


def test_cli_ingest_refuses_a_tenant_with_a_final_newline(tmp_path):
    data = tmp_path / "d.jsonl"
    write_jsonl(generate(5, seed=2, length_scale=0.1), data)
    store = tmp_path / "store"
    done = subprocess.run(
        [sys.executable, "-m", "lifemem_ray.cli", "ingest", str(data), "--store", str(store), "--tenant", "acme\n"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 1 and "not a tenant name" in done.stderr, done.stderr[-2000:]
    assert not (store / "data.mdb").exists() or Memory.open(store, read_only=True).stats()["trajectories"] == 0


def test_data_stored_under_a_legacy_name_can_still_be_purged(tmp_path, monkeypatch):
    """An older version stored records under ``acme\\n``; removal and purge accept that name
    (nothing new is ever stored under it), so the operator can delete them."""
    trajs = list(generate(30, seed=3, length_scale=0.1))
    vecs = label_vectors([t.metadata["workflow"] for t in trajs], list(range(len(trajs))))
    legacy = [
        Trajectory(env=t.env, task=t.task, steps=t.steps, outcome=t.outcome, id=t.id, tenant="acme\n") for t in trajs
    ]
    from lifemem_ray.engine import ingest

    with monkeypatch.context() as old:  # the old check: "$" matched before a final newline
        old.setattr(
            ingest,
            "is_name",
            lambda v: isinstance(v, str) and tenancy._NAME.fullmatch(v.removesuffix("\n")) is not None,
        )
        with Memory.open(tmp_path / "s") as memory:
            memory.add_many(legacy, vecs)
    with Memory.open(tmp_path / "s") as memory:
        stats = memory.stats()
        assert stats["trajectories"] == 30 and "acme\n" in stats["per_tenant"]  # shown to the operator
        with pytest.raises(
            InvalidTrajectoryError, match=r"trajectories\[0\]\.tenant: .*not a tenant name"
        ):  # nothing new
            memory.add_many([Trajectory(env="shop", task="t", steps=(Step(action="a"),), tenant="acme\n")])
        assert memory.remove([trajs[0].id], tenant="acme\n") == 1
        assert memory.purge_tenant("acme\n") == 29
        assert memory.stats()["trajectories"] == 0
        assert memory.verify(deep=True)["ok"]
