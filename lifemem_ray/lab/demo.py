"""``lifemem-ray demo``: a memory built from the sample shipped with the package.

The sample (``data/demo.jsonl``) comes from :mod:`lifemem_ray.lab.synthetic` and
covers six environments; one task per environment is held out and used as a
retrieval query, so the demo shows the whole loop: ingest, clusters, skills,
retrieval.
"""

from __future__ import annotations

import textwrap
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

from lifemem_ray.core.ids import id_label
from lifemem_ray.core.importers import iter_jsonl, write_jsonl
from lifemem_ray.engine.memory import Memory
from lifemem_ray.engine.memory_config import MemoryConfig
from lifemem_ray.lab.synthetic import generate

__all__ = ["DEMO_ENVS", "demo_path", "run_demo", "write_demo_set"]

DEMO_ENVS = ["household", "shop", "wiki_qa", "sql", "retail", "data_qa"]
DEMO_SIZE = 96


def demo_path() -> Path:
    return Path(str(resources.files("lifemem_ray.lab") / "data" / "demo.jsonl"))


def write_demo_set(path: Path) -> int:
    """Regenerate the shipped sample (deterministic)."""
    return write_jsonl(generate(DEMO_SIZE, seed=7, envs=DEMO_ENVS, length_scale=0.3, id_prefix="demo"), path)


def run_demo(store: Path, config: MemoryConfig, progress: Callable[[int], Any] | None = None) -> dict[str, Any]:
    trajectories = list(iter_jsonl(demo_path()))
    held_out: dict[str, Any] = {}
    train = []
    for traj in trajectories:
        if traj.env not in held_out:
            held_out[traj.env] = traj
        else:
            train.append(traj)
    started = time.perf_counter()
    with Memory.open(store, config) as memory:
        bar = progress(len(train)) if progress else None
        memory.add_many(train, progress=bar.update if bar else None)
        if bar:
            bar.close()
        elapsed = time.perf_counter() - started
        query = held_out["shop"]
        result = memory.retrieve(query.task, query.env)
        per_env = {env: memory.clusters(env) for env in DEMO_ENVS}
        stats = memory.stats()

    evolution = config.evolution
    lines = [
        f"LifeMem demo: {len(train)} trajectories from {len(DEMO_ENVS)} environments into {store} ({elapsed:.1f} s)",
        f"{stats['clusters']} workflow clusters; {stats['splits']} splits; decisions by the offline policy",
        "Each cluster: its id, its trajectories (n), its cohesion R (the mean resultant length of its",
        "members' unit task vectors, 0-1: 1 = all alike; a cluster of more than "
        f"L = {evolution.split_min_size} with R below tau = {evolution.split_mrl_threshold:g} is split),",
        "then its description (what its trajectories did and how they ended) and its skill.",
        "",
    ]
    for env, clusters in per_env.items():
        lines.append(f"== {env}: {sum(c.envs.get(env, 0) for c in clusters)} trajectories in {len(clusters)} clusters")
        for c in clusters:
            lines.append(f"  cluster {id_label(c.id)}: n = {c.count}, cohesion R = {c.mrl:.2f}")
            lines.append(f"    description | {c.description}")
            if c.skill:
                lines.append(textwrap.indent(c.skill, "    skill       | "))
    lines += ["", f"== retrieve for a held-out {query.env} task: {query.task.strip()}", "  similarity  cluster  task"]
    for hit in result.trajectories:
        lines.append(f"  {hit.score:10.3f}  {id_label(hit.cluster_id):>7}  {hit.task.strip()[:80]}")
    for skill in result.skills:
        lines.append(f"  skill of cluster {id_label(skill.cluster_id)}:")
        lines.append(textwrap.indent(skill.text, "      "))
    return {
        "store": str(store),
        "trajectories": stats["trajectories"],
        "clusters": stats["clusters"],
        "per_env": stats["per_env"],
        "clusters_by_env": {env: [c.to_dict() for c in cs] for env, cs in per_env.items()},
        "query": {"task": query.task, "env": query.env},
        "retrieval": result.to_dict(),
        "seconds": round(elapsed, 2),
        "text": "\n".join(lines),
    }
