"""Rollout workers on Ray against a real memory deployment: faults, stored-once, the
lifelong experiment end to end (real environments, real Ray, real LMDB/FAISS), the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import pytest
from support.common import SMALL_ACTORS

ray = pytest.importorskip("ray")

from lifemem_ray.actors.client.blocking import MemoryClient
from lifemem_ray.actors.cluster import deployment as dep
from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.actors.rollout.experiment import run_experiment
from lifemem_ray.actors.rollout.workers import EpisodeSpec, RolloutPool
from lifemem_ray.lab.envs import make_env
from lifemem_ray.lab.episode import EpisodeLimits
from lifemem_ray.lab.experiment_config import ExperimentConfig

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def memory(ray_local, tmp_path_factory):
    ns = "rollout-test"
    config = DeploymentConfig().replace({**SMALL_ACTORS, "cluster.namespace": ns})
    store = tmp_path_factory.mktemp("rollout-memory")
    dep.deploy(store, config, shards=2)
    client = MemoryClient.connect(namespace=ns, config=config)
    yield ns, config, client
    dep.stop(ns)


def _fast_envs() -> list[str]:
    envs = ["sql"]
    try:
        make_env("twx-coin").close()
        envs.append("twx-coin")
    except Exception:
        pass
    return envs


def test_workers_store_each_task_once_through_crash_hang_and_failure(memory, tmp_path):
    ns, config, client = memory
    tasks = make_env("sql").tasks("train", limit=8)
    # The workers' "sql" is the fault-injecting wrapper around the real one: task 1 kills its
    # worker process, task 3 hangs (the step limit fires, the env is replaced), task 5 raises in step.
    env_options = {
        "sql": {
            "adapter": "faulty",
            "inner": "sql",
            "marker_dir": str(tmp_path),
            "crash_on": [tasks[1].id],
            "hang_on": [tasks[3].id],
            "fail_on": [tasks[5].id],
        }
    }
    before = client.stats()["trajectories"]
    spec = EpisodeSpec(run="faults", phase="learn-00", mode="lifemem", agent="gold", namespace=ns, write=True)
    progress: list[dict] = []
    with RolloutPool(
        2,
        env_options=env_options,
        config=config,
        limits=EpisodeLimits(step_timeout_s=2.0),
        worker_cpus=0.1,
        progress=progress.append,
        progress_every_s=0.2,
    ) as pool:
        outcomes = pool.run(tasks, spec)
        replaced = pool.replaced
    assert [o.error for o in outcomes] == [None] * len(tasks)
    assert all(o.success for o in outcomes) and [o.task.id for o in outcomes] == [t.id for t in tasks]
    attempts = {o.task.id: o.attempts for o in outcomes}
    assert attempts[tasks[1].id] == 2 and replaced == 1  # the crash: retried on a fresh worker
    assert {o.stored for o in outcomes} <= {"added", "pending"}
    by_id = {o.task.id: o for o in outcomes}
    assert by_id[tasks[3].id].summary["env_restarts"] >= 1 and by_id[tasks[5].id].summary["env_restarts"] >= 1
    assert client.stats()["trajectories"] == before + len(tasks)
    assert (
        progress[-1]["episodes"] == len(tasks) and progress[-1]["success_rate"] == 1.0 and progress[-1]["retries"] == 1
    )
    for key in ("steps_per_s", "memory_p50_ms", "episodes_per_s"):
        assert progress[-1][key] > 0
    # A retry after a lost acknowledgement maps to the same ids: nothing is stored twice.
    with RolloutPool(1, config=config, worker_cpus=0.1) as pool:
        again = pool.run(tasks[:3], spec)
    assert [o.stored for o in again] == ["duplicate"] * 3
    assert client.stats()["trajectories"] == before + len(tasks)


def test_a_task_that_always_fails_is_reported_not_dropped(memory, tmp_path):
    _ns, config, _client = memory
    task = make_env("sql").tasks("test", limit=1)[0]
    bad = task.__class__(task.env, "sql-unknown", task.instruction, task.split, {}, task.metadata)  # the env rejects it
    spec = EpisodeSpec(run="bad", phase="eval-00", mode="none", agent="gold")
    with RolloutPool(1, config=config, worker_cpus=0.1, max_attempts=2) as pool:
        [outcome] = pool.run([bad], spec)
    assert (outcome.error is not None and "TaskError" in outcome.error) or "Error" in (outcome.error or "")
    assert not outcome.success and outcome.attempts == 1  # a bad task is not retried


def test_the_pool_resends_an_add_whose_coordinator_died(memory):
    """The adds wait in a paused coordinator, which is killed: the pool's AddFutures send them
    again to the restarted coordinator (the client's rules), so no episode is run again and
    each trajectory is stored once."""
    import threading
    import time

    ns, config, client = memory
    tasks = make_env("sql").tasks("train", limit=4)
    before = client.stats()["trajectories"]
    spec = EpisodeSpec(run="coordinator-dies", phase="learn-00", mode="none", agent="gold", namespace=ns, write=True)
    ray.get(client.coordinator.pause.remote())

    def kill_once_queued() -> None:
        deadline = time.monotonic() + 120
        while ray.get(client.coordinator.stats.remote())["queued"] < len(tasks) and time.monotonic() < deadline:
            time.sleep(0.2)
        ray.kill(client.coordinator, no_restart=False)

    killer = threading.Thread(target=kill_once_queued)
    killer.start()
    progress: list[dict] = []
    with RolloutPool(2, config=config, worker_cpus=0.1, progress=progress.append, progress_every_s=0.2) as pool:
        outcomes = pool.run(tasks, spec)
    killer.join(timeout=10)
    assert [o.error for o in outcomes] == [None] * len(tasks)
    assert [o.attempts for o in outcomes] == [1] * len(tasks) and progress[-1]["retries"] == 0
    assert {o.stored for o in outcomes} <= {"added", "pending"}
    assert client.stats()["trajectories"] == before + len(tasks)


def test_retrieval_modes_from_a_worker(memory):
    ns, config, client = memory
    tasks = make_env("sql").tasks("test", limit=2)
    with RolloutPool(1, config=config, worker_cpus=0.1) as pool:
        out = {}
        for mode in ("none", "trajectory", "lifemem", "global-skills"):
            spec = EpisodeSpec(
                run="modes",
                phase=f"eval-{mode}",
                mode=mode,
                agent="exemplar",
                namespace=None if mode in ("none", "global-skills") else ns,
                global_skill="1. Inspect first.",
            )
            out[mode] = pool.run(tasks, spec, return_trajectories=True)
    assert all(o.error is None for outs in out.values() for o in outs)
    assert out["none"][0].summary["memory_s"] == 0.0
    assert out["lifemem"][0].summary["memory_s"] > 0
    # Global retrieval (trajectory mode) searches every environment, same-env (lifemem) only sql.
    hits_global = client.retrieve(tasks[0].instruction, None, 4, skills=False)
    hits_env = client.retrieve(tasks[0].instruction, "sql", 4)
    assert hits_global.skills == [] and all(h.env == "sql" for h in hits_env.trajectories)


def test_lifelong_experiment_end_to_end(ray_local, tmp_path):
    envs = _fast_envs() + (["websearch"] if _has("websearch") else [])
    exp = ExperimentConfig(
        name="e2e",
        envs=envs,
        eval_envs=[],
        train_tasks=4,
        test_tasks=3,
        workers=2,
        worker_cpus=0.1,
        modes=["none", "trajectory", "global-skills", "lifemem", "lifemem-no-skills", "skills-only"],
        agent="exemplar",
        seeds=2,
        bootstrap=50,
        output=str(tmp_path / "run"),
        self_learn=True,
        env_options={},
    )
    mconf = DeploymentConfig().replace(SMALL_ACTORS)
    report = run_experiment(exp, mconf, progress=None)
    out = tmp_path / "run"
    assert (out / "report.json").is_file() and (out / "report.md").is_file()
    assert sorted(Path(p).name for p in report["plots"]) == [
        "cluster_sizes.png",
        "cluster_types.png",
        "table_heatmap.png",
    ]
    saved = json.loads((out / "report.json").read_text())
    assert saved["seeds"] == [0, 1] and "collected once per seed" in saved["learner"]["collection"]
    for mode in exp.modes:
        table = saved["modes"][mode]["table"]
        # Lower-triangular: after phase j, the environments 1..j.
        assert [sorted(row) for row in table["rows"]] == [sorted(envs[: j + 1]) for j in range(len(envs))]
        assert sorted(table["self_learn"]) == sorted(envs)
        assert saved["modes"][mode]["failed_tasks"] == 0
        assert saved["modes"][mode]["metrics"]["op"] is not None
        ci = saved["modes"][mode]["ci"]
        assert ci["op"][0] <= saved["modes"][mode]["metrics"]["op"] <= ci["op"][1]
    # Every seed: each test task once per mode and row, the same tasks in every mode (paired outcomes).
    for seed in saved["per_seed"]:
        sizes = {mode: [{e: len(v) for e, v in row.items()} for row in rows] for mode, rows in seed["rows"].items()}
        assert len({json.dumps(v, sort_keys=True) for v in sizes.values()}) == 1
    # One shared memory per seed holds every learning trajectory once, environments never mixed in a cluster.
    assert saved["memory"]["trajectories"] == 4 * len(envs)
    assert saved["memory"]["mixed_env_clusters"] == 0
    episodes = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    learn = [e for e in episodes if e["id"].split("/")[1] == "learn"]
    assert len(learn) == 2 * 4 * len(envs) and len({e["id"] for e in learn}) == len(learn)  # collected once per seed
    assert all({"agent_s", "env_s", "memory_s", "total_s"} <= set(e) for e in episodes)
    assert report["throughput"]["steps_per_s"] > 0
    md = (out / "report.md").read_text()
    assert "| skills-only |" in md and " [" in md  # intervals printed


def test_zero_shot_environment_is_routed_to_its_alias_or_the_best_match(ray_local, tmp_path):
    exp = ExperimentConfig(
        name="zs",
        envs=["sql"],
        eval_envs=["sql-copy"],
        train_tasks=3,
        test_tasks=2,
        workers=1,
        worker_cpus=0.1,
        modes=["none", "lifemem", "skills-only"],
        agent="exemplar",
        seeds=1,
        bootstrap=20,
        self_learn=False,
        env_options={"sql-copy": {"adapter": "sql"}},
        output=str(tmp_path / "run"),
    )
    report = run_experiment(exp, DeploymentConfig().replace(SMALL_ACTORS), progress=None)
    for mode in exp.modes:
        assert sorted(report["modes"][mode]["zero_shot"]) == ["sql-copy"]
        assert "sql-copy" in report["modes"][mode]["zero_shot_gain"]
    assert report["modes"]["none"]["zero_shot_gain"]["sql-copy"] == 0.0
    assert "zero-shot sql-copy" in (tmp_path / "run" / "report.md").read_text()


def test_memory_reading_learner_learns_per_mode(ray_local, tmp_path):
    exp = ExperimentConfig(
        name="same",
        envs=["sql"],
        eval_envs=[],
        train_tasks=3,
        test_tasks=2,
        workers=1,
        worker_cpus=0.1,
        modes=["none", "lifemem", "skills-only"],
        agent="exemplar",
        learn_agent="same",
        seeds=1,
        bootstrap=0,
        self_learn=False,
        env_options={},
        output=str(tmp_path / "run"),
    )
    report = run_experiment(exp, DeploymentConfig().replace(SMALL_ACTORS), progress=None)
    assert report["learner"]["collection"].startswith("per mode")
    episodes = [json.loads(line) for line in (tmp_path / "run" / "episodes.jsonl").read_text().splitlines()]
    learning = {e["id"].split("/")[1] for e in episodes if e["id"].split("/")[1].startswith("learn")}
    assert learning == {"learn-00-lifemem", "learn-00-skills-only"}
    assert report["modes"]["lifemem"]["ci"]["op"] is None  # bootstrap = 0: no intervals


def test_buffer_stream_commits_in_batches(ray_local, tmp_path):
    exp = ExperimentConfig(
        name="buf",
        envs=["sql"],
        eval_envs=[],
        train_tasks=7,
        test_tasks=2,
        workers=1,
        worker_cpus=0.1,
        stream="buffer",
        modes=["lifemem"],
        agent="exemplar",
        seeds=1,
        self_learn=False,
        env_options={},
        output=str(tmp_path / "run"),
    )
    report = run_experiment(exp, DeploymentConfig().replace(SMALL_ACTORS), progress=None)
    assert report["memory"]["trajectories"] == 7
    episodes = [json.loads(line) for line in (tmp_path / "run" / "episodes.jsonl").read_text().splitlines()]
    assert all(e["stored"] is None for e in episodes)  # the driver committed them, in caches of 5 then 2


def _has(name: str) -> bool:
    try:
        make_env(name).close()
        return True
    except Exception:
        return False


def test_cli_run_writes_the_report(ray_local, tmp_path):
    address = ray_local.get_runtime_context().gcs_address
    cfg = tmp_path / "run.toml"
    cfg.write_text(
        '[experiment]\nname = "cli"\nenvs = ["sql"]\ntrain_tasks = 3\ntest_tasks = 2\nworkers = 1\nworker_cpus = 0.1\n'
        f'modes = ["none", "lifemem"]\nself_learn = false\noutput = "{tmp_path / "out"}"\n'
        'eval_envs = []\nseeds = 1\nagent = "exemplar"\nenv_options = {}\n'
        "[cluster]\nshard_cpus = 0.1\ncoordinator_cpus = 0.1\nembedder_cpus = 0.1\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "lifemem_ray.cli", "run", "--config", str(cfg), "--address", address, "--quiet"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| lifemem |" in proc.stdout and "report.md" in proc.stdout
    assert json.loads((tmp_path / "out" / "report.json").read_text())["memory"]["trajectories"] == 3
    bad = subprocess.run(
        [sys.executable, "-m", "lifemem_ray.cli", "run", "--config", str(cfg), "--set", "experiment.stream=sideways"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert bad.returncode == 1 and "experiment.stream" in bad.stderr


# Each real environment through the Ray workers: a few gold episodes, stored in the memory.
# Options keep them small; an environment whose package is absent is skipped by name.
REAL_ENVS = {
    "sql": {},
    "websearch": {},
    "fever": {},
    "webshop": {},
    "mind2web": {},
    "twx-coin": {},
    "twx-cookingworld": {},
    "bfcl": {},
    "tau2-retail": {},
    "scienceworld": {
        "task_names": ["find-living-thing"],
        "variations_per_task_train": 2,
        "variations_per_task_test": 1,
    },
    "alfworld": {},
}


def test_gold_rollouts_on_every_installed_environment(memory):
    ns, config, client = memory
    available, missing = {}, []
    for name, options in REAL_ENVS.items():
        try:
            env = make_env(name, **options)
        except Exception as exc:  # EnvUnavailable, ImportError: the package or data is not here
            missing.append(f"{name} ({type(exc).__name__})")
            continue
        try:
            tasks = env.tasks("train", limit=2)
        finally:
            env.close()
        available[name] = tasks
    if len(available) < 3:
        pytest.skip(f"fewer than three environments installed; missing: {', '.join(missing)}")
    tasks = [t for ts in available.values() for t in ts]
    before = client.stats()["trajectories"]
    spec = EpisodeSpec(run="real", phase="learn-00", mode="lifemem", agent="gold", namespace=ns, write=True)
    with RolloutPool(
        2,
        env_options={n: REAL_ENVS[n] for n in available},
        config=config,
        worker_cpus=0.1,
        limits=EpisodeLimits(step_timeout_s=120, episode_timeout_s=400),
    ) as pool:
        outcomes = pool.run(tasks, spec)
    failures = {o.task.id: o.error or o.summary for o in outcomes if not o.success}
    assert not failures, failures
    assert {o.stored for o in outcomes} <= {"added", "pending"}
    assert client.stats()["trajectories"] == before + len(tasks)
    for name in available:
        hits = client.retrieve(available[name][0].instruction, name, 2)
        assert hits.trajectories and all(h.env == name for h in hits.trajectories)


def test_experiment_with_the_llm_agent_through_an_openai_endpoint(ray_local, tmp_path):
    """`run` with an endpoint: the ReAct agent acts in the Ray workers (its prompts carry the
    memory's context) and the coordinator's decisions go to the same server."""
    from support.openai_stub import OpenAIStub, Reply

    def act(request: dict):
        system = request["messages"][0]["content"]
        if not system.startswith("You are an agent"):
            return None  # a memory operation: the stub's sensible answer
        user = request["messages"][1]["content"]
        if "Action 1:" in user:  # second turn: answer
            return Reply.json({"thought": "done", "action": "Action: Answer\nFinal Answer: []"})
        return Reply.json({"thought": "look first", "action": "Operation: SELECT 1;"})

    with OpenAIStub(responder=act, sensible=True) as stub:
        mconf = DeploymentConfig().replace(
            {
                **SMALL_ACTORS,
                "llm.backend": "openai",
                "llm.base_url": stub.base_url,
                "llm.model": "stub",
                "llm.timeout_s": 20,
            }
        )
        exp = ExperimentConfig(
            name="llm",
            envs=["sql"],
            train_tasks=3,
            test_tasks=2,
            workers=1,
            worker_cpus=0.1,
            agent="react",
            learn_agent="gold",
            modes=["none", "lifemem"],
            self_learn=False,
            output=str(tmp_path / "run"),
            eval_envs=[],
            seeds=1,
            env_options={},
        )
        report = run_experiment(exp, mconf, progress=None)
        acts = [r for r in stub.requests if r["messages"][0]["content"].startswith("You are an agent")]
    episodes = [json.loads(line) for line in (tmp_path / "run" / "episodes.jsonl").read_text().splitlines()]
    evals = [e for e in episodes if "/eval-" in e["id"]]
    assert len(evals) == 4 and report["modes"]["lifemem"]["failed_tasks"] == 0
    assert len(acts) == 2 * len(evals)  # two turns per test episode, none while the gold agent learnt
    with_memory = [r for r in acts if "<example n=" in r["messages"][1]["content"]]
    assert len(with_memory) == 4  # the lifemem mode's two episodes, both turns
    assert report["memory"]["trajectories"] == 3


def test_test_tasks_skip_overlap_and_ask_gold_only_as_far_as_needed():
    from lifemem_ray.actors.rollout.experiment import _pick_test
    from lifemem_ray.lab.envs.base import Task

    class Env:
        asked: ClassVar[list[str]] = []  # shared: the test reads what any instance was asked

        def gold_actions(self, task):
            self.asked.append(task.id)
            return ["go", task.id[-1]] if task.id != "t1" else ["go", "a"]  # t1 replays training task a

    train = [Task("e", "a", "goal a"), Task("e", "b", "goal b")]
    candidates = [Task("e", f"t{i}", f"goal t{i}") for i in range(10)]
    env = Env()
    exp = ExperimentConfig(test_tasks=3, eval_envs=[], env_options={})
    test, counts = _pick_test(exp, env, train, candidates)
    assert [t.id for t in test] == ["t0", "t2", "t3"] and counts == {
        "gold": 1,
        "goal": 0,
        "one_template": False,
        "dropped": 1,
    }
    assert env.asked == ["a", "b", "t0", "t1", "t2", "t3"]  # not the rest of the fold
    exp.dedupe_test = False
    test, counts = _pick_test(exp, Env(), train, candidates[:3])
    assert [t.id for t in test] == ["t0", "t1", "t2"] and counts["gold"] == 1 and counts["dropped"] == 0


def test_the_paper_environments_added_last_run_in_a_lifelong_experiment(ray_local, tmp_path):
    """WebShop and Mind2Web in the stream beside SQL, FEVER held out for zero-shot evaluation
    (as the paper uses it): every mode runs every environment to a score. Mind2Web and FEVER
    read the shared data: skipped without it."""
    for name in ("fever", "mind2web"):
        if not _has(name):
            pytest.skip(f"{name} is unavailable here (its data is in ../shared)")
    exp = ExperimentConfig(
        name="paper-last",
        envs=["sql", "webshop", "mind2web"],
        eval_envs=["fever"],
        train_tasks=3,
        test_tasks=2,
        workers=1,
        worker_cpus=0.1,
        modes=["none", "lifemem"],
        agent="exemplar",
        seeds=1,
        bootstrap=0,
        self_learn=False,
        env_options={},
        output=str(tmp_path / "run"),
    )
    report = run_experiment(exp, DeploymentConfig().replace(SMALL_ACTORS), progress=None)
    episodes = [json.loads(line) for line in (tmp_path / "run" / "episodes.jsonl").read_text().splitlines()]
    assert {e["env"] for e in episodes} == {"sql", "webshop", "mind2web", "fever"}
    assert not [e for e in episodes if e.get("error")]
    for mode in exp.modes:
        assert sorted(report["modes"][mode]["zero_shot"]) == ["fever"]
    assert report["memory"]["trajectories"] >= 9  # the learning phase stored the stream's train tasks
