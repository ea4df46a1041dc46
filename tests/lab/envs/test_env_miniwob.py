"""MiniWobEnv in headless Chromium (two browser starts, ~20 s); skips without miniwob or Chromium."""

from __future__ import annotations

import glob
import os
import sys

import pytest

from lifemem_ray.lab.envs import EnvUnavailable, Task, TaskError, make_env
from lifemem_ray.lab.envs.miniwob import MiniWobEnv, parse_action, render_dom

pytestmark = pytest.mark.miniwob

KINDS = ["click-button", "enter-text", "click-checkboxes", "focus-text", "login-user"]


def _browser_or_skip() -> None:
    pytest.importorskip("miniwob", reason="miniwob is not installed (pip install miniwob)")
    pytest.importorskip("selenium", reason="selenium is not installed (pip install miniwob)")
    try:
        MiniWobEnv._find_browser()
    except EnvUnavailable as exc:
        pytest.skip(f"no browser for MiniWoB: {exc}")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def env():
    _browser_or_skip()
    e = MiniWobEnv(task_names=KINDS, seeds_train=[0, 1, 2], seeds_test=[500])
    try:
        yield e
    finally:
        e.close()


def test_parse_action_grammar():
    assert parse_action("click [4]") == ("click", 4, "")
    assert parse_action("  CLICK 12 ") == ("click", 12, "")
    assert parse_action('type [5] "Myron Smith"') == ("type", 5, "Myron Smith")
    assert parse_action("type [5] plain text") == ("type", 5, "plain text")
    assert parse_action("press Enter") == ("press", None, "enter")
    for bad in ["", "click", "click [x]", "click [4] now", "fly [4]", "press F13", "type [5] " + "x" * 500, None, 7]:
        assert isinstance(parse_action(bad), str) and "Invalid" in parse_action(bad)  # type: ignore[arg-type]


def test_render_dom_labels_checkboxes_and_skips_layout():
    dom = {
        "tag": "BODY",
        "ref": 1,
        "children": [
            {
                "tag": "DIV",
                "ref": 2,
                "children": [
                    {
                        "tag": "LABEL",
                        "ref": 3,
                        "children": [
                            {"tag": "INPUT_checkbox", "ref": 4, "value": True, "children": []},
                            {"tag": "t", "ref": -1, "text": "red", "children": []},
                        ],
                    },
                    {"tag": "t", "ref": -2, "text": "loose words", "children": []},
                    {"tag": "BUTTON", "ref": 5, "text": "Submit", "children": []},
                    {"tag": "INPUT_text", "ref": 6, "value": "ab", "focused": True, "children": []},
                ],
            }
        ],
    }
    lines, elements = render_dom(dom)
    assert lines == [
        '[4] input_checkbox (checked) "red"',
        'text "loose words"',
        '[5] button "Submit"',
        '[6] input_text value="ab" (focused)',
    ]
    assert [e["ref"] for e in elements] == [4, 5, 6]


def test_tasks_deterministic_and_split(env):
    train, test = env.tasks("train"), env.tasks("test")
    assert len(train) == 15 and len(test) == 5
    assert {t.split for t in train} == {"train"} and {t.split for t in test} == {"test"}
    ids = [t.id for t in train + test]
    assert len(set(ids)) == len(ids) and "enter-text-train-1" in ids and "login-user-test-500" in ids
    assert all(t.env == "miniwob" and t.instruction.strip() for t in train + test)
    assert sorted(t.metadata["task_type"] for t in train) == sorted(KINDS * 3)
    assert env.tasks("train") == train
    shuffled = env.tasks("train", seed=7)
    assert shuffled == env.tasks("train", seed=7) and sorted(t.id for t in shuffled) == sorted(t.id for t in train)
    assert env.tasks("train", limit=4) == train[:4]
    with pytest.raises(ValueError, match="split"):
        env.tasks("dev")
    with pytest.raises(ValueError, match="overlap"):
        MiniWobEnv(seeds_train=[1, 2], seeds_test=[2])


def test_reset_gives_instruction_dom_and_valid_actions(env):
    task = next(t for t in env.tasks("train") if t.metadata["task_type"] == "enter-text")
    obs, info = env.reset(task)
    target = task.instruction.split('"')[1]
    assert info["instruction"] == task.instruction and info["success"] is None
    assert 'button "Submit"' in obs and 'input_text value=""' in obs
    assert any(a.startswith("type [") and a.endswith(f'"{target}"') for a in info["valid_actions"])
    assert all(isinstance(a, str) for a in info["valid_actions"])


def test_invalid_actions_are_steps(env):
    task = next(t for t in env.tasks("train") if t.metadata["task_type"] == "click-button")
    _, info = env.reset(task)
    button = next(a for a in info["valid_actions"] if a.startswith("click"))
    saved = env.max_steps
    env.max_steps = 6
    try:
        for bad in ["", None, "click [999]", "fly away", "type " + button[6:] + " hello", "press F13"]:
            result = env.step(bad)  # type: ignore[arg-type]
            assert "Invalid" in result.observation and result.reward == 0.0
        assert result.done and result.info["success"] is False  # the sixth step hits max_steps
        assert env.step("click [4]").done
    finally:
        env.max_steps = saved


def test_wrong_click_fails(env):
    for task in (t for t in env.tasks("train") if t.metadata["task_type"] == "click-button"):
        target = task.instruction.split('"')[1]
        obs, _ = env.reset(task)
        wrong = [line for line in obs.splitlines() if " button " in line and f'"{target}"' not in line]
        if wrong:
            break
    else:
        pytest.fail("no click-button task with a wrong button among the train seeds")
    result = env.step("click " + wrong[0].split()[0])
    assert result.done and result.reward < 0 and result.info["success"] is False


def test_gold_actions_reach_success(env):
    for task in env.tasks("train") + env.tasks("test"):
        gold = env.gold_actions(task)
        assert gold, task.id
        env.reset(task)
        for action in gold:
            result = env.step(action)
        assert result.done and result.info["success"] is True and result.reward > 0, (
            task.id,
            task.instruction,
            gold,
            result.observation,
        )


def test_gold_of_another_task_keeps_the_running_episode(env):
    first = next(t for t in env.tasks("train") if t.metadata["task_type"] == "login-user")
    other = next(t for t in env.tasks("train") if t.metadata["task_type"] == "click-checkboxes")
    gold = env.gold_actions(first)
    env.reset(first)
    assert not env.step(gold[0]).done
    assert env.gold_actions(other)  # opens another page; the episode is replayed
    for action in gold[1:]:
        result = env.step(action)
    assert result.info["success"] is True


def test_bad_tasks_raise_task_error(env):
    good = env.tasks("train", limit=1)[0]
    with pytest.raises(TaskError, match="belongs to"):
        env.reset(Task(env="scienceworld", id="x", instruction="x", payload=good.payload))
    with pytest.raises(TaskError, match="subdomain"):
        env.reset(Task(env="miniwob", id="x", instruction="x", payload={"subdomain": "../../etc/passwd", "seed": 0}))
    with pytest.raises(TaskError, match="seed"):
        env.reset(Task(env="miniwob", id="x", instruction="x", payload={"subdomain": "click-test", "seed": -1}))


def test_close_quits_browser_and_cleans_temp(env):
    before = set(glob.glob("/tmp/org.chromium.Chromium.*"))
    other = make_env("miniwob", task_names=KINDS, seeds_train=[0, 1, 2], seeds_test=[500])
    try:
        assert isinstance(other, MiniWobEnv)
        assert other.tasks("test") == env.tasks("test")  # the same instructions from a fresh browser
        pids, tmpdir = other.browser_pids, other._tmpdir
        assert len(pids) >= 2 and all(_alive(p) for p in pids) and tmpdir and os.path.isdir(tmpdir)
    finally:
        other.close()
    assert [p for p in pids if _alive(p)] == [], "chromedriver/Chromium still run after close()"
    assert not os.path.exists(tmpdir)
    assert set(glob.glob("/tmp/org.chromium.Chromium.*")) <= before
    other.close()  # twice is fine
    with pytest.raises(RuntimeError, match="reset"):
        other.step("click [4]")


def test_missing_package_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "miniwob", None)
    with pytest.raises(EnvUnavailable, match="pip install miniwob"):
        MiniWobEnv()
