"""Partition scores, equal-k baselines and sequence distances on cases worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest

from lifemem_ray.lab.cluster_metrics import (
    bootstrap_weights,
    equal_k_baseline,
    partition_scores,
    purity,
    refine_partition,
    sequence_distance,
    weighted_scores,
)


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
    assert (
        one["purity"] == pytest.approx(1 / 3) and one["nmi"] == pytest.approx(0.0) and one["ari"] == pytest.approx(0.0)
    )


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
    from lifemem_ray.lab.cluster_metrics import pure_partition_nmi

    labels = ["a"] * 20 + ["b"] * 20 + ["c"] * 4
    exact = pure_partition_nmi(labels, 3)
    assert exact["even"] == exact["splinters"] == pytest.approx(1.0)  # k = the labels: the labels themselves
    r = pure_partition_nmi(labels, 6)
    assert r["even"] < r["splinters"] < 1.0
    with pytest.raises(ValueError, match="k: must be within"):
        pure_partition_nmi(labels, 2)


def test_weighted_scores_equal_the_plain_ones_with_unit_weights_and_follow_the_weights():
    rng = np.random.default_rng(3)
    for n, kc, ky in ((40, 5, 3), (200, 12, 6), (7, 1, 1), (7, 1, 3), (7, 4, 1)):
        clusters, labels = rng.integers(kc, size=n), np.array([f"l{v}" for v in rng.integers(ky, size=n)])
        got = weighted_scores(clusters, labels, np.ones((2, n)))
        want = partition_scores(clusters, labels)
        for m in ("purity", "nmi"):
            assert got[m].shape == (2,) and got[m] == pytest.approx([want[m]] * 2, abs=1e-12)
    # Weight 2 on an item is the item twice; weight 0 drops it.
    clusters, labels = np.array([0, 0, 1, 1]), np.array(list("aabb"))
    doubled = partition_scores(np.array([0, 0, 0, 1, 1]), np.array(list("aaabb")))
    assert weighted_scores(clusters, labels, np.array([[2.0, 1, 1, 1]]))["nmi"][0] == pytest.approx(doubled["nmi"])
    assert weighted_scores(np.array([0, 1, 1]), np.array(list("abb")), np.array([[0.0, 1, 1]]))["nmi"][
        0
    ] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="weights"):
        weighted_scores(clusters, labels, np.ones((1, 3)))


def test_bootstrap_weights_are_resamples_of_the_items():
    w = bootstrap_weights(50, 200, seed=1)
    assert w.shape == (200, 50) and (w.sum(axis=1) == 50).all() and (w >= 0).all()
    assert (w == bootstrap_weights(50, 200, seed=1)).all() and not (w == bootstrap_weights(50, 200, seed=2)).all()
    assert 0.55 < (w > 0).mean() < 0.72  # about 1 - 1/e of the items appear in a resample
    with pytest.raises(ValueError, match="draws"):
        bootstrap_weights(5, 0)


def test_refine_partition_moves_members_to_the_nearest_part_and_keeps_a_settled_one():
    rng = np.random.default_rng(4)
    centres = np.eye(6)[:3]
    x = np.vstack([c + 0.05 * rng.standard_normal((15, 6)) for c in centres])
    truth = np.repeat([0, 1, 2], 15)
    scrambled = truth.copy()
    scrambled[[0, 16, 32]] = [1, 2, 0]  # one member of each group put in the wrong part
    refined = refine_partition(x, scrambled)
    assert purity(refined, truth) == 1.0 and len(set(refined.tolist())) == 3
    assert (refine_partition(x, truth) == truth).all()  # already settled: nothing moves
    assert len(set(refine_partition(x, np.zeros(45, int)).tolist())) == 1  # never more parts than given
    with pytest.raises(ValueError, match="labels"):
        refine_partition(x, truth[:10])
