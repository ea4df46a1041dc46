"""Rollout workers running many episodes at once against a deployment (the episodes themselves:
tests/lab/test_rollout_async.py)."""

from __future__ import annotations

from support.openai_stub import OpenAIStub
from test_rollout_async import LATENCY_S, SqlPlayer, _pool_config, _sql_tasks

from lifemem_ray.lab.envs import Task


def test_a_worker_runs_its_episodes_at_once_and_stores_each_trajectory_once(deployment):
    from lifemem_ray.actors.rollout.workers import EpisodeSpec, RolloutPool

    memory, _ = deployment(shards=2)
    n = 4
    tasks = _sql_tasks(2 * n)
    player = SqlPlayer(tasks, {t.id for t in tasks[::3]})
    spec = EpisodeSpec(
        run="async", phase="learn-00", mode="lifemem", agent="react", namespace=memory.namespace, write=True
    )
    with OpenAIStub(responder=player, latency_s=LATENCY_S) as stub:
        config = _pool_config(memory, stub)
        with RolloutPool(1, config=config, worker_cpus=0.1, episodes_per_worker=n) as pool:
            together = pool.run(tasks, spec, return_trajectories=True)
            in_flight = stub.max_in_flight
            again = pool.run(tasks[:2], spec)  # the same ids again: stored once
        stub.max_in_flight = 0
        with RolloutPool(1, config=config, worker_cpus=0.1) as pool:  # today's worker, one at a time
            one_by_one = pool.run(tasks, EpisodeSpec(run="sync", phase="eval-00", mode="none", agent="react"))
    assert in_flight == n and stub.max_in_flight == 1
    assert [o.error for o in together] == [None] * len(tasks) and [o.attempts for o in together] == [1] * len(tasks)
    outcomes = {o.task.id: o.success for o in together}
    assert outcomes == {o.task.id: o.success for o in one_by_one} and 0 < sum(outcomes.values()) < len(tasks)
    assert {o.stored for o in together} <= {"added", "pending"} and [o.stored for o in again] == ["duplicate"] * 2
    assert all(o.summary["ack_s"] >= 0 and o.summary["steps"] == 2 for o in together)
    assert memory.stats()["trajectories"] == len(tasks)
    stored = {t.id for t in memory.retrieve(tasks[0].instruction, "sql", len(tasks)).trajectories}
    assert stored == {o.summary["id"] for o in together}


def test_a_failing_episode_does_not_take_the_others_down(deployment, tmp_path):
    """Among concurrent episodes: one whose environment raises (replaced, retried in the
    worker), one the environment rejects (reported, not retried), and one that kills the
    worker process (every episode it ran is retried on a fresh worker). The others finish,
    and the memory holds each stored trajectory once."""
    from lifemem_ray.actors.rollout.workers import EpisodeSpec, RolloutPool

    memory, _ = deployment(shards=2)
    tasks = _sql_tasks(8)
    bad = Task(tasks[0].env, "sql-unknown", tasks[0].instruction, tasks[0].split, {}, tasks[0].metadata)
    env_options = {
        "sql": {
            "adapter": "faulty",
            "inner": "sql",
            "marker_dir": str(tmp_path),
            "fail_on": [tasks[2].id],
            "crash_on": [tasks[6].id],
        }
    }
    spec = EpisodeSpec(
        run="faults", phase="learn-00", mode="none", agent="gold", namespace=memory.namespace, write=True
    )
    with RolloutPool(
        1, env_options=env_options, config=memory.config, worker_cpus=0.1, episodes_per_worker=4, max_attempts=3
    ) as pool:
        outcomes = pool.run([*tasks[:4], bad, *tasks[4:]], spec)
        replaced = pool.replaced
    by_id = {o.task.id: o for o in outcomes}
    rejected = by_id["sql-unknown"]  # not retried for its own error (a crash of its worker may cost it an attempt)
    assert (rejected.error or "").startswith("TaskError") and rejected.attempts <= 2
    good = [by_id[t.id] for t in tasks]
    assert [o.error for o in good] == [None] * len(tasks) and all(o.success for o in good)
    failed_once = by_id[tasks[2].id]  # its environment replaced, unless the crash took its worker first
    assert failed_once.summary["env_restarts"] >= 1 or failed_once.attempts == 2
    assert by_id[tasks[6].id].attempts == 2 and replaced == 1
    assert {o.stored for o in good} <= {"added", "pending", "duplicate"}
    assert memory.stats()["trajectories"] == len(tasks)
