"""What the memory costs an episode under each adapter, from the adapters' own counters.

Episodes of one fast environment (gold actions, so the episode itself is as cheap as it gets
and the memory's share is as large as it gets; each path and repeat plays tasks of its own,
though tasks may share a text) run six ways against one 2-shard deployment seeded with earlier
episodes of that environment (it grows as the paths write):

* ``env``: the environment alone (the baseline of ``wrapper``);
* ``wrapper``: :class:`~lifemem_ray.episodes.memory_wrapper.MemoryWrapper` around it: recall at
  ``reset``, submit at the end, one shared :class:`EpisodeMemory` (one background writer);
* ``async-loop``: the memory calls verl's ``MemoryAgentLoop`` makes per row, around the same
  episodes: the recall awaited, the write handed to a task (``AsyncEpisodeMemory`` over
  ``AsyncMemoryClient``; the row never awaits the acknowledgement). verl itself is not in
  this benchmark: ``tests/actors/integrations/test_verl_loop.py`` runs the loop in verl's machinery;
* ``skyrl-lab``: SkyRL's pattern without memory: ``skyrl_gym.make("lifemem-lab")`` per
  episode, ``init``, ``step`` until done, ``close`` (the baseline of ``skyrl-memory``);
* ``skyrl-memory``: the same through ``lifemem-memory`` (``MemoryTextEnv``), whose ``close``
  waits (bounded) for the acknowledgement of the episode's write before SkyRL's generator
  moves on (``settle_timeout_s``, 10 s);
* ``skyrl-nowait``: the same with ``settle_timeout_s = 0``: ``close`` hands the write over and
  returns; the write finishes on its background thread (the process waits for it at exit).

For each: episodes/s, the episode's wall time (p50), the memory's time on the episode's path
per episode as the adapter counts it (recall; hand-over of the write; for SkyRL also the
settle in ``close``), and that time's share of the episode. With an LLM policy an episode
takes seconds (its generations), so the share is far smaller there: the absolute
milliseconds are the figure to carry over. Repeats give the spread. A task text seen before is
served from the client's vector cache; the report says how many distinct texts the measured
episodes had (TextWorldExpress coin has one; ``--env sql`` has a new one each episode).

Prints JSON, then a table. Usage:
    python benchmarks/episode_memory_cost.py [--env twx-coin] [--episodes 60] [--seed-episodes 60] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from lifemem_ray.actors.client.awaiting import AsyncMemoryClient
from lifemem_ray.actors.client.blocking import MemoryClient
from lifemem_ray.actors.cluster import deployment as dep
from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.actors.cluster.ray_address import private_ray
from lifemem_ray.episodes.episode_memory import AsyncEpisodeMemory, EpisodeMemory, EpisodeRecord
from lifemem_ray.episodes.memory_wrapper import MemoryWrapper
from lifemem_ray.lab.envs import Environment, Task, make_env

ACTORS = {"cluster.shard_cpus": 0.25, "cluster.coordinator_cpus": 0.25, "cluster.embedder_cpus": 0.25}
NAMESPACE = "bench-episode-cost"
PATHS = ("env", "wrapper", "async-loop", "skyrl-lab", "skyrl-memory", "skyrl-nowait")


def gold_episode(env: Any, task: Task, actions: list[str]) -> None:
    """One episode through the project's environment protocol (``env`` may be wrapped)."""
    env.reset(task)
    for action in actions:
        if env.step(action).done:
            return


def run_env(env: Environment, tasks: list[Task], actions: dict[str, list[str]], memory: Any) -> dict[str, Any]:
    """The episodes on ``env`` alone (``memory`` None) or in a MemoryWrapper; per-episode times."""
    episodes = None if memory is None else EpisodeMemory(memory, k=4)
    target: Any = env if episodes is None else MemoryWrapper(env, episodes, env_name=env.name)
    walls = []
    for task in tasks:
        started = time.perf_counter()
        gold_episode(target, task, actions[task.id])
        walls.append(time.perf_counter() - started)
    settle_s = 0.0
    if episodes is not None:
        started = time.perf_counter()
        episodes.settle(120)
        settle_s = time.perf_counter() - started
    counts = episodes.counts.as_dict() if episodes is not None else {}
    return {"walls": walls, "counts": counts, "settle_s": settle_s}


def run_async(env: Environment, tasks: list[Task], actions: dict[str, list[str]]) -> dict[str, Any]:
    """The memory calls verl's ``MemoryAgentLoop`` makes per row (await the recall, hand the
    write to a task, never await the acknowledgement on the row's path) around each episode,
    one at a time on one event loop, over ``AsyncMemoryClient``."""

    async def episodes() -> dict[str, Any]:
        client = await AsyncMemoryClient.connect(NAMESPACE)
        memory = AsyncEpisodeMemory(client, k=4)
        walls = []
        for task in tasks:
            started = time.perf_counter()
            await memory.recall(task.instruction, env.name)
            observation, _ = env.reset(task)
            record = EpisodeRecord(env.name, task.instruction, str(observation))
            result = None
            for action in actions[task.id]:
                result = env.step(action)
                record.step(action, result.observation, result.reward)
                if result.done:
                    break
            success = None if result is None else result.info.get("success")
            await memory.submit(record.trajectory(success))
            walls.append(time.perf_counter() - started)
        settle_started = time.perf_counter()
        await memory.settle(120)
        return {"walls": walls, "counts": memory.counts.as_dict(), "settle_s": time.perf_counter() - settle_started}

    return asyncio.run(episodes())


def run_skyrl(
    inner: dict[str, Any], tasks: list[Task], actions: dict[str, list[str]], memory: bool, settle_s: float = 10.0
) -> dict[str, Any]:
    """The episodes as SkyRL's generator runs them: make, init, step until done, metrics, close."""
    import skyrl_gym

    walls, recall, submit, settle, failures, submitted = [], [], [], [], 0, 0
    for task in tasks:
        started = time.perf_counter()
        if memory:
            config = {
                "inner": "lifemem-lab",
                "inner_config": inner,
                "memory": {"namespace": NAMESPACE, "k": 4},
                "settle_timeout_s": settle_s,
            }
            env = skyrl_gym.make("lifemem-memory", env_config=config, extras={"task_id": task.id})
        else:
            env = skyrl_gym.make("lifemem-lab", env_config=inner, extras={"task_id": task.id})
        env.init([])
        for action in actions[task.id]:
            if env.step(action)["done"]:
                break
        metrics = env.get_metrics()
        env.close()
        walls.append(time.perf_counter() - started)
        if memory:
            recall.append(metrics["memory_recall_s"])
            submit.append(metrics["memory_submit_s"])
            settle.append(env.timings["settle_s"])
            failures += metrics["memory_recall_failures"] + metrics["memory_submit_failures"]
            submitted += metrics["memory_submitted"]
    return {
        "walls": walls,
        "recall": recall,
        "submit": submit,
        "settle": settle,
        "failures": failures,
        "submitted": submitted,
    }


def submitted_by(run: dict[str, Any]) -> int:
    """How many writes a path's run handed over, from the adapter's own counts."""
    return int(run["counts"].get("submitted", 0)) if "counts" in run else int(run.get("submitted", 0))


def summarise(path: str, runs: list[dict[str, Any]], baseline: list[dict[str, Any]] | None) -> dict[str, Any]:
    """Per repeat: rate, p50 and the memory's ms per episode; the median and range over repeats."""

    def per_repeat(run: dict[str, Any]) -> dict[str, float]:
        n = len(run["walls"])
        if "counts" in run:
            counts = run["counts"]
            memory = {"recall": counts.get("recall_s", 0.0) / n, "submit": counts.get("submit_s", 0.0) / n}
            memory["settle"] = 0.0  # the wrapper's writes settle off the episodes' path (once, at the end)
        else:
            memory = {key: sum(run[key]) / n if run[key] else 0.0 for key in ("recall", "submit", "settle")}
        wall = sum(run["walls"]) / n
        on_path = memory["recall"] + memory["submit"] + memory["settle"]
        return {
            "episodes_per_s": n / sum(run["walls"]),
            "episode_p50_ms": 1000 * statistics.median(run["walls"]),
            "recall_ms": 1000 * memory["recall"],
            "submit_ms": 1000 * memory["submit"],
            "settle_ms": 1000 * memory["settle"],
            "memory_share": on_path / wall if wall else 0.0,
        }

    rows = [per_repeat(run) for run in runs]
    out: dict[str, Any] = {"path": path, "repeats": len(rows)}
    for key in rows[0]:
        values = [row[key] for row in rows]
        out[key] = statistics.median(values)
        out[key + "_range"] = [min(values), max(values)]
    if baseline is not None:
        ratios = [
            per_repeat(run)["episodes_per_s"] / per_repeat(base)["episodes_per_s"]
            for run, base in zip(runs, baseline, strict=True)
        ]
        out["rate_vs_no_memory"] = statistics.median(ratios)
        out["rate_vs_no_memory_range"] = [min(ratios), max(ratios)]
    out["failures"] = sum(run.get("failures", 0) for run in runs) + sum(
        run.get("counts", {}).get("recall_failures", 0) + run.get("counts", {}).get("submit_failures", 0)
        for run in runs
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--env", default="twx-coin")
    parser.add_argument("--episodes", type=int, default=60, help="episodes measured per path and repeat")
    parser.add_argument("--seed-episodes", type=int, default=60, help="episodes stored before measuring")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-wait-ms", type=float, default=None, help="the deployment's cluster.batch_wait_ms")
    args = parser.parse_args()
    if not (1 <= args.episodes <= 2000 and 0 <= args.seed_episodes <= 5000 and 1 <= args.repeats <= 10):
        sys.exit("--episodes 1..2000, --seed-episodes 0..5000, --repeats 1..10")

    total = args.seed_episodes + args.episodes * args.repeats * len(PATHS)
    inner = {"env": args.env, "options": {"n_train": total, "n_test": 1}}  # LabTextEnv makes the same tasks
    env = make_env(args.env, **inner["options"])
    tasks = env.tasks("train")[:total]
    actions = {task.id: env.gold_actions(task) or [] for task in tasks}
    seed, measured = tasks[: args.seed_episodes], tasks[args.seed_episodes :]
    import skyrl_gym  # noqa: F401  (fails early when the rl extra is not installed)

    from lifemem_ray.actors.integrations.skyrl_env import register_skyrl_envs

    register_skyrl_envs()
    private_ray(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    settings: dict[str, Any] = {**ACTORS, "cluster.namespace": NAMESPACE}
    if args.batch_wait_ms is not None:
        settings["cluster.batch_wait_ms"] = args.batch_wait_ms
    config = DeploymentConfig().replace(settings)
    dep.deploy(Path(tempfile.mkdtemp(prefix="lifemem-episode-cost-")), config, shards=2)
    client = MemoryClient(NAMESPACE, config)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in PATHS}
    paths: dict[str, Callable[[list[Task]], dict[str, Any]]] = {
        "env": lambda batch: run_env(env, batch, actions, None),
        "wrapper": lambda batch: run_env(env, batch, actions, client),
        "async-loop": lambda batch: run_async(env, batch, actions),
        "skyrl-lab": lambda batch: run_skyrl(inner, batch, actions, memory=False),
        "skyrl-memory": lambda batch: run_skyrl(inner, batch, actions, memory=True),
        "skyrl-nowait": lambda batch: run_skyrl(inner, batch, actions, memory=True, settle_s=0.0),
    }
    try:
        # The memory holds earlier episodes of this environment; then warm the JVM, the model, the clients.
        warm = [run_env(env, seed, actions, client), *(path(seed[:3] or measured[:3]) for path in paths.values())]
        for repeat in range(args.repeats):
            for n, (name, path) in enumerate(paths.items()):  # interleaved, so a slow moment hits every path
                first = (repeat * len(paths) + n) * args.episodes  # tasks of their own (texts may still repeat)
                runs[name].append(path(measured[first : first + args.episodes]))
        # Every write handed over must land, the ones closed without waiting included.
        submitted = sum(submitted_by(run) for run in [*warm, *(r for rs in runs.values() for r in rs)])
        stored, deadline = client.stats()["trajectories"], time.monotonic() + 120
        while stored < submitted and time.monotonic() < deadline:
            time.sleep(0.5)
            stored = client.stats()["trajectories"]
    finally:
        dep.stop(NAMESPACE)
        env.close()
        ray.shutdown()

    rows = [
        summarise("env", runs["env"], None),
        summarise("wrapper", runs["wrapper"], runs["env"]),
        summarise("async-loop", runs["async-loop"], runs["env"]),
        summarise("skyrl-lab", runs["skyrl-lab"], None),
        summarise("skyrl-memory", runs["skyrl-memory"], runs["skyrl-lab"]),
        summarise("skyrl-nowait", runs["skyrl-nowait"], runs["skyrl-lab"]),
    ]
    report = {
        "env": args.env,
        "episodes": args.episodes,
        "seed_episodes": args.seed_episodes,
        "batch_wait_ms": config.cluster.batch_wait_ms,
        "distinct_task_texts": len({task.instruction for task in measured}),  # a text seen before is cached
        "submitted": submitted,
        "stored": stored,
        "rows": rows,
    }
    print(json.dumps(report, indent=2))
    print(
        f"\nwrites submitted {submitted}, stored {stored} (cluster.batch_wait_ms {config.cluster.batch_wait_ms:g}); "
        f"{report['distinct_task_texts']} distinct task texts in {len(measured)} measured episodes"
    )
    print(
        f"{'path':<14}{'ep/s':>8}{'p50 ms':>9}{'recall ms':>11}{'submit ms':>11}"
        f"{'settle ms':>11}{'share':>8}{'vs none':>9}"
    )
    for row in rows:
        ratio = f"{row['rate_vs_no_memory']:.2f}" if "rate_vs_no_memory" in row else "-"
        print(
            f"{row['path']:<14}{row['episodes_per_s']:>8.1f}{row['episode_p50_ms']:>9.1f}{row['recall_ms']:>11.2f}"
            f"{row['submit_ms']:>11.2f}{row['settle_ms']:>11.2f}{row['memory_share']:>8.2f}{ratio:>9}"
        )


if __name__ == "__main__":
    main()
