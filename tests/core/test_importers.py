"""Importers: native round trip, chat conversion per style, errors with place, real data."""

from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import sys
from collections import Counter
from pathlib import Path

import pytest

from lifemem_ray.core.importers import (
    ImportReport,
    InvalidTrajectoryError,
    RecordError,
    iter_jsonl,
    parse_record,
    read_jsonl,
    split_agent_turn,
    write_jsonl,
)
from lifemem_ray.core.model import Outcome, Step, Trajectory


def shared_data_dir() -> Path:
    root = os.environ.get("LIFEMEM_SHARED_DIR")
    base = Path(root) if root else Path(__file__).resolve().parents[3] / "shared"
    return base / "data" / "lifemem-trainset"


def _lines(path: Path, *records: object, raw: bytes = b"") -> Path:
    path.write_bytes(b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in records) + raw)
    return path


def _chat(env: str | None, *turns: tuple[str, str], task: str = "do it", **extra: object) -> dict:
    rec: dict = {"task": task, "messages": [{"role": r, "content": c} for r, c in turns], **extra}
    if env is not None:
        rec["env"] = env
    return rec


def _norm(s: str) -> str:
    return " ".join(s.split())


def _flat(t: Trajectory) -> str:
    parts = [t.initial_observation] + [x for s in t.steps for x in (s.thought, s.action, s.observation)]
    return _norm(" ".join(parts))


# --------------------------------------------------------------------------- native


def test_native_round_trip(tmp_path: Path) -> None:
    trajs = [
        Trajectory(
            env="webshop",
            task="buy a mug — 中文 ✓",
            steps=(Step("search[mug]", "need a mug", "results"), Step("click[Buy Now]")),
            outcome=Outcome(True, 1.0),
            id="t-1",
            initial_observation="WebShop",
            metadata={"k": [1, 2.5, None, {"x": "y"}], "src": 3},
        ),
        Trajectory(env="toolqa", task="q", steps=(Step("Finish[1]"),)),
    ]
    for name in ("out.jsonl", "out.jsonl.gz"):
        path = tmp_path / name
        assert write_jsonl(trajs, path) == 2
        back = list(iter_jsonl(path))
        assert back == trajs
        assert back[1].id == trajs[1].id and back[1].id.startswith("h-")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "out.jsonl.gz"]  # no temp files left


def test_write_is_atomic_on_failure(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    path.write_text("old\n")
    good = Trajectory(env="e", task="t", steps=(Step("a"),))
    with pytest.raises(TypeError, match="item 1"):
        write_jsonl([good, "not a trajectory"], path)  # type: ignore[list-item]
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]


def test_native_env_argument_fills_missing_env() -> None:
    t = parse_record({"task": "t", "steps": [{"action": "a"}]}, env="cli-env")
    assert t.env == "cli-env"
    with pytest.raises(InvalidTrajectoryError, match="env: missing"):
        parse_record({"task": "t", "steps": [{"action": "a"}]})


# --------------------------------------------------------------------------- chat styles


def test_chat_hotpotqa_react() -> None:
    rec = _chat(
        "hotpotqa",
        ("user", "Who wrote X?"),
        ("assistant", "Thought 1: I need to search X.\nAction 1: Search[X]"),
        ("user", "Observation 1: X was written by Y."),
        ("assistant", "Thought 2: Y wrote it. Repeated thought."),
        ("assistant", "Thought 2: Y wrote it.\nAction 2: Finish[Y]"),
        task="Who wrote X?",
        source_line=7,
        task_type="bridge",
    )
    t = parse_record(rec)
    assert t.env == "hotpotqa" and t.initial_observation == "Who wrote X?"
    assert [s.action for s in t.steps] == ["Action 1: Search[X]", "", "Action 2: Finish[Y]"]
    assert t.steps[0].thought == "Thought 1: I need to search X."
    assert t.steps[0].observation == "Observation 1: X was written by Y."
    assert t.steps[1].thought == "Thought 2: Y wrote it. Repeated thought."  # agent turns in a row: separate steps
    assert t.outcome == Outcome()
    assert t.metadata == {"source_line": 7, "task_type": "bridge"}
    assert t.id.startswith("h-")


def test_chat_webshop_roles_inverted_and_first_turn_split() -> None:
    rec = _chat(
        "webshop",
        ("user", "i need a red mug, price lower than 20.00 dollars\n\nsearch[red mug]"),
        ("assistant", "[Back to Search]\nPage 1\n[B0ABCDEFGH]\nRed Mug\n$9.99"),
        ("user", "click[B0ABCDEFGH]"),
        ("assistant", "[< Prev]\nRed Mug\n[Buy Now]"),
        ("user", "click[Buy Now]"),
        task="i need a red mug, price lower than 20.00 dollars\n\n",
    )
    t = parse_record(rec)
    assert t.initial_observation == "i need a red mug, price lower than 20.00 dollars"
    assert [s.action for s in t.steps] == ["search[red mug]", "click[B0ABCDEFGH]", "click[Buy Now]"]
    assert all(s.thought == "" for s in t.steps)
    assert t.steps[0].observation.startswith("[Back to Search]")
    assert t.steps[2].observation == ""


def test_chat_webshop_first_turn_without_action_is_observation() -> None:
    t = parse_record(_chat("webshop", ("user", "instruction only"), ("assistant", "page"), ("user", "click[x]")))
    assert t.initial_observation == "instruction only\npage"
    assert [s.action for s in t.steps] == ["click[x]"]


def test_chat_taubench_action_blocks_and_final_reply() -> None:
    rec = _chat(
        "taubench",
        ("user", "Cancel order #W1."),
        ("assistant", 'Action:\n{"name": "get_order_details", "arguments": {"order_id": "#W1"}}'),
        ("user", "API output: {...}"),
        ("assistant", "I've finished the task. Your order is cancelled."),
        ("user", "Thanks!"),
    )
    t = parse_record(rec)
    assert t.steps[0].action.startswith("Action:\n{") and t.steps[0].thought == ""
    assert t.steps[1].action == "I've finished the task. Your order is cancelled."
    assert t.steps[1].observation == "Thanks!"


def test_chat_toolqa_thought_then_tool_line_and_success() -> None:
    rec = _chat(
        "toolqa",
        ("user", "Open price on 2003-12-10?"),
        ("assistant", "Load the database first.\nLoadDB[coffee]"),
        ("user", "Loaded."),
        ("assistant", "Action 4: Finish[64.25]\nSQLInterpreter[SELECT 1;]"),  # the labelled call is the executed one
        ("user", "Answer is CORRECT"),
    )
    t = parse_record(rec)
    assert (t.steps[0].thought, t.steps[0].action) == ("Load the database first.", "LoadDB[coffee]")
    assert (t.steps[1].thought, t.steps[1].action) == ("", "Action 4: Finish[64.25]\nSQLInterpreter[SELECT 1;]")
    assert t.outcome.success is True and t.metadata["outcome_source"] == "inferred"
    wrong = dict(rec, messages=[*rec["messages"][:-1], {"role": "user", "content": "Answer is INCORRECT"}])
    assert parse_record(wrong).outcome.success is False
    explicit = dict(rec, success=False, reward=0.25)
    assert parse_record(explicit).outcome == Outcome(False, 0.25)
    assert "outcome_source" not in parse_record(explicit).metadata


def test_chat_toolqa_turn_without_tool_is_thought_only() -> None:
    t = parse_record(_chat("toolqa", ("user", "q"), ("assistant", "Observation 2: 1.5"), ("user", "filtered")))
    assert t.steps[0] == Step(action="", thought="Observation 2: 1.5", observation="filtered")


def test_chat_miniwob_code_is_the_action() -> None:
    code = '```# fill the form\nagent.click_xpath("//input")\nagent.type("abc")\nagent.press("enter")```'
    t = parse_record(_chat("miniwob", ("user", "Observation:\nEnter abc.\nAction: "), ("assistant", code), task=""))
    assert t.steps[0].action == code and t.steps[0].thought == ""
    assert t.task == "" and t.query_text.startswith("Observation:")


@pytest.mark.parametrize(
    ("env", "turn", "thought", "action"),
    [
        ("lifelong", "I will query.\n\nAction: Operation\n```sql\nSELECT 1;\n```", "I will query.",
         "Action: Operation\n```sql\nSELECT 1;\n```"),
        ("lifelong", "OK.", "", "OK."),
        ("mind2web", "Action: `CLICK [110]` ([svg]   -> CLICK)", "", "Action: `CLICK [110]` ([svg]   -> CLICK)"),
        ("scienceworld", "open door to kitchen", "", "open door to kitchen"),
        ("apibank", "[ToolSearcher(keywords='x')]", "", "[ToolSearcher(keywords='x')]"),
        ("someenv", "I think so.\nsearch[a b]", "I think so.", "search[a b]"),
        ("someenv", "Just a reply.", "", "Just a reply."),
    ],
)  # fmt: skip
def test_split_styles(env: str, turn: str, thought: str, action: str) -> None:
    t = parse_record(_chat(env, ("user", "task"), ("assistant", turn)))
    assert (t.steps[0].thought, t.steps[0].action) == (thought, action)


def test_split_agent_turn_reassembles_the_turn() -> None:
    turn = "Thought 1: plan\n  Action 1: Search[X]\nObservation 1: echoed"
    thought, action = split_agent_turn(turn, "react")
    assert (thought, action) == ("Thought 1: plan", "Action 1: Search[X]\nObservation 1: echoed")
    assert _norm(thought + " " + action) == _norm(turn)


def test_chat_system_messages_and_env_argument() -> None:
    rec = _chat(None, ("system", "You are an agent."), ("user", "task"), ("assistant", "go north"),
                ("system", "Step limit near."), ("user", "ok"))  # fmt: skip
    t = parse_record(rec, env="textworld")
    assert t.env == "textworld"
    assert t.initial_observation == "System: You are an agent.\ntask"
    assert t.steps[0].observation == "System: Step limit near.\nok"
    assert parse_record(dict(rec, env="recorded"), env="arg").env == "recorded"
    with pytest.raises(InvalidTrajectoryError, match="env: missing"):
        parse_record(rec)


def test_chat_ids_metadata_and_extras() -> None:
    base = _chat("e", ("user", "t"), ("assistant", "act"))
    assert parse_record(dict(base, id=42)).id == "42"
    assert parse_record(dict(base, id="abc")).id == "abc"
    with pytest.raises(InvalidTrajectoryError, match="id: expected a string or an integer, got boolean"):
        parse_record(dict(base, id=True))
    rec = dict(base, messages=[{"role": "user", "content": "t", "name": "bob"}, {"role": "assistant", "content": "a"}])
    assert parse_record(rec).metadata["message_extras"] == [{"index": 0, "name": "bob"}]
    with pytest.raises(InvalidTrajectoryError, match=r"source: conflicts with metadata\.source"):
        parse_record(dict(base, source="a", metadata={"source": "b"}))


def test_chat_empty_agent_turn_is_recorded_not_fatal() -> None:
    t = parse_record(
        _chat("e", ("user", "t"), ("assistant", "a1"), ("user", "o1"), ("assistant", "  "), ("user", "o2"))
    )
    assert len(t.steps) == 1 and t.steps[0].observation == "o1\no2"
    assert t.metadata["empty_agent_turns"] == [3]
    with pytest.raises(InvalidTrajectoryError, match="no non-empty 'assistant' turn"):
        parse_record(_chat("e", ("user", "t"), ("assistant", " ")))


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        ({"messages": [{"role": "user", "content": "x"}], "env": "e"}, "task: missing"),
        ({"task": 3, "messages": [], "env": "e"}, "task: expected a string, got integer"),
        ({"task": "t", "messages": [], "env": "e"}, "messages: empty list"),
        ({"task": "t", "messages": "hi", "env": "e"}, "messages: expected a list, got string"),
        ({"task": "t", "env": "e", "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
          {"role": "user", "content": "c"}, {"role": "tool", "content": "d"}]},
         "messages[3].role: expected 'user', 'assistant' or 'system', got 'tool'"),
        ({"task": "t", "env": "e", "messages": [{"role": 1, "content": "a"}]},
         "messages[0].role: expected 'user', 'assistant' or 'system', got integer"),
        ({"task": "t", "env": "e", "messages": [{"role": "user", "content": None}]},
         "messages[0].content: expected a string, got null"),
        ({"task": "t", "env": "e", "messages": [{"role": "user"}]}, "messages[0].content: missing"),
        ({"task": "t", "env": "e", "messages": ["hi"]}, "messages[0]: expected an object, got string"),
        ({"task": "t", "env": "e", "messages": [{"role": "user", "content": "a\x00"}]},
         "messages[0].content: contains a NUL character"),
        ({"task": "t", "env": "e", "messages": [{"role": "user", "content": "a"}]}, "no non-empty 'assistant' turn"),
        ({"task": "t", "env": "e", "steps": [], "messages": []}, "both 'messages' (chat) and 'steps' (native)"),
        ({"task": "t", "env": "e"}, "neither 'messages' (chat format) nor 'steps' (native format)"),
        ({"task": "t", "env": "e", "success": "yes", "messages": [{"role": "assistant", "content": "a"}]},
         "success: expected true/false/null"),
        ([1, 2], "record: expected an object, got list"),
    ],
)  # fmt: skip
def test_record_errors_name_the_field(record: object, reason: str) -> None:
    with pytest.raises(InvalidTrajectoryError) as info:
        parse_record(record)
    assert reason in str(info.value)


# --------------------------------------------------------------------------- files and errors


def test_errors_carry_path_line_and_reason(tmp_path: Path) -> None:
    good = _chat("e", ("user", "t"), ("assistant", "a"))
    cases = {
        "bad_json": (b'{"task": "t", "messages": [}\n', "invalid JSON"),
        "missing_task": (json.dumps({"messages": [{"role": "user", "content": "x"}], "env": "e"}).encode() + b"\n",
                         "task: missing"),
        "wrong_role": (json.dumps(_chat("e", ("tool", "x"))).encode() + b"\n", "messages[0].role"),
        "empty_messages": (b'{"task": "t", "env": "e", "messages": []}\n', "messages: empty list"),
        "not_utf8": (b'{"task": "caf\xe9", "env": "e", "messages": []}\n', "not UTF-8: byte 0xe9 at column 14"),
        "truncated": (b'{"task": "t", "env": "e", "messa', "the last line has no newline"),
        "nan": (b'{"task": "t", "env": "e", "reward": NaN, "messages": []}\n', "NaN is not valid JSON"),
        "dup_key": (b'{"task": "t", "task": "u", "env": "e", "messages": []}\n', "duplicate key 'task'"),
        "surrogate": (b'{"task": "\\ud800", "env": "e", "messages": []}\n', "unpaired UTF-16 surrogate"),
    }  # fmt: skip
    for name, (raw, reason) in cases.items():
        path = _lines(tmp_path / f"{name}.jsonl", good, raw=b"\n" + raw)
        it = iter_jsonl(path)
        assert next(it).task == "do it"
        with pytest.raises(RecordError) as info:
            next(it)
        err = info.value
        assert (err.path, err.line) == (str(path), 3), name  # blank line 2 counts
        assert reason in err.reason, (name, err.reason)
        assert str(err) == f"{path}:3: {err.reason}"
        assert isinstance(err, InvalidTrajectoryError)


def test_truncated_last_line_that_is_complete_json_still_parses(tmp_path: Path) -> None:
    rec = _chat("e", ("user", "t"), ("assistant", "a"))
    path = tmp_path / "x.jsonl"
    path.write_bytes(json.dumps(rec).encode())  # no trailing newline
    assert len(list(iter_jsonl(path))) == 1


def test_skip_invalid_counts_and_caps_errors(tmp_path: Path) -> None:
    good = _chat("e", ("user", "t"), ("assistant", "a"))
    body = b"".join([json.dumps(good).encode() + b"\n", b"\n", b"not json\n"] * 120)
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(body + b"\xff\n")
    report = ImportReport()
    got = list(iter_jsonl(path, skip_invalid=True, report=report))
    assert len(got) == 120
    assert (report.read, report.valid, report.invalid) == (241, 120, 121)
    assert len(report.errors) == 100 and report.errors[0].line == 3
    assert report.by_env == {"e": 120}
    trajs, rep2 = read_jsonl([path, path], skip_invalid=True)
    assert len(trajs) == 240 and rep2.invalid == 242
    assert "invalid 242" in rep2.summary()


def test_gzip_stdin_bom_and_crlf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rec = _chat("e", ("user", "t"), ("assistant", "a"))
    data = ("\ufeff" + json.dumps(rec) + "\r\n" + json.dumps(rec) + "\n").encode()
    gz = tmp_path / "x.jsonl.gz"
    gz.write_bytes(gzip.compress(data))
    assert len(list(iter_jsonl(gz))) == 2
    renamed = tmp_path / "x.data"  # gzip is recognised by content, not by name
    renamed.write_bytes(gzip.compress(data))
    assert len(list(iter_jsonl(renamed))) == 2
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data + b"{bad\n")))
    it = iter_jsonl("-")
    assert [t.env for t in (next(it), next(it))] == ["e", "e"]
    with pytest.raises(RecordError, match=r"^<stdin>:3: invalid JSON"):
        next(it)


def test_corrupt_gzip_is_a_record_error(tmp_path: Path) -> None:
    rec = _chat("e", ("user", "t"), ("assistant", "a"))
    blob = gzip.compress((json.dumps(rec) + "\n").encode() * 50)
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(RecordError, match="cannot read"):
        list(iter_jsonl(path))


def test_record_error_pickles() -> None:
    err = RecordError("a.jsonl", 4, "task: missing")
    back = pickle.loads(pickle.dumps(err))
    assert (back.path, back.line, back.reason, str(back)) == ("a.jsonl", 4, "task: missing", "a.jsonl:4: task: missing")


def test_bad_format_argument() -> None:
    with pytest.raises(ValueError, match="fmt"):
        parse_record({}, fmt="csv")


# --------------------------------------------------------------------------- real data

REAL = shared_data_dir()


@pytest.fixture(scope="module")
def real() -> tuple[list[Trajectory], list[dict], ImportReport]:
    if not REAL.is_dir():
        pytest.skip(f"shared data not found at {REAL}")
    files = sorted(REAL.glob("*.jsonl"))
    trajs, report = read_jsonl(files)
    records = [json.loads(line) for f in files for line in f.read_text(encoding="utf-8").splitlines() if line.strip()]
    return trajs, records, report


def test_real_data_imports_without_error(real) -> None:
    trajs, records, report = real
    assert len(trajs) == len(records) == 1202
    assert (report.read, report.valid, report.invalid) == (1202, 1202, 0)
    assert report.by_env == dict(Counter(r["env"] for r in records))
    assert all(t.metadata["source_line"] == r["source_line"] for t, r in zip(trajs, records, strict=True))


def test_real_webshop_actions_are_search_or_click(real) -> None:
    trajs, _, _ = real
    shop = [t for t in trajs if t.env == "webshop"]
    assert shop and all(s.action.startswith(("search[", "click[")) and not s.thought for t in shop for s in t.steps)
    assert all(t.steps[0].action.startswith("search[") and t.steps[-1].action == "click[Buy Now]" for t in shop)
    assert all(t.initial_observation == t.task.rstrip() for t in shop)


def test_real_outcomes_and_duplicate_ids(real) -> None:
    trajs, _, _ = real
    assert all(t.outcome.success is True for t in trajs if t.env == "toolqa")
    assert all(t.outcome == Outcome() for t in trajs if t.env != "toolqa")
    mini = Counter(t.id for t in trajs if t.env == "miniwob")
    assert sum(n - 1 for n in mini.values()) == 20
    assert len({t.id for t in trajs if t.env == "toolqa"}) == 469  # no two toolqa records are identical


def test_real_data_nothing_is_lost(real) -> None:
    trajs, records, _ = real
    for t, r in zip(trajs, records, strict=True):
        flat = _flat(t)
        for i, m in enumerate(r["messages"]):
            assert _norm(m["content"]) in flat, (r["env"], r["source_line"], i)


def test_iter_jsonl_checks_arguments_at_call_time(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        iter_jsonl(tmp_path / "absent.jsonl")
    with pytest.raises(ValueError, match="fmt"):
        iter_jsonl(tmp_path / "absent.jsonl", fmt="xml")
