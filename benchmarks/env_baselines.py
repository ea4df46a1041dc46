"""Gold, random and offline-agent success of environments, on their train and test splits.

What an environment can show depends on the gap between its gold path (does it solve every
task?), a random agent (how often does chance succeed?) and the offline agents with a memory
(does experience help at all without an LLM?). For each environment named:

* ``gold`` and ``random`` on every task of both splits (no memory);
* a memory (:class:`~lifemem_ray.engine.memory.Memory`, offline policy, in a temporary
  folder) filled with the ``noisy-gold`` agent's episodes of the train split (successes and
  failures, as a data-collection run leaves them);
* ``exemplar`` and ``skill-guided`` on both splits with that memory (k = 4 from the same
  environment; on a train task its own stored episode is left out of what it retrieves, and
  so are the skills of clusters only that episode brought in).

Per agent and split: episodes, success rate, mean reward, and the environment's own scores
where its ``info`` has them (Mind2Web's element accuracy and operation F1). Seeds fix every
order; ``--seeds`` repeats the agents' randomness and reports the spread.

Prints JSON, then a table. Usage:
    python benchmarks/env_baselines.py [--envs fever webshop mind2web] [--limit 200] [--seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from lifemem_ray.engine.memory import Memory
from lifemem_ray.engine.retrieval import Retrieval
from lifemem_ray.lab.agents import make_agent
from lifemem_ray.lab.envs import Environment, EnvUnavailable, Task, make_env
from lifemem_ray.lab.episode import EpisodeLimits, run_episode

SCORES = ("element_correct", "operation_f1")  # per-step scores an environment may report in info


class LastInfo:
    """``env`` as the episode loop sees it, keeping the last step's info (where an environment
    reports scores of its own, as Mind2Web's element accuracy and operation F1)."""

    def __init__(self, env: Environment) -> None:
        self.env, self.info = env, {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.env, name)

    def step(self, action: str) -> Any:
        result = self.env.step(action)
        self.info = result.info
        return result


def play(env: Environment, agent_name: str, tasks: list[Task], seed: int, memory: Memory | None) -> dict[str, Any]:
    """Every task once with a fresh agent; success, reward and the environment's own scores."""
    rows, finals = [], []
    recorder: Any = LastInfo(env)
    for task in tasks:
        agent = make_agent(agent_name, seed=seed)
        retrieve = None
        if memory is not None:

            def retrieve(t: Task, memory: Memory = memory) -> Retrieval:
                found = memory.retrieve(t.instruction, env=t.env, k=5)
                kept = [h for h in found.trajectories if h.trajectory.metadata.get("task_id") != t.id][:4]
                clusters = {h.cluster_id for h in kept}  # the skills of the clusters still shown
                return dataclasses.replace(
                    found, trajectories=kept, skills=[s for s in found.skills if s.cluster_id in clusters]
                )

        recorder.info = {}
        result = run_episode(
            recorder,
            agent,
            task,
            retrieve=retrieve,
            trajectory_id=f"{agent_name}-{seed}-{task.id}",
            limits=EpisodeLimits(),
        )
        rows.append({"success": result.success, "reward": result.reward, **{s: recorder.info.get(s) for s in SCORES}})
        finals.append((task, recorder.info))
    out: dict[str, Any] = {
        "episodes": len(rows),
        "success": sum(r["success"] for r in rows) / max(1, len(rows)),
        "reward": sum(r["reward"] for r in rows) / max(1, len(rows)),
    }
    for score in SCORES:
        values = [float(r[score]) for r in rows if r[score] is not None]
        if values:
            out[score] = sum(values) / len(values)
    if env.name == "mind2web":  # Mind2Web's task success: every step of a recorded task right
        from lifemem_ray.lab.envs.mind2web.env import summarise

        task_sr = summarise(finals)["task_sr"]
        if task_sr is not None:
            out["task_success"] = task_sr
    return out


def fill_memory(env: Environment, tasks: list[Task], folder: Path) -> tuple[Memory, int]:
    """A memory of the noisy-gold agent's train episodes; the memory and how many succeeded."""
    memory = Memory.open(folder)
    agent_name, succeeded = "noisy-gold", 0
    trajectories = []
    for task in tasks:
        result = run_episode(env, make_agent(agent_name, seed=0), task, trajectory_id=f"seed-{task.id}")
        succeeded += result.success
        trajectories.append(result.trajectory)
    memory.add_many(trajectories)
    return memory, succeeded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--envs", nargs="+", default=["fever", "webshop", "mind2web"])
    parser.add_argument("--limit", type=int, default=200, help="tasks per split (the first, in the split's order)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    if not (1 <= args.limit <= 5000 and 1 <= len(args.seeds) <= 10):
        sys.exit("--limit 1..5000, at most 10 --seeds")

    report: dict[str, Any] = {"limit": args.limit, "seeds": args.seeds, "envs": {}}
    for name in args.envs:
        try:
            env = make_env(name)
        except EnvUnavailable as exc:
            report["envs"][name] = {"unavailable": str(exc)}
            continue
        with env, tempfile.TemporaryDirectory(prefix=f"lifemem-baselines-{name}-") as folder:
            splits = {split: env.tasks(split, limit=args.limit) for split in ("train", "test")}
            memory, seeded = fill_memory(env, splits["train"], Path(folder))
            rows: dict[str, Any] = {"memory": {"train_episodes": len(splits["train"]), "succeeded": seeded}}
            for agent_name, with_memory in (
                ("gold", False),
                ("random", False),
                ("exemplar", True),
                ("skill-guided", True),
            ):
                seeds = args.seeds[:1] if agent_name == "gold" else args.seeds  # gold has no randomness
                for split, tasks in splits.items():
                    runs = [play(env, agent_name, tasks, seed, memory if with_memory else None) for seed in seeds]
                    row = {"episodes": runs[0]["episodes"]}
                    for key in runs[0]:
                        if key == "episodes":
                            continue
                        values = [run[key] for run in runs]
                        row[key] = statistics.mean(values)
                        row[key + "_range"] = [min(values), max(values)]
                    rows[f"{agent_name}/{split}"] = row
            memory.close()
        report["envs"][name] = rows
    print(json.dumps(report, indent=2))
    print(
        f"\n{'env':<10}{'agent':<14}{'split':<7}{'n':>5}{'success':>9}{'range':>14}{'reward':>8}{'elem':>7}{'op F1':>7}{'task':>7}"
    )
    for name, rows in report["envs"].items():
        if "unavailable" in rows:
            print(f"{name:<10}unavailable: {rows['unavailable'][:80]}")
            continue
        for key, row in rows.items():
            if key == "memory":
                continue
            agent_name, split = key.split("/")
            low, high = row["success_range"]
            print(
                f"{name:<10}{agent_name:<14}{split:<7}{row['episodes']:>5}{row['success']:>9.3f}"
                f"{f'{low:.3f}-{high:.3f}':>14}{row['reward']:>8.3f}"
                f"{row.get('element_correct', float('nan')):>7.3f}{row.get('operation_f1', float('nan')):>7.3f}"
                f"{row.get('task_success', float('nan')):>7.3f}"
            )


if __name__ == "__main__":
    main()
