"""Mind2WebEnv: the step-level offline protocol over released trajectories (tiny records written
here, in both ``messages`` forms, and the shared LifeMem training file when present)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from lifemem_ray.core.errors import InvalidArgumentError
from lifemem_ray.lab.agents import make_agent
from lifemem_ray.lab.envs import EnvUnavailable, Task, TaskError, make_env
from lifemem_ray.lab.envs.base import EnvStateError
from lifemem_ray.lab.envs.mind2web.env import Mind2WebEnv, candidate_actions, summarise, task_spans
from lifemem_ray.lab.envs.mind2web.records import (
    MAX_ACTION_CHARS,
    MAX_PAGE_CHARS,
    Action,
    operation_f1,
    page_elements,
    parse_action,
    parse_messages,
    score_action,
)
from lifemem_ray.lab.episode import EpisodeLimits, run_episode

SHARED = Path(os.environ.get("LIFEMEM_SHARED_DIR", Path(__file__).resolve().parents[4] / "shared"))
MIND2WEB = SHARED / "data" / "lifemem-trainset" / "mind2web.jsonl"

PAGE_A0 = (
    "<html> <div> <select id=136 type> <option reservations true> Dine in </option> "
    "<option pickup> Pickup </option> <option 17:00> 5:00 PM </option> </select> "
    "<input id=753 text location columbus, oh /> <input id=760 checkbox agree /> "
    "<button id=755 button select location /> </div> </html>"
)
PAGE_A1 = "<html> <div> <input id=6068 search find a location /> <a id=6070> Boston </a> </div> </html>"
PAGE_B0 = "<html> <body> <a id=12> Deals </a> <span id=13> <svg id=14/> </span> <label id=15> <select> <option 1> Lowest Price </option> </select> </label> </body> </html>"


def _user(page: str, first_task: str | None = None) -> dict[str, str]:
    head = f"Task: {first_task}\nTrajectory:\n" if first_task else ""
    return {"role": "user", "content": f"{head}Observation: `{page}`"}


def _agent(action: str, desc: str) -> dict[str, str]:
    return {"role": "assistant", "content": f"Action: `{action}` ({desc})"}


def _record(site: str, domain: str, task: str, turns: list[dict[str, str]], line: int, as_repr: bool) -> dict:
    return {
        "task": f"Website: {site}\nDomain: {domain}\nSubdomain: Sub {site}\nTask: {task}",
        "messages": repr(turns) if as_repr else turns,  # some published records hold the list's Python repr
        "env": "mind2web",
        "source_line": line,
    }


TASK_A = "Check for pickup restaurant available in Boston, NY on March 18, 5pm"
TINY = [
    _record(
        "tockA",
        "Travel",
        TASK_A,
        [
            _user(PAGE_A0, TASK_A),
            _agent("SELECT [136] [Pickup]", "[combobox]  Reservation type -> SELECT: Pickup"),
            _user(PAGE_A1),
            _agent("TYPE [6068] [Boston]", "[searchbox]  Find a location -> TYPE: Boston"),
            _user(PAGE_A0),
            _agent("SELECT [136] [5 00 PM]", "[combobox]  Time -> SELECT: 5:00 PM"),
        ],
        0,
        as_repr=False,
    ),
    _record(
        "shopB",
        "Shopping",
        "Find the cheapest deals",
        [
            _user(PAGE_B0, "Find the cheapest deals"),
            _agent("CLICK [12]", "[link]  Deals -> CLICK"),
            _user(PAGE_B0),
            _agent("SELECT [15] [Lowest Price]", "[combobox]  Sort -> SELECT: Lowest Price"),
        ],
        1,
        as_repr=True,
    ),
    _record(
        "tripC",
        "Travel",
        "Open the trip planner",
        [_user(PAGE_B0, "Open the trip planner"), _agent("CLICK [14]", "[svg]   -> CLICK")],
        2,
        as_repr=True,
    ),
    _record(
        "storeD",
        "Shopping",
        "Open the deals",
        [_user(PAGE_B0, "Open the deals"), _agent("CLICK [12]", "[link]  Deals -> CLICK")],
        3,
        as_repr=False,
    ),
]


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def tiny_path(tmp_path):
    return _write(tmp_path / "tiny.jsonl", TINY)


@pytest.fixture
def tiny(tiny_path):
    env = Mind2WebEnv(path=str(tiny_path))
    try:
        yield env
    finally:
        env.close()


@pytest.fixture(scope="module")
def shared():
    if not MIND2WEB.is_file():
        pytest.skip(f"shared Mind2Web trajectories not found at {MIND2WEB}")
    env = Mind2WebEnv(path=str(MIND2WEB))
    try:
        yield env
    finally:
        env.close()


def _by_id(env: Mind2WebEnv) -> dict[str, Task]:
    return {t.id: t for t in env.tasks("train") + env.tasks("test")}


# --------------------------------------------------------------------------- tiny records


def test_tiny_parses_both_message_forms_into_steps(tiny):
    tasks = _by_id(tiny)
    steps = ["m2w-000-00", "m2w-000-01", "m2w-000-02", "m2w-001-00", "m2w-001-01", "m2w-002-00", "m2w-003-00"]
    assert sorted(tasks) == steps
    first, third = tasks["m2w-000-00"], tasks["m2w-000-02"]
    assert first.instruction == f"Task: {TASK_A}\nPrevious actions:\nNone"
    assert third.instruction.endswith(
        "Previous actions:\n[combobox]  Reservation type -> SELECT: Pickup\n[searchbox]  Find a location -> TYPE: Boston"
    )
    assert first.metadata == {
        "task_type": "Travel",
        "website": "tockA",
        "subdomain": "Sub tockA",
        "trajectory": 0,
        "step": 0,
        "n_steps": 3,
    }
    obs, info = tiny.reset(first)
    assert obs == PAGE_A0  # the page as released: fenced later, by the memory and the prompt
    assert info["instruction"] == first.instruction and info["success"] is None
    assert tiny.gold_actions(tasks["m2w-001-01"]) == ["SELECT [15] [Lowest Price]"]  # from the repr form
    only_last = Mind2WebEnv(path=tiny.path, previous_k=1)
    assert _by_id(only_last)["m2w-000-02"].instruction.endswith(
        "Previous actions:\n[searchbox]  Find a location -> TYPE: Boston"
    )


def test_tiny_valid_actions_come_from_the_page(tiny):
    _, info = tiny.reset(_by_id(tiny)["m2w-000-00"])
    valid = info["valid_actions"]
    assert valid[:4] == ["CLICK [136]", "CLICK [753]", "CLICK [760]", "CLICK [755]"]
    assert [a for a in valid if a.startswith("SELECT")] == [
        "SELECT [136] [Dine in]",
        "SELECT [136] [Pickup]",
        "SELECT [136] [5:00 PM]",
    ]
    typed = [a for a in valid if a.startswith("TYPE")]
    assert typed and all(a.startswith("TYPE [753] [") for a in typed)  # not the checkbox, select or button
    assert "TYPE [753] [Boston]" in typed and "TYPE [753] [March 18]" in typed
    assert "TYPE [753] [Boston NY]" not in typed  # spans do not cross punctuation
    assert task_spans("a flight from New York to Boston, today") == [
        "flight",
        "flight from New",
        "flight from New York",
        "New",
        "New York",
        "New York to Boston",
        "York",
        "York to Boston",
        "Boston",
        "today",
    ]


def test_gold_inserted_only_when_no_candidate_is_equivalent():
    elements = page_elements(PAGE_A1)
    assert [(e.id, e.tag, e.typeable) for e in elements] == [("6068", "input", True), ("6070", "a", False)]
    valid, inserted = candidate_actions(elements, "find Boston", Action("TYPE", "6068", "Boston"), "k")
    assert not inserted and "TYPE [6068] [Boston]" in valid
    odd = Action("TYPE", "6068", "BOSTON MA")  # not a span of the task text: inserted, at a seeded place
    valid, inserted = candidate_actions(elements, "find Boston", odd, "k")
    again, _ = candidate_actions(elements, "find Boston", odd, "k")
    assert inserted and "TYPE [6068] [BOSTON MA]" in valid and valid == again
    # the released value '5 00 PM' is the option '5:00 PM': equivalent, nothing inserted
    _, inserted = candidate_actions(page_elements(PAGE_A0), "x", Action("SELECT", "136", "5 00 PM"), "k")
    assert not inserted
    # a label around an id-less select carries its options
    assert page_elements(PAGE_B0)[-1].options == ("Lowest Price",)


def test_scoring_follows_mind2web():
    gold = Action("TYPE", "6068", "Boston")
    assert score_action(Action("TYPE", "6068", "Boston"), gold) == (True, 1.0, True)
    element, f1, ok = score_action(Action("TYPE", "6068", "Boston MA"), gold)
    assert element and f1 == pytest.approx(0.8) and not ok  # {TYPE, Boston} vs {TYPE, Boston, MA}
    assert score_action(Action("TYPE", "6070", "Boston"), gold) == (False, 1.0, False)
    assert score_action(Action("CLICK", "6068", ""), gold)[1] == 0.0  # {CLICK} and {TYPE, Boston} share nothing
    assert score_action(Action("TYPE", "6068", "boston"), gold)[1] == 0.5  # case-sensitive, as Mind2Web
    sel = Action("SELECT", "136", "5 00 PM")
    assert score_action(Action("SELECT", "136", "5:00 PM"), sel) == (True, 1.0, True)
    assert score_action(Action("SELECT", "136", "6:00 PM"), sel)[1] == pytest.approx(2 * (3 / 4) * (3 / 4) / 1.5)
    assert operation_f1("", "") == 1.0 and operation_f1("CLICK", "") == 0.0
    assert parse_action("Thought: the box.\nAction: `type [0753] [Boston, NY]` ([textbox] x -> TYPE: y)") == Action(
        "TYPE", "753", "Boston, NY"
    )
    assert parse_action("CLICK [12] then more") == Action("CLICK", "12", "")
    assert parse_action("press the button") is None and parse_action(None) is None
    assert parse_action("CLICK [1]" + " " * MAX_ACTION_CHARS) is None


def test_tiny_gold_succeeds_random_does_not_always(tiny):
    results = []
    for task in tiny.tasks("train") + tiny.tasks("test"):
        r = run_episode(tiny, make_agent("gold"), task, trajectory_id=f"g/{task.id}")
        assert r.success and r.reward == 1.0 and r.steps == 1, task.id
        results.append((task, {"success": True, "element_correct": True, "operation_f1": 1.0}))
    report = summarise(results)
    assert report["steps"] == 7 and report["tasks"] == 4 and report["websites"] == 4 and report["task_sr"] == 1.0
    task = _by_id(tiny)["m2w-000-00"]
    tiny.reset(task)
    r = tiny.step("SELECT [136] [Dine in]")
    assert r.done and r.reward == 0.0 and r.info["success"] is False and r.info["element_correct"] is True
    assert 0 < r.info["operation_f1"] < 1 and r.info["prediction"] == "SELECT [136] [Dine in]"


def test_summarise_counts_task_success_over_complete_trajectories(tiny):
    tasks = _by_id(tiny)
    rows = [
        (tasks["m2w-000-00"], {"success": True, "element_correct": True, "operation_f1": 1.0}),
        (tasks["m2w-000-01"], {"success": False, "element_correct": True, "operation_f1": 0.5}),
        (tasks["m2w-000-02"], {"success": True, "element_correct": True, "operation_f1": 1.0}),
        (tasks["m2w-001-00"], {"success": True, "element_correct": True, "operation_f1": 1.0}),  # 1 of 2 steps
        (tasks["m2w-002-00"], {"success": True, "element_correct": True, "operation_f1": 1.0}),
    ]
    report = summarise(rows)
    assert report["steps"] == 5 and report["tasks"] == 3 and report["complete_tasks"] == 2
    assert report["step_sr"] == pytest.approx(4 / 5) and report["operation_f1"] == pytest.approx(4.5 / 5)
    assert report["task_sr"] == pytest.approx(1 / 2) and report["element_acc"] == 1.0
    assert summarise([])["task_sr"] is None


def test_invalid_actions_are_observed_then_the_step_fails(tiny_path):
    env = Mind2WebEnv(path=str(tiny_path), max_steps=2)
    task = _by_id(env)["m2w-001-00"]
    env.reset(task)
    r = env.step("click the deals link")
    assert r.observation.startswith("Invalid action: click the deals link.") and not r.done and r.reward == 0.0
    r = env.step("x" * (MAX_ACTION_CHARS + 1))
    assert "over 1000 characters" in r.observation and r.done and r.info["success"] is False
    assert r.info["element_correct"] is False and r.info["operation_f1"] == 0.0
    with pytest.raises(EnvStateError, match="reset"):
        env.step("CLICK [12]")
    env.reset(task)
    assert env.step(None).observation.startswith("Invalid action: expected text")  # type: ignore[arg-type]
    r = env.step("CLICK [999]")  # parses: a wrong element, scored, not an invalid action
    assert r.done and "not an element of this page" in r.observation and r.info["element_correct"] is False
    with pytest.raises(EnvStateError):
        Mind2WebEnv(path=str(tiny_path)).step("CLICK [12]")
    with pytest.raises(TaskError):
        env.reset(Task(env="sql", id="x", instruction="q"))
    with pytest.raises(TaskError, match="payload"):
        env.reset(Task(env="mind2web", id="x", instruction="q"))


def test_split_by_website_and_options(tiny_path):
    env = Mind2WebEnv(path=str(tiny_path))
    train, test = env.tasks("train"), env.tasks("test")
    train_sites = {t.metadata["website"] for t in train}
    test_sites = {t.metadata["website"] for t in test}
    assert train_sites.isdisjoint(test_sites) and len(test_sites) == 2  # one of each domain's two websites
    assert {t.metadata["task_type"] for t in test} == {"Travel", "Shopping"}
    assert all(t.split == "test" for t in test) and all(t.split == "train" for t in train)
    assert [t.id for t in Mind2WebEnv(path=str(tiny_path)).tasks("test")] == [t.id for t in test]
    assert Mind2WebEnv(path=str(tiny_path), held_out_fraction=0.0).tasks("test") == []
    assert env.tasks("train", limit=1) == train[:1] and env.tasks("train", seed=3) == env.tasks("train", seed=3)
    for bad in ({"held_out_fraction": 1.5}, {"max_steps": 0}, {"previous_k": -1}):
        with pytest.raises(ValueError):
            Mind2WebEnv(path=str(tiny_path), **bad)
    with pytest.raises(ValueError, match="split"):
        env.tasks("dev")
    with pytest.raises(ValueError, match="limit"):
        env.tasks("train", limit=-1)


def test_bad_files_and_missing_data(tmp_path, monkeypatch):
    with pytest.raises(EnvUnavailable, match=r"path=.*LIFEMEM_MIND2WEB"):
        Mind2WebEnv(path=str(tmp_path / "none.jsonl"))
    monkeypatch.setenv("LIFEMEM_MIND2WEB", str(tmp_path / "none.jsonl"))
    with pytest.raises(EnvUnavailable, match="LIFEMEM_MIND2WEB"):
        Mind2WebEnv()
    monkeypatch.setenv("LIFEMEM_MIND2WEB", str(_write(tmp_path / "env.jsonl", TINY[:1])))
    assert len(Mind2WebEnv().tasks("train") + Mind2WebEnv().tasks("test")) == 3
    cases = {
        "not json {": r"bad0\.jsonl:1: not JSON",
        json.dumps({"task": "Task: x", "messages": []}): "lacks line",
        json.dumps({**TINY[2], "messages": "__import__('os').system('true')"}): "neither a Python list nor JSON",
        json.dumps({**TINY[2], "messages": [_user(PAGE_B0), _agent("PRESS [1]", "x")]}): "not 'Action:",
        json.dumps(
            {**TINY[2], "messages": [{"role": "user", "content": "no page"}, _agent("CLICK [1]", "x")]}
        ): "Observation",
    }
    for i, (line, match) in enumerate(cases.items()):
        bad = tmp_path / f"bad{i}.jsonl"
        bad.write_text(line + "\n", encoding="utf-8")
        with pytest.raises(TaskError, match=match):
            Mind2WebEnv(path=str(bad))
    with pytest.raises(TaskError, match="share source_line"):
        Mind2WebEnv(path=str(_write(tmp_path / "dup.jsonl", [TINY[2], {**TINY[3], "source_line": 2}])))


def test_messages_forms_and_page_bound(tmp_path):
    turns = [_user(PAGE_B0, "x"), _agent("CLICK [12]", "d")]
    assert parse_messages(turns, "w") == parse_messages(repr(turns), "w") == parse_messages(json.dumps(turns), "w")
    with pytest.raises(TaskError, match="w: message 0 must be"):
        parse_messages([{"role": "user"}], "w")
    big = "<html> <a id=1> x </a> " + "<p> filler </p> " * 2000 + "</html>"
    rec = _record("big", "Travel", "x", [_user(big, "x"), _agent("CLICK [1]", "[link] x -> CLICK")], 0, False)
    env = Mind2WebEnv(path=str(_write(tmp_path / "big.jsonl", [rec])))
    obs, info = env.reset((env.tasks("train") + env.tasks("test"))[0])
    assert len(obs) <= MAX_PAGE_CHARS + 60 and obs.endswith(f"[page cut at {MAX_PAGE_CHARS} characters]")
    assert info["valid_actions"] == ["CLICK [1]"]


def test_registry_builds_it_and_react_agent_runs_it(tiny_path):
    from support.openai_stub import OpenAIStub, Reply

    from lifemem_ray.lab.agents import ReActAgent
    from lifemem_ray.llm.llm_config import LLMConfig

    env = make_env("mind2web", path=str(tiny_path))
    assert isinstance(env, Mind2WebEnv)
    task = _by_id(env)["m2w-000-01"]
    # not a listed action (refused), then the listed one in other case (matched to it)
    replies = iter(
        [{"thought": "t", "action": "TYPE [6068] [Paris]"}, {"thought": "t", "action": "type [6068] [boston]"}]
    )
    with OpenAIStub(responder=lambda r: Reply.json(next(replies))) as stub:
        config = LLMConfig(backend="openai", base_url=stub.base_url, model="stub", timeout_s=10, max_retries=1)
        agent = ReActAgent(config)
        try:
            result = run_episode(env, agent, task, trajectory_id="react", limits=EpisodeLimits(max_steps=3))
        finally:
            agent.close()
        prompts = [r["messages"][1]["content"] for r in stub.requests]
    assert result.success and [s.action for s in result.trajectory.steps] == ["invalid_action", "TYPE [6068] [Boston]"]
    assert len(prompts) == 2 and all("\n- TYPE [6068] [Boston]\n" in p for p in prompts)
    assert f"<observation>{PAGE_A1}</observation>" in prompts[0]  # the page as data, in its section
    assert f"The page is unchanged:\n{PAGE_A1}</observation>" in prompts[1]  # shown again after the refusal
    env.close()


# --------------------------------------------------------------------------- the shared file


def test_shared_counts_and_website_split(shared):
    train, test = shared.tasks("train"), shared.tasks("test")
    assert len(train) + len(test) == 633
    assert len({t.metadata["trajectory"] for t in train + test}) == 81
    train_sites = {t.metadata["website"] for t in train}
    test_sites = {t.metadata["website"] for t in test}
    assert len(train_sites | test_sites) == 33 and train_sites.isdisjoint(test_sites)
    assert len(test_sites) == 10  # 30% of each domain's websites: 4 of 14, 3 of 10, 3 of 9
    assert (
        {t.metadata["task_type"] for t in test}
        == {t.metadata["task_type"] for t in train}
        == {
            "Travel",
            "Shopping",
            "Entertainment",
        }
    )
    assert [t.id for t in Mind2WebEnv(path=str(MIND2WEB)).tasks("test")] == [t.id for t in test]
    assert {t.metadata["website"] for t in Mind2WebEnv(path=str(MIND2WEB), seed=1).tasks("test")} != test_sites


def test_shared_gold_succeeds_on_every_step_and_is_listed(shared):
    for task in shared.tasks("train") + shared.tasks("test"):
        obs, info = shared.reset(task)
        assert obs and len(obs) <= MAX_PAGE_CHARS and 1 <= len(info["valid_actions"]) <= 400
        gold = parse_action(shared.gold_actions(task)[0])
        assert any(score_action(parse_action(a), gold)[2] for a in info["valid_actions"]), task.id
        r = run_episode(shared, make_agent("gold"), task, trajectory_id=f"g/{task.id}")
        assert r.success and r.steps == 1, task.id


def test_shared_random_mostly_fails(shared):
    for split in ("train", "test"):
        rows = []
        agent = make_agent("random", seed=0)
        for task in shared.tasks(split):
            obs, info = shared.reset(task)
            agent.start(task, obs, info, None)
            r = shared.step(agent.act(obs, info).action)
            assert r.done
            rows.append((task, r.info))
        report = summarise(rows)
        # measured (seed 0): step success 0.17 train, 0.25 test; no trajectory fully right
        assert report["step_sr"] < 0.35 and report["element_acc"] < 0.5 and report["task_sr"] < 0.05, split


def test_task_counts_cap_each_split_in_file_order(shared):
    full = {split: shared.tasks(split) for split in ("train", "test")}
    capped = Mind2WebEnv(path=str(MIND2WEB), n_train=5, n_test=2)
    assert capped.tasks("train") == full["train"][:5] and capped.tasks("test") == full["test"][:2]
    with pytest.raises(InvalidArgumentError, match="n_train"):
        Mind2WebEnv(path=str(MIND2WEB), n_train=-1)
    for bad in ({"max_steps": 101}, {"previous_k": 101}, {"max_steps": 0}):
        with pytest.raises(InvalidArgumentError, match=next(iter(bad))):
            Mind2WebEnv(path=str(MIND2WEB), **bad)
