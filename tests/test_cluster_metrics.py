"""Partition scores, equal-k baselines and sequence distances on cases worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest

from lifemem_ray.cluster_metrics import equal_k_baseline, partition_scores, purity, sequence_distance


def test_purity_counts_each_clusters_majority():
    clusters = np.array([0, 0, 0, 1, 1, 2])
    labels = np.array(["a", "a", "b", "b", "b", "c"])
    assert purity(clusters, labels) == pytest.approx(5 / 6)
    assert purity(np.zeros(4, int), np.array(list("aabb"))) == 0.5
    assert purity(np.arange(4), np.array(list("aabb"))) == 1.0  # singletons are always pure


def test_scores_of_a_perfect_and_of_a_useless_partition():
    labels = np.array(list("aaabbbccc"))
    perfect = partition_scores(np.array([5, 5, 5, 1, 1, 1, 9, 9, 9]), labels)
    assert perfect == {"purity": 1.0, "nmi": pytest.approx(1.0), "ari": pytest.approx(1.0)}
    one = partition_scores(np.zeros(9, int), labels)
    assert one["purity"] == pytest.approx(1 / 3) and one["nmi"] == pytest.approx(0.0) and one["ari"] == pytest.approx(0.0)


def test_scores_reject_mismatched_inputs():
    with pytest.raises(ValueError, match="one length"):
        partition_scores(np.zeros(3), np.zeros(4))


def test_equal_k_baseline_finds_separated_groups_with_the_asked_k():
    rng = np.random.default_rng(0)
    centres = np.eye(8)[:3]
    x = np.vstack([c + 0.05 * rng.standard_normal((20, 8)) for c in centres])
    labels = equal_k_baseline(x, 3, seed=1)
    assert len(set(labels.tolist())) == 3
    assert purity(labels, np.repeat([0, 1, 2], 20)) == 1.0
    assert len(set(equal_k_baseline(x, 100).tolist())) == 60  # k is capped at n
    assert set(equal_k_baseline(x, 1).tolist()) == {0}
    with pytest.raises(ValueError, match="k"):
        equal_k_baseline(x, 0)


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [("", "", 0.0), ("abc", "abc", 0.0), ("abc", "", 1.0), ("kitten", "sitting", 3 / 7), ("ab", "ba", 1.0)],
)
def test_sequence_distance(a, b, expected):
    assert sequence_distance(list(a), list(b)) == pytest.approx(expected)


def test_pure_partition_nmi_rewards_uneven_parts_and_checks_k():
    from lifemem_ray.cluster_metrics import pure_partition_nmi

    labels = ["a"] * 20 + ["b"] * 20 + ["c"] * 4
    exact = pure_partition_nmi(labels, 3)
    assert exact["even"] == exact["splinters"] == pytest.approx(1.0)  # k = the labels: the labels themselves
    r = pure_partition_nmi(labels, 6)
    assert r["even"] < r["splinters"] < 1.0
    with pytest.raises(ValueError, match="k: must be within"):
        pure_partition_nmi(labels, 2)
