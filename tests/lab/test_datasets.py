"""Labelled trajectory sets from real environments: labels, disjoint folds, workers that hang or crash."""

from __future__ import annotations

import pytest

from lifemem_ray.lab.datasets import Source, generate, label_of, load_set, save_set, scienceworld_topic


def test_sql_fold_is_labelled_and_disjoint_from_the_other_fold():
    source = Source("sql", "sql", {"n_train": 6, "n_test": 6}, limit=6)
    tune = generate([source], "tune", workers=1, agent="gold")
    report = generate([source], "report", workers=1, agent="gold")
    assert len(tune.trajectories) == len(report.trajectories) == 6
    assert not tune.skipped and not tune.unavailable
    kinds = {label_of(t, "task_type") for t in tune.trajectories}
    assert kinds <= {"select", "count", "aggregate", "join", "insert", "update", "delete"} and len(kinds) == 6
    assert all(t.env == "sql" and t.metadata["fold"] == "tune" and t.outcome.success for t in tune.trajectories)
    assert not {t.task for t in tune.trajectories} & {t.task for t in report.trajectories}
    assert not {t.id for t in tune.trajectories} & {t.id for t in report.trajectories}


def test_a_hung_or_crashed_episode_is_counted_and_the_rest_is_played(tmp_path):
    from lifemem_ray.lab.envs import make_env

    ids = [t.id for t in make_env("sql", n_train=5, n_test=1).tasks("train")]
    options = {
        "inner": "sql",
        "inner_options": {"n_train": 5, "n_test": 1},
        "marker_dir": str(tmp_path / "markers"),
        "hang_on": [ids[1]],
        "crash_on": [ids[3]],
    }
    result = generate([Source("sql", "faulty", options, seed=0)], "tune", workers=1, agent="gold", episode_timeout_s=2)
    played = sorted(t.metadata["task_id"] for t in result.trajectories)
    assert played == sorted([ids[0], ids[2], ids[4]])
    assert sum(result.skipped.values()) == 2, result.skipped
    assert any("over 2 s" in why for why in result.skipped) and any("crashed" in why for why in result.skipped)


def test_an_adapter_that_cannot_start_is_reported_not_dropped():
    result = generate([Source("sql", "sql", {"n_train": -1})], "tune", workers=1)
    assert result.trajectories == [] and "sql" in result.unavailable and "n_train" in result.unavailable["sql"]


def test_sets_round_trip_through_files(tmp_path):
    source = Source("sql", "sql", {"n_train": 3, "n_test": 1}, limit=3)
    result = generate([source], "tune", workers=1, agent="gold")
    path = tmp_path / "tune.jsonl.gz"
    assert save_set(path, result.trajectories, {"fold": "tune"}) == 3
    loaded, meta = load_set(path)
    assert loaded == result.trajectories and meta == {"fold": "tune", "trajectories": 3}


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="fold"):
        generate([], "dev")
    with pytest.raises(ValueError, match="noise"):
        generate([], "tune", noise=2.0)


def test_scienceworld_topics_follow_the_packages_numbering():
    pytest.importorskip("scienceworld")
    assert scienceworld_topic("find-animal") == "4-classification"
    assert scienceworld_topic("boil") == "1-matter"
    with pytest.raises(KeyError):
        scienceworld_topic("not-a-kind")


def test_the_paper_environments_added_last_are_labelled_at_every_level():
    """FEVER, WebShop and Mind2Web feed the cluster benchmark with their own labels (FEVER and
    Mind2Web read the shared data: skipped without it)."""
    from lifemem_ray.lab.datasets import LABEL_LEVELS, default_sources
    from lifemem_ray.lab.envs import EnvUnavailable, make_env

    names = [s.env for s in default_sources(0.01)]
    assert {"fever", "webshop", "mind2web"} <= set(names)
    for env in ("fever", "mind2web"):
        try:
            make_env(env).close()
        except EnvUnavailable as exc:
            pytest.skip(f"{env}: {exc}")
    sources = [Source(env, env, {}, limit=3) for env in ("fever", "webshop", "mind2web")]
    result = generate(sources, "report", workers=1, agent="gold")
    assert not result.unavailable and not result.skipped
    by_env: dict[str, list] = {}
    for t in result.trajectories:
        by_env.setdefault(t.env, []).append(t)
    assert {env: len(ts) for env, ts in by_env.items()} == {"fever": 3, "webshop": 3, "mind2web": 3}
    for env, trajectories in by_env.items():
        for t in trajectories:
            assert all(label_of(t, level) not in (None, "unknown") for level in LABEL_LEVELS[env]), (env, t.metadata)
            assert t.outcome.success
    assert {label_of(t, "task_type") for t in by_env["fever"]} <= {"SUPPORTS", "REFUTES", "NOT ENOUGH INFO"}
