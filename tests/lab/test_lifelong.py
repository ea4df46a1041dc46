"""The lifelong protocol's pure parts: streams, OP/BwT, transfer events, config, reports."""

from __future__ import annotations

import json

import pytest

from lifemem_ray.engine.memory_config import ConfigError
from lifemem_ray.lab.envs.base import Task
from lifemem_ray.lab.experiment_config import ExperimentConfig
from lifemem_ray.lab.lifelong import (
    ScoreTable,
    SeedResult,
    build_stream,
    learnt_rows,
    metrics,
    overlap,
    render_markdown,
    summarise,
    transfer_events,
    write_plots,
)


def _tasks(env: str, n: int) -> list[Task]:
    return [Task(env, f"{env}-{i}", f"do {i} in {env}") for i in range(n)]


def test_metrics_follow_equations_8_and_9():
    # Three environments learnt in order; values as in the paper's appendix C layout.
    t = ScoreTable(["a", "b", "c"])
    t.add_row("a", {"a": 50.0})
    t.add_row("b", {"a": 40.0, "b": 80.0})
    t.add_row("c", {"a": 60.0, "b": 77.0, "c": 30.0})
    m = metrics(t)
    assert m["op"] == pytest.approx((60 + 77 + 30) / 3)
    # BwT over i < N: a (60-50)/50 = +20%, b (77-80)/80 = -3.75%
    assert m["bwt"] == pytest.approx(100 * ((60 - 50) / 50 + (77 - 80) / 80) / 2)
    assert m["bwt_terms"] == 2 and m["bwt_undefined"] == 0


def test_paper_example_bwt_term():
    t = ScoreTable(["miniwob", "mind2web"])
    t.add_row("miniwob", {"miniwob": 77.08})
    t.add_row("mind2web", {"miniwob": 75.00, "mind2web": 40.0})
    assert metrics(t)["bwt"] == pytest.approx(-2.70, abs=0.005)


def test_bwt_with_zero_baseline_is_left_out_and_counted():
    t = ScoreTable(["a", "b"])
    t.add_row("a", {"a": 0.0})
    t.add_row("b", {"a": 30.0, "b": 10.0})
    m = metrics(t)
    assert m["bwt"] is None and m["bwt_undefined"] == 1 and m["op"] == pytest.approx(20.0)


def test_transfer_events_use_the_five_point_band():
    t = ScoreTable(["a", "b", "c"])
    t.add_row("a", {"a": 50.0})
    t.add_row("b", {"a": 54.9, "b": 20.0})  # unchanged
    t.add_row("c", {"a": 44.0, "b": 26.0, "c": 1.0})  # a degraded, b improved
    assert transfer_events(t) == {"improved": 1, "unchanged": 1, "degraded": 1}


def test_similarity_stream_groups_by_environment_in_order():
    train = {"x": _tasks("x", 3), "y": _tasks("y", 2)}
    phases = build_stream("similarity", train, ["y", "x"])
    assert [p.label for p in phases] == ["y", "x"]
    assert [t.env for t in phases[0].tasks] == ["y", "y"]
    assert phases[1].evaluate == ("y", "x")


@pytest.mark.parametrize("kind", ["random", "buffer"])
def test_random_streams_shuffle_deterministically_and_cover_everything(kind):
    train = {"x": _tasks("x", 10), "y": _tasks("y", 10), "z": _tasks("z", 10)}
    a = build_stream(kind, train, ["x", "y", "z"], seed=3)
    b = build_stream(kind, train, ["x", "y", "z"], seed=3)
    c = build_stream(kind, train, ["x", "y", "z"], seed=4)
    assert [p.tasks for p in a] == [p.tasks for p in b]
    assert [p.tasks for p in a] != [p.tasks for p in c]
    assert len(a) == 3 and sum(len(p.tasks) for p in a) == 30
    assert sorted(t.id for p in a for t in p.tasks) == sorted(t.id for ts in train.values() for t in ts)
    envs_first_chunk = {t.env for t in a[0].tasks}
    assert set(a[0].evaluate) == envs_first_chunk


def test_stream_errors_name_the_problem():
    with pytest.raises(ValueError, match="stream"):
        build_stream("nope", {"x": _tasks("x", 1)}, ["x"])
    with pytest.raises(ValueError, match="no training tasks"):
        build_stream("similarity", {"x": _tasks("x", 1)}, ["x", "y"])


def test_experiment_config_sources_and_validation(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        '[experiment]\nname = "t"\nenvs = ["sql", "websearch"]\ntrain_tasks = 4\nworkers = 3\n'
        "[experiment.env_options.sql]\nn_train = 10\n[retrieval]\nk = 4\n"
    )
    exp = ExperimentConfig.load(path, environ={"LIFEMEM_EXPERIMENT_WORKERS": "5"}, overrides={"stream": "buffer"})
    assert exp.envs == ["sql", "websearch"] and exp.train_tasks == 4 and exp.workers == 5 and exp.stream == "buffer"
    assert exp.env_options == {"sql": {"n_train": 10}}
    assert ExperimentConfig.load(environ={"LIFEMEM_EXPERIMENT_ENVS": "a, b"}).envs == ["a", "b"]
    with pytest.raises(ConfigError, match=r"experiment\.bogus"):
        ExperimentConfig.load(overrides={"bogus": 1})
    with pytest.raises(ConfigError, match=r"experiment\.stream"):
        ExperimentConfig.load(overrides={"stream": "sideways"})
    with pytest.raises(ConfigError, match=r"experiment\.modes"):
        ExperimentConfig.load(overrides={"modes": ["lifemem", "magic"]})
    with pytest.raises(ConfigError, match=r"experiment\.agent"):
        ExperimentConfig.load(overrides={"agent": "oracle"})
    with pytest.raises(ConfigError, match="workers"):
        ExperimentConfig.load(overrides={"workers": "0"})
    with pytest.raises(ConfigError, match="expected an integer"):
        ExperimentConfig.load(overrides={"workers": "many"})
    with pytest.raises(ConfigError, match=r"experiment\.seeds"):
        ExperimentConfig.load(overrides={"seeds": 0})
    with pytest.raises(ConfigError, match="episode_timeout_s"):
        ExperimentConfig.load(overrides={"episode_timeout_s": float("nan")})
    with pytest.raises(ConfigError, match="aliases"):
        ExperimentConfig.load(overrides={"aliases": {"twx-sorting": "nowhere"}})
    with pytest.raises(ConfigError, match="against 'none'"):
        ExperimentConfig.load(overrides={"modes": ["lifemem"]})
    with pytest.raises(ConfigError, match="repeated"):
        ExperimentConfig.load(overrides={"eval_envs": ["twx-coin"]})


def test_default_experiment_has_every_mode_transfer_and_the_skill_reader():
    exp = ExperimentConfig().checked()
    assert set(exp.modes) == {"none", "trajectory", "global-skills", "lifemem", "lifemem-no-skills", "skills-only"}
    assert exp.eval_envs and exp.seeds >= 3 and exp.agent == "skill-guided" and not exp.learner_uses_memory
    assert ExperimentConfig(learn_agent="same", agent="exemplar").learner_uses_memory


def test_random_stream_bwt_baseline_is_where_training_ends():
    # x is learnt in chunks 1 and 2: its gain between them is learning, not backward transfer.
    x, y = _tasks("x", 2), _tasks("y", 2)
    from lifemem_ray.lab.lifelong import Phase

    phases = [
        Phase(0, "chunk 1", (x[0], y[0]), ("x", "y")),
        Phase(1, "chunk 2", (x[1],), ("x", "y")),
        Phase(2, "chunk 3", (y[1],), ("x", "y")),
    ]
    assert learnt_rows(phases) == {"x": 1, "y": 2}
    t = ScoreTable(["x", "y"])
    t.add_row("chunk 1", {"x": 10.0, "y": 50.0})
    t.add_row("chunk 2", {"x": 40.0, "y": 50.0})
    t.add_row("chunk 3", {"x": 20.0, "y": 60.0})
    m = metrics(t, learnt_rows(phases))
    assert m["bwt"] == pytest.approx(100 * (20 - 40) / 40) and m["bwt_terms"] == 1  # y is learnt until the end
    assert transfer_events(t, learnt=learnt_rows(phases)) == {"improved": 0, "unchanged": 0, "degraded": 1}
    assert metrics(t)["bwt"] == pytest.approx(100 * ((20 - 10) / 10 + (60 - 50) / 50) / 2)  # first-seen baseline


def test_overlap_finds_repeated_gold_and_goals_but_not_a_shared_template():
    train = [Task("e", "a", "find X"), Task("e", "b", "find Y")]
    test = [Task("e", "c", "find X"), Task("e", "d", "find Z"), Task("e", "f", "find W")]
    gold = {"a": ["go", "take x"], "b": ["take y"], "c": ["go", "take x2"], "d": ["take y"], "f": None}
    assert overlap(train, test, gold) == {"gold": ["d"], "goal": ["c"], "one_template": []}
    same = [Task("g", "a", "take the coin"), Task("g", "b", "take the coin")]
    out = overlap(same, [Task("g", "c", "take the coin")], {"a": ["x"], "b": ["y"], "c": ["z"]})
    assert out == {"gold": [], "goal": [], "one_template": ["c"]}


def _seed(seed, none_rows, mem_rows, zero=None):
    return SeedResult(
        seed, ["a", "b"], {"a": 0, "b": 1}, rows={"none": none_rows, "lifemem": mem_rows}, zero_shot=zero or {}
    )


def test_summarise_pools_seeds_and_brackets_every_figure():
    r0 = _seed(
        0,
        [{"a": [0, 1, 1, 0]}, {"a": [0, 1, 1, 0], "b": [0, 1]}],
        [{"a": [1, 0, 1, 0]}, {"a": [1, 1, 1, 0], "b": [1, 1]}],
        {"none": {"z": [0, 0]}, "lifemem": {"z": [1, 0]}},
    )
    r1 = _seed(
        1,
        [{"a": [1, 0, 1, 0]}, {"a": [1, 0, 1, 0], "b": [0, 0]}],
        [{"a": [1, 1, 0, 0]}, {"a": [1, 1, 0, 1], "b": [1, 0]}],
        {"none": {"z": [1, 0]}, "lifemem": {"z": [1, 1]}},
    )
    out = summarise([r0, r1], ["none", "lifemem"], ["a", "b"], bootstrap=300, seed=1)
    mem = out["lifemem"]
    assert mem["table"]["rows"][0]["a"] == pytest.approx(100 * 4 / 8)
    assert mem["table"]["rows"][1] == pytest.approx({"a": 100 * 6 / 8, "b": 75.0})
    assert mem["metrics"]["op"] == pytest.approx((75 + 75) / 2)
    assert mem["metrics"]["bwt"] == pytest.approx(100 * (75 - 50) / 50)
    assert mem["zero_shot"] == {"z": 75.0} and mem["zero_shot_gain"] == {"z": pytest.approx(75 - 25)}
    for key in ("op", "bwt", "row/0/a", "row/1/b", "zero/z", "gain/z"):
        low, high = mem["ci"][key]
        assert low <= high
    assert mem["ci"]["op"][0] <= mem["metrics"]["op"] <= mem["ci"]["op"][1]
    assert out["none"]["zero_shot_gain"] == {"z": 0.0}
    # Paired draws: none's rows repeat one evaluation, so its BwT is 0 in every draw.
    assert out["none"]["ci"]["bwt"] == [0.0, 0.0]
    assert summarise([r0], ["lifemem"], ["a", "b"], bootstrap=0)["lifemem"]["ci"]["op"] is None


def _report(tmp_path):
    t = ScoreTable(["a", "b"])
    t.add_row("a", {"a": 50.0})
    t.add_row("b", {"a": 60.0, "b": 20.0})
    t.self_learn = {"a": 45.0, "b": 25.0}
    mode = {"table": t.to_dict(), "metrics": metrics(t), "transfer": transfer_events(t)}
    return {
        "config": ExperimentConfig(name="r", envs=["a", "b"], eval_envs=[]).to_dict(),
        "modes": {"none": mode, "lifemem": mode},
        "memory": {
            "trajectories": 9,
            "clusters": 3,
            "cluster_sizes": [5, 3, 1],
            "clusters_per_env": {"a": {"single_env": 2, "shared": 1}, "b": {"single_env": 0, "shared": 1}},
        },
    }


def test_markdown_and_plots(tmp_path):
    report = _report(tmp_path)
    md = render_markdown(report)
    assert "| lifemem | 40.0 | 20.0 | 1 | 0 | 0 |" in md
    assert "| *self-learn* | 45.0 | 25.0 |" in md
    assert "| b | 60.0 | 20.0 |" in md
    report["modes"]["lifemem"]["ci"] = {"op": [30.0, 50.0], "row/1/b": [5.0, 35.0]}
    md = render_markdown(report)
    assert "| lifemem | 40.0 [30.0, 50.0] | 20.0 |" in md and "| b | 60.0 | 20.0 [5.0, 35.0] |" in md
    json.dumps(report)
    pytest.importorskip("matplotlib")
    written = write_plots(report, tmp_path / "plots")
    assert sorted(p.name for p in written) == ["cluster_sizes.png", "cluster_types.png", "table_heatmap.png"]
    for p in written:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 2000
