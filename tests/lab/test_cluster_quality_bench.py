"""benchmarks/cluster_quality.py on a small generated set: one fold's evaluation end to end
(the engine, every baseline and diagnostic), checked for its mechanics, never its figures."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from support.common import unit

from lifemem_ray.core.model import Outcome, Step, Trajectory
from lifemem_ray.engine.memory_config import MemoryConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import cluster_quality

FLOWS = {
    "count": ["```sql\nSELECT COUNT(*) FROM t WHERE a = 1\n```", "Final Answer: [(3,)]"],
    "insert": ["```sql\nINSERT INTO t (a) VALUES (1)\n```", "Final Answer: []"],
    "join": ["```sql\nSELECT x.a FROM x JOIN y ON x.id = y.id\n```", "Final Answer: [('a',)]"],
}


def labelled(n: int) -> list[Trajectory]:
    out = []
    for i in range(n):
        kind = list(FLOWS)[i % 3]
        out.append(
            Trajectory(
                env="sql",
                task=f"question {i} about table t{i % 5}",
                id=f"{kind}-{i}",
                steps=tuple(Step(action=a) for a in FLOWS[kind]),
                outcome=Outcome(success=True),
                metadata={"labels": {"task_type": kind}},
            )
        )
    return out


def test_one_fold_evaluates_with_verdicts_gap_and_diagnostics(tmp_path):
    trajs = labelled(60)
    rng = np.random.default_rng(0)
    goal = unit(np.random.default_rng(9).standard_normal(384) + rng.standard_normal((60, 384)))
    action = unit(rng.standard_normal((60, 384)))
    res = cluster_quality.evaluate_fold(trajs, goal, action, MemoryConfig(), tmp_path, with_skills=True)
    verdict = res["verdicts"]["sql"]
    assert set(verdict) >= {
        "beats",
        "best_baseline",
        "lifemem_worse_order",
        "batch_combinations_beating",
        "pure_nmi_at_k",
        "baseline_at_ceiling",
        "beats_or_ties_at_ceiling",
    }
    assert res["distinct_workflows"]["sql"]["distinct"] == 3  # the three statement kinds, whatever the goal
    assert 0 < res["distinct_workflows"]["sql"]["cosine_between"]["max"] < 1
    assert set(verdict["batch_combinations_beating"]) <= set(cluster_quality.VIEW_COMBINATIONS)
    gap = np.mean([verdict["lifemem_worse_order"][m] - verdict["best_baseline"][m] for m in ("purity", "nmi")])
    assert abs(res["mean_gap_to_best"] - round(float(gap), 4)) < 1e-9
    assert set(res["baselines_at_similarity_k"]) == set(cluster_quality.BASELINES) | {
        "workflow+action",
        "goal+action",
        "all_three_views",
    }
    assert res["held_out"] == 6 and res["skills"]  # every 10th held out, its retrieved cluster's skill scored
    report = {"folds": {"report": {"full": res}}, "ablation": {"a variant": res}}
    text = cluster_quality.table(report)
    row = next(line for line in text.splitlines() if line.startswith("a variant"))
    assert f"{res['mean_gap_to_best']:+.3f}" in row  # the ablation rows carry the verdict's figures
    assert "mean gap to it" in text and "perfectly pure partition" in text and "sql" in text
    interval = res["gap_intervals"]["sql"]
    assert verdict["bootstrap"] == interval["verdict"] in ("above", "below", "within noise")
    for m in ("purity", "nmi"):  # the interval is around the verdict's own gap
        assert interval[m]["gap"] == round(verdict["lifemem_worse_order"][m] - verdict["best_baseline"][m], 4)
        assert interval[m]["low"] <= interval[m]["gap"] + 1e-4 and interval[m]["gap"] - 1e-4 <= interval[m]["high"]
    assert "bootstrap over trajectories" in text
    # The unsupervised view choice: every named view scored by silhouette, the best one named.
    assert set(res["view_by_silhouette"]["sql"]) == set(cluster_quality.NAMED_BASELINES)
    assert verdict["view_by_silhouette"] == max(res["view_by_silhouette"]["sql"].items(), key=lambda kv: kv[1])[0]
    assert verdict["best_view_by_labels"] in cluster_quality.NAMED_BASELINES and "best silhouette" in text
    refined = res["refined_in_picked_view"]["sql"]
    assert refined["view"] == verdict["view_by_silhouette"] and 0 < refined["purity"] <= 1 and 0 <= refined["nmi"] <= 1
    assert verdict["refined_beats"] == all(refined[m] > verdict["best_baseline"][m] for m in ("purity", "nmi"))
    assert "refined by k-means" in text


def test_gap_intervals_tell_a_real_gap_from_noise():
    trajs = labelled(90)
    perfect = [t.metadata["labels"]["task_type"] for t in trajs]
    rng = np.random.default_rng(0)
    shuffled = [[str(x) for x in rng.permutation(perfect)] for _ in range(5)]
    above = cluster_quality.gap_intervals(trajs, [perfect, perfect], {"view": shuffled})["sql"]
    assert above["verdict"] == "above" and above["purity"]["low"] > 0 and above["nmi"]["low"] > 0
    below = cluster_quality.gap_intervals(trajs, [shuffled[0]], {"view": [perfect] * 5})["sql"]
    assert below["verdict"] == "below" and below["nmi"]["high"] < 0
    same = cluster_quality.gap_intervals(trajs, [perfect], {"view": [perfect]})["sql"]
    assert same["verdict"] == "within noise" and same["purity"] == {"gap": 0.0, "low": 0.0, "high": 0.0}
    # The worse of the similarity order and the random orders' mean counts: one bad order is enough.
    mixed = cluster_quality.gap_intervals(trajs, [perfect, shuffled[1], shuffled[2]], {"view": [perfect]})["sql"]
    assert mixed["verdict"] == "below"


def test_weight_sweep_scores_every_weight_and_picks_the_largest_mean_gap(tmp_path, monkeypatch):
    monkeypatch.setattr(cluster_quality, "WEIGHT_GRID", (0.2, 0.9))
    trajs = labelled(30)
    rng = np.random.default_rng(1)
    goal = unit(rng.standard_normal((30, 384)))
    action = unit(rng.standard_normal((30, 384)))
    sweep = cluster_quality.weight_sweep(trajs, goal, action, MemoryConfig(), tmp_path, with_skills=False)
    assert set(sweep["per_weight"]) == {"0.2", "0.9"}
    chosen = sweep["label_chosen"]["sql"]
    means = {w: np.mean(list(e["sql"]["gap"].values())) for w, e in sweep["per_weight"].items()}
    assert means[str(chosen["weight"])] == max(means.values())
    assert chosen["gap"] == sweep["per_weight"][str(chosen["weight"])]["sql"]["gap"]
    marked = cluster_quality.evaluate_fold(trajs, goal, action, MemoryConfig(), tmp_path, with_skills=False)
    marked["verdicts"]["sql"]["lifemem_worse_order"]["purity"] = (
        marked["verdicts"]["sql"]["best_baseline"]["purity"] + 0.123
    )
    reused = cluster_quality.weight_sweep(
        trajs,
        goal,
        action,
        MemoryConfig().replace({"policy.workflow_weight": 0.9}),
        tmp_path,
        with_skills=False,
        evaluated=marked,
    )
    assert (
        reused["per_weight"]["0.9"]["sql"]["gap"]["purity"] == 0.123
    )  # the given evaluation at the config's weight, not a rerun
    assert reused["per_weight"]["0.2"] == sweep["per_weight"]["0.2"]
    text = cluster_quality.table({"folds": {}, "weight_sweep": {"tune": {"full": sweep}}})
    assert "workflow weight picked per environment with the labels" in text and f"sql {chosen['weight']}" in text


def test_benchmark_docstring_examples_hold():
    import doctest

    result = doctest.testmod(cluster_quality, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted >= 1


def test_a_baseline_at_purity_one_can_be_tied_but_not_beaten():
    per_env = lambda purity, nmi: {"sql": {"task_type": {"purity": purity, "nmi": nmi, "labels": 3}}}  # noqa: E731
    base = {
        name: {"per_env": {"sql": {"task_type": {"purity": {"mean": 1.0}, "nmi": {"mean": 0.8}}}}}
        for name in cluster_quality.NAMED_BASELINES
    }
    random = {"sql": {"task_type": {"purity": {"mean": 1.0}, "nmi": {"mean": 0.9}}}}
    tied = cluster_quality.verdicts(
        {"similarity": {"per_env": per_env(1.0, 0.9)}, "random": {"per_env": random}, "baselines_at_similarity_k": base}
    )["sql"]
    assert tied["baseline_at_ceiling"] == ["purity"] and not tied["beats"] and tied["beats_or_ties_at_ceiling"]
    short = cluster_quality.verdicts(
        {
            "similarity": {"per_env": per_env(0.99, 0.9)},
            "random": {"per_env": random},
            "baselines_at_similarity_k": base,
        }
    )["sql"]
    assert not short["beats_or_ties_at_ceiling"]
