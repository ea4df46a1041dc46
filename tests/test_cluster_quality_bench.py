"""benchmarks/cluster_quality.py on a small generated set: one fold's evaluation end to end
(the engine, every baseline and diagnostic), checked for its mechanics, never its figures."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from conftest import unit
from lifemem_ray.config import MemoryConfig
from lifemem_ray.model import Outcome, Step, Trajectory

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import cluster_quality  # noqa: E402

FLOWS = {
    "count": ["```sql\nSELECT COUNT(*) FROM t WHERE a = 1\n```", "Final Answer: [(3,)]"],
    "insert": ["```sql\nINSERT INTO t (a) VALUES (1)\n```", "Final Answer: []"],
    "join": ["```sql\nSELECT x.a FROM x JOIN y ON x.id = y.id\n```", "Final Answer: [('a',)]"],
}


def labelled(n: int) -> list[Trajectory]:
    out = []
    for i in range(n):
        kind = list(FLOWS)[i % 3]
        out.append(Trajectory(env="sql", task=f"question {i} about table t{i % 5}", id=f"{kind}-{i}",
                              steps=tuple(Step(action=a) for a in FLOWS[kind]), outcome=Outcome(success=True),
                              metadata={"labels": {"task_type": kind}}))
    return out


def test_one_fold_evaluates_with_verdicts_gap_and_diagnostics(tmp_path):
    trajs = labelled(60)
    rng = np.random.default_rng(0)
    goal = unit(np.random.default_rng(9).standard_normal(384) + rng.standard_normal((60, 384)))
    action = unit(rng.standard_normal((60, 384)))
    res = cluster_quality.evaluate_fold(trajs, goal, action, MemoryConfig(), tmp_path, with_skills=True)
    verdict = res["verdicts"]["sql"]
    assert set(verdict) >= {"beats", "best_baseline", "lifemem_worse_order", "batch_combinations_beating", "pure_nmi_at_k"}
    assert set(verdict["batch_combinations_beating"]) <= set(cluster_quality.VIEW_COMBINATIONS)
    gap = np.mean([verdict["lifemem_worse_order"][m] - verdict["best_baseline"][m] for m in ("purity", "nmi")])
    assert abs(res["mean_gap_to_best"] - round(float(gap), 4)) < 1e-9
    assert set(res["baselines_at_similarity_k"]) == set(cluster_quality.BASELINES) | {"workflow+action", "goal+action", "all_three_views"}
    assert res["held_out"] == 6 and res["skills"]  # every 10th held out, its retrieved cluster's skill scored
    report = {"folds": {"report": {"full": res}}}
    text = cluster_quality.table(report)
    assert "mean gap to it" in text and "perfectly pure partition" in text and "sql" in text
