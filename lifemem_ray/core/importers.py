"""JSONL in and out: native trajectories and the paper's chat records.

Importing is validation only (the store decides idempotency). Two promises:

* **Errors name the place.** A bad line raises :class:`RecordError` whose text is
  ``PATH:LINE: reason``; with ``skip_invalid`` it is counted and skipped instead.
* **Nothing is lost.** A chat record becomes a :class:`Trajectory` whose
  ``initial_observation`` + thoughts + actions + observations, in order, hold every
  message's text. An agent turn is cut at one point: the text before the action is
  the thought (trailing whitespace trimmed), the text from the action on is the
  action, so ``thought + action`` re-assembles the turn. Labels such as
  ``Action 1:`` stay with the action; unknown record fields go to metadata.

Chat conversion (:func:`parse_record` with ``fmt="chat"``):

* ``ROLE_MAPS`` says which role is the agent (``assistant`` unless listed; WebShop's
  roles are inverted). Leading non-agent turns and system messages before the first
  agent turn form ``initial_observation``; each agent turn is one step, and the
  turns after it up to the next agent turn are its observation (joined by ``"\\n"``).
  Later system messages join the observation, prefixed ``"System: "``.
* ``TURN_STYLES`` says where the action starts in an agent turn. In every style the
  first line labelled ``Action:`` / ``Action N:`` starts it (ToolQA shows the
  labelled call is the executed one: ``source_line`` 197 finishes correctly with a
  stray call after its labelled ``Finish``). Without a label: ``tool_line`` cuts at
  the first ``Tool[...]`` / ``[Api(...)]`` line, else the turn is thought only;
  ``react`` does the same; ``action_block`` takes the whole turn as the action (a
  plain reply to the user); ``code`` cuts at the first code fence or ``agent.`` call;
  ``plain`` takes the whole turn; ``auto`` (unknown envs) tries label, tool line,
  code fence, then the whole turn.
* For WebShop the first agent turn is the task text followed by the first action:
  the text before the action goes to ``initial_observation``.
* An agent turn that is only whitespace makes no step; its index is kept in
  ``metadata["empty_agent_turns"]`` and the turns after it join the previous
  observation.
* Outcome: an ``outcome`` object, or ``success`` / ``reward`` fields; else, for
  ToolQA, a last observation ``Answer is CORRECT`` (``INCORRECT`` / ``WRONG``)
  gives success True (False) and ``metadata["outcome_source"] = "inferred"``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import io
import json
import math
import os
import re
import sys
import tempfile
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from lifemem_ray.core.errors import ArgumentTypeError, InvalidArgumentError, InvalidTrajectoryError
from lifemem_ray.core.model import Outcome, Step, Trajectory
from lifemem_ray.core.tenancy import id_key

__all__ = [
    "FORMATS",
    "ROLE_MAPS",
    "TURN_STYLES",
    "CheckedFile",
    "ImportReport",
    "RecordError",
    "check_file",
    "iter_jsonl",
    "parse_record",
    "read_jsonl",
    "split_agent_turn",
    "write_jsonl",
]

FORMATS = ("auto", "native", "chat")
MAX_KEPT_ERRORS = 100
STORE_CHECK_BATCH = 1024  # ids checked against the memory per call while a file is validated
DEFAULT_AGENT_ROLE = "assistant"

#: env (lower case) -> the chat role that is the agent; envs not listed use "assistant".
ROLE_MAPS: dict[str, str] = {
    "apibank": "assistant",
    "hotpotqa": "assistant",
    "lifelong": "assistant",
    "mind2web": "assistant",
    "miniwob": "assistant",
    "scienceworld": "assistant",
    "taubench": "assistant",
    "toolqa": "assistant",
    "webshop": "user",  # as published: user turns are the agent's actions
}

#: env (lower case) -> how an agent turn splits into thought and action; default "auto".
TURN_STYLES: dict[str, str] = {
    "apibank": "tool_line",
    "hotpotqa": "react",
    "lifelong": "action_block",
    "mind2web": "action_block",
    "miniwob": "code",
    "scienceworld": "plain",
    "alfworld": "plain",
    "taubench": "action_block",
    "toolqa": "tool_line",
    "webshop": "tool_line",
}
_STYLES = frozenset({"react", "action_block", "tool_line", "code", "plain", "auto"})

#: envs whose first agent turn starts with the task text (split off into initial_observation).
TASK_IN_FIRST_AGENT_TURN = frozenset({"webshop"})

_ROLES = ("user", "assistant", "system")
_CHAT_FIELDS = frozenset({"task", "messages", "env", "id", "success", "reward", "outcome", "metadata"})

_ACTION_LABEL = re.compile(r"^[ \t]*Action[ \t]*\d*[ \t]*:", re.M)
_TOOL_LINE = re.compile(r"^[ \t]*(?:[A-Za-z_][\w.]*\[|\[[A-Za-z_][\w.]*\()", re.M)
_CODE_FENCE = re.compile(r"```")
_AGENT_CALL = re.compile(r"^[ \t]*agent\.\w+\(", re.M)
_VERDICT = re.compile(r"^\s*Answer is (CORRECT|INCORRECT|WRONG)\b", re.I)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


class RecordError(InvalidTrajectoryError):
    """A record that could not be imported; ``str`` is ``PATH:LINE: reason``."""

    def __init__(self, path: str, line: int, reason: str) -> None:
        self.path = str(path)
        self.line = int(line)
        self.reason = str(reason)
        super().__init__(f"{self.path}:{self.line}: {self.reason}")

    def __reduce__(self) -> tuple[Any, ...]:  # picklable across processes (Ray workers)
        return (type(self), (self.path, self.line, self.reason))


@dataclass
class ImportReport:
    """Counts of one import: lines read (blank lines excluded), valid, invalid, by env."""

    read: int = 0
    valid: int = 0
    invalid: int = 0
    errors: list[RecordError] = field(default_factory=list)  # the first MAX_KEPT_ERRORS only
    by_env: dict[str, int] = field(default_factory=dict)

    def add_valid(self, traj: Trajectory) -> None:
        self.valid += 1
        self.by_env[traj.env] = self.by_env.get(traj.env, 0) + 1

    def add_error(self, err: RecordError) -> None:
        self.invalid += 1
        if len(self.errors) < MAX_KEPT_ERRORS:
            self.errors.append(err)

    def summary(self) -> str:
        envs = ", ".join(f"{k}={v}" for k, v in sorted(self.by_env.items()))
        return f"read {self.read}, valid {self.valid}, invalid {self.invalid}" + (f" ({envs})" if envs else "")


# --------------------------------------------------------------------------- records


def parse_record(data: Any, *, fmt: str = "auto", env: str | None = None, tenant: str | None = None) -> Trajectory:
    """One decoded JSON value -> a Trajectory; raises InvalidTrajectoryError naming the field.
    ``env`` and ``tenant`` fill in a record that does not name its own."""
    if fmt not in FORMATS:
        raise InvalidArgumentError(f"expected one of {', '.join(FORMATS)}, got {fmt!r}", where="fmt")
    if not isinstance(data, Mapping):
        raise InvalidTrajectoryError(f"expected an object, got {_type_name(data)}", where="record")
    if fmt == "auto":
        has_messages, has_steps = "messages" in data, "steps" in data
        if has_messages and has_steps:
            raise InvalidTrajectoryError(
                "has both 'messages' (chat) and 'steps' (native); give the format", where="record"
            )
        if not (has_messages or has_steps):
            raise InvalidTrajectoryError("neither 'messages' (chat format) nor 'steps' (native format)", where="record")
        fmt = "chat" if has_messages else "native"
    if fmt == "native":
        return Trajectory.from_dict(data, env=env, tenant=tenant)
    traj = _chat_to_trajectory(data, env)
    return traj if tenant is None or tenant == traj.tenant else dataclasses.replace(traj, tenant=tenant)


def split_agent_turn(text: str, style: str = "auto") -> tuple[str, str]:
    """Split an agent turn into (thought, action) at one cut point; see the module doc."""
    if style not in _STYLES:
        raise InvalidArgumentError(f"expected one of {sorted(_STYLES)}, got {style!r}", where="style")
    cut = _action_start(text, style)
    if cut is None:  # no action in this turn: all thought
        return text.rstrip(), ""
    return text[:cut].rstrip(), text[cut:]


def _action_start(text: str, style: str) -> int | None:
    m = _ACTION_LABEL.search(text)
    if m:
        return _skip_blank(text, m.start())
    if style == "plain" or style == "action_block":
        return _skip_blank(text, 0)
    if style in ("tool_line", "react", "auto"):
        m = _TOOL_LINE.search(text)
        if m:
            return _skip_blank(text, m.start())
        if style != "auto":
            return None
    # code, or auto without label/tool line
    m = _CODE_FENCE.search(text) or _AGENT_CALL.search(text)
    if m:
        return _skip_blank(text, m.start())
    return _skip_blank(text, 0)


def _skip_blank(text: str, pos: int) -> int:
    n = len(text)
    while pos < n and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _chat_to_trajectory(data: Mapping[str, Any], env_arg: str | None) -> Trajectory:
    if "task" not in data:
        raise InvalidTrajectoryError("missing", where="task")
    task = data["task"]
    if not isinstance(task, str):
        raise InvalidTrajectoryError(f"expected a string, got {_type_name(task)}", where="task")
    env = data.get("env")
    if env is None:
        env = env_arg
    if env is None:
        raise InvalidTrajectoryError("missing (give it in the record or with --env)", where="env")
    if not isinstance(env, str):
        raise InvalidTrajectoryError(f"expected a string, got {_type_name(env)}", where="env")
    messages, extras = _check_messages(data.get("messages"))

    key = env.strip().lower()
    agent_role = ROLE_MAPS.get(key, DEFAULT_AGENT_ROLE)
    style = TURN_STYLES.get(key, "auto")
    split_first = key in TASK_IN_FIRST_AGENT_TURN

    initial: list[str] = []
    steps: list[tuple[str, str, list[str]]] = []  # thought, action, observation parts
    empty_turns: list[int] = []
    for i, (role, content) in enumerate(messages):
        if role == agent_role:
            if not content.strip():
                empty_turns.append(i)
                continue
            if split_first and not steps:
                prefix, content = _split_task_from_turn(content, task)
                if prefix:
                    initial.append(prefix)
                if not content:  # the turn held only the task text
                    continue
            thought, action = split_agent_turn(content, style)
            steps.append((thought, action, []))
            continue
        text = "System: " + content if role == "system" else content
        (steps[-1][2] if steps else initial).append(text)

    if not steps:
        raise InvalidTrajectoryError(
            f"no non-empty {agent_role!r} turn, so no step (the agent's role in env {env!r} is {agent_role!r})",
            where="messages",
        )
    metadata = _chat_metadata(data, extras)
    if empty_turns:
        metadata["empty_agent_turns"] = empty_turns
    outcome = _chat_outcome(data, key, messages, agent_role, metadata)
    return Trajectory(
        env=env,
        task=task,
        steps=tuple(Step(action=a, thought=t, observation="\n".join(o)) for t, a, o in steps),
        outcome=outcome,
        id=_record_id(data),
        initial_observation="\n".join(initial),
        metadata=metadata,
    )


def _check_messages(raw: Any) -> tuple[list[tuple[str, str]], list[dict[str, Any]]]:
    if raw is None:
        raise InvalidTrajectoryError("missing", where="messages")
    if not isinstance(raw, list):
        raise InvalidTrajectoryError(f"expected a list, got {_type_name(raw)}", where="messages")
    if not raw:
        raise InvalidTrajectoryError("empty list", where="messages")
    out: list[tuple[str, str]] = []
    extras: list[dict[str, Any]] = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise InvalidTrajectoryError(f"expected an object, got {_type_name(m)}", where=where)
        if "role" not in m:
            raise InvalidTrajectoryError("missing", where=f"{where}.role")
        role = m["role"]
        if not isinstance(role, str) or role not in _ROLES:
            got = repr(role) if isinstance(role, str) else _type_name(role)
            raise InvalidTrajectoryError(f"expected 'user', 'assistant' or 'system', got {got}", where=f"{where}.role")
        if "content" not in m:
            raise InvalidTrajectoryError("missing", where=f"{where}.content")
        content = m["content"]
        if not isinstance(content, str):
            raise InvalidTrajectoryError(f"expected a string, got {_type_name(content)}", where=f"{where}.content")
        if "\x00" in content:
            raise InvalidTrajectoryError("contains a NUL character", where=f"{where}.content")
        if len(m) > 2:
            extras.append({"index": i, **{k: v for k, v in m.items() if k not in ("role", "content")}})
        out.append((role, content))
    return out, extras


def _split_task_from_turn(content: str, task: str) -> tuple[str, str]:
    """WebShop's first agent turn: (task text, action turn); ("", content) if it starts with the action.

    The action is looked for after the record's task text when the turn starts with it,
    so a task line that happens to look like a call is not taken for the action.
    """
    head = task.rstrip()
    pos = len(head) if head and content.startswith(head) else 0
    m = _ACTION_LABEL.search(content, pos) or _TOOL_LINE.search(content, pos)
    if m is None:
        return content.rstrip(), ""
    start = _skip_blank(content, m.start())
    return content[:start].rstrip(), content[start:]


def _chat_metadata(data: Mapping[str, Any], extras: list[dict[str, Any]]) -> dict[str, Any]:
    raw = data.get("metadata")
    if raw is not None and not isinstance(raw, Mapping):
        raise InvalidTrajectoryError(f"expected an object, got {_type_name(raw)}", where="metadata")
    metadata = dict(raw or {})
    for key, value in data.items():
        if key in _CHAT_FIELDS:
            continue
        if key in metadata and metadata[key] != value:
            raise InvalidTrajectoryError(f"{key}: conflicts with metadata.{key}")
        metadata[key] = value
    if extras:
        metadata["message_extras"] = extras
    return metadata


def _chat_outcome(
    data: Mapping[str, Any], env_key: str, messages: list[tuple[str, str]], agent_role: str, metadata: dict[str, Any]
) -> Outcome:
    has_flat = "success" in data or "reward" in data
    if "outcome" in data:
        if has_flat:
            raise InvalidTrajectoryError("give either 'outcome' or 'success'/'reward', not both", where="outcome")
        return Outcome.from_dict(data["outcome"])
    if has_flat:
        success, reward = data.get("success"), data.get("reward")
        if success is not None and not isinstance(success, bool):
            raise InvalidTrajectoryError(f"expected true/false/null, got {success!r}", where="success")
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))):
            raise InvalidTrajectoryError(f"expected a number or null, got {reward!r}", where="reward")
        if reward is not None and not math.isfinite(reward):
            raise InvalidTrajectoryError("must be finite", where="reward")
        return Outcome(success=success, reward=reward)
    if env_key == "toolqa":
        role, content = messages[-1]
        if role != agent_role:
            m = _VERDICT.match(content)
            if m:
                metadata["outcome_source"] = "inferred"
                return Outcome(success=m.group(1).upper() == "CORRECT")
    return Outcome()


def _record_id(data: Mapping[str, Any]) -> str:
    raw = data.get("id")
    if raw is None:
        return ""
    if isinstance(raw, bool) or not isinstance(raw, (str, int)):
        raise InvalidTrajectoryError(f"expected a string or an integer, got {_type_name(raw)}", where="id")
    return str(raw)


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {dict: "object", list: "list", str: "string", bool: "boolean", int: "integer", float: "number"}.get(
        type(value), type(value).__name__
    )


# --------------------------------------------------------------------------- files


def _reject_constant(name: str) -> Any:
    raise InvalidTrajectoryError(f"{name} is not valid JSON")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise InvalidTrajectoryError(f"duplicate key {k!r}")
            seen.add(k)
    return out


def _decode_line(raw: bytes, *, last_without_newline: bool) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidTrajectoryError(f"not UTF-8: byte 0x{raw[exc.start]:02x} at column {exc.start + 1}") from None
    if text.startswith("\ufeff"):
        text = text[1:]
    try:
        data = json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        hint = " (the last line has no newline: the file may be cut short)" if last_without_newline else ""
        raise InvalidTrajectoryError(f"invalid JSON: {exc.msg} at column {exc.colno}{hint}") from None
    except (ValueError, RecursionError) as exc:
        raise InvalidTrajectoryError(f"invalid JSON: {exc}") from None
    if _SURROGATE_ESCAPE.search(raw):
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidTrajectoryError(
                "invalid text: an unpaired UTF-16 surrogate escape (\\ud800-\\udfff)"
            ) from None
    return data


def _open_binary(path: str | os.PathLike[str]) -> tuple[str, BinaryIO, bool]:
    """(display name, stream, close it?); gzip is recognised by its magic bytes."""
    if str(path) == "-":
        name, stream, close = "<stdin>", sys.stdin.buffer, False
    else:
        name, stream, close = str(path), open(path, "rb"), True  # noqa: SIM115 - returned open: the caller closes it
    if not isinstance(stream, io.BufferedReader):
        stream = io.BufferedReader(stream)
    if stream.peek(2)[:2] == b"\x1f\x8b":
        return name, gzip.GzipFile(fileobj=stream, mode="rb"), True  # type: ignore[return-value]
    return name, stream, close


def iter_jsonl(
    path: str | os.PathLike[str],
    *,
    fmt: str = "auto",
    env: str | None = None,
    skip_invalid: bool = False,
    report: ImportReport | None = None,
) -> Iterator[Trajectory]:
    """Stream trajectories from a JSONL file ("-" = stdin; gzip accepted).

    Blank lines are skipped. A bad line raises :class:`RecordError` unless
    ``skip_invalid``, in which case it is counted in ``report`` and skipped.
    The format is checked and the file opened at call time, not at first use.
    """
    if fmt not in FORMATS:
        raise InvalidArgumentError(f"expected one of {', '.join(FORMATS)}, got {fmt!r}", where="fmt")
    report = report if report is not None else ImportReport()
    name, stream, close = _open_binary(path)
    return _iter_lines(name, stream, close, fmt=fmt, env=env, skip_invalid=skip_invalid, report=report)


def _raw_records(name: str, stream: BinaryIO, close: bool) -> Iterator[tuple[int, bytes | RecordError]]:
    """(line number, raw line) per non-blank line; a corrupt or truncated compressed stream
    (its checksum is read at its end) gives a :class:`RecordError` in place of the rest."""
    lineno = 0
    try:
        lines = iter(stream)
        while True:
            try:
                raw = next(lines)
            except StopIteration:
                return
            except (OSError, EOFError, zlib.error) as exc:  # corrupt or truncated gzip
                yield lineno + 1, RecordError(name, lineno + 1, f"cannot read: {exc}")
                return
            lineno += 1
            if raw.strip():
                yield lineno, raw
    finally:
        if close:
            stream.close()


def _parse_raw(
    name: str, lineno: int, raw: bytes | RecordError, fmt: str, env: str | None, tenant: str | None = None
) -> Trajectory:
    if isinstance(raw, RecordError):
        raise raw
    try:
        return parse_record(
            _decode_line(raw, last_without_newline=not raw.endswith(b"\n")), fmt=fmt, env=env, tenant=tenant
        )
    except InvalidTrajectoryError as exc:
        raise RecordError(name, lineno, str(exc)) from None


def _iter_lines(
    name: str, stream: BinaryIO, close: bool, *, fmt: str, env: str | None, skip_invalid: bool, report: ImportReport
) -> Iterator[Trajectory]:
    for lineno, raw in _raw_records(name, stream, close):
        report.read += 1
        try:
            traj = _parse_raw(name, lineno, raw, fmt, env)
        except RecordError as err:
            report.add_error(err)
            if skip_invalid and not isinstance(raw, RecordError):
                continue
            if skip_invalid:
                return
            raise
        report.add_valid(traj)
        yield traj


@dataclass
class CheckedFile:
    """One input file, every record parsed and validated (see :func:`check_file`): what to
    read again to store it, and which lines not to store."""

    name: str  # as messages show it
    path: str  # the file to read again: the input, or a spooled copy of standard input
    skip: set[int]  # line numbers left out (with skip_invalid: invalid or conflicting records)
    valid: int  # records that will be stored (or found stored already)
    spooled: bool = False
    unreadable: bool = False  # a compressed file failed its checksum: none of its records is trusted

    def records(self, *, fmt: str = "auto", env: str | None = None, tenant: str | None = None) -> Iterator[Trajectory]:
        """The file's records that passed, in order (``tenant`` as given to :func:`check_file`)."""
        if self.unreadable:
            return
        _, stream, close = _open_binary(self.path)
        for lineno, raw in _raw_records(self.name, stream, close):
            if lineno not in self.skip:
                yield _parse_raw(self.name, lineno, raw, fmt, env, tenant)

    def close(self) -> None:
        """Remove the spooled copy of standard input, if any."""
        if self.spooled:
            with contextlib.suppress(OSError):
                os.unlink(self.path)


def check_file(
    path: str | os.PathLike[str],
    *,
    fmt: str = "auto",
    env: str | None = None,
    skip_invalid: bool = False,
    report: ImportReport | None = None,
    stored_conflicts: Callable[[list[str], list[str]], list[bool]] | None = None,
    tenant: str | None = None,
) -> CheckedFile:
    """Read a whole JSONL file ("-" = standard input, spooled to a temporary file; gzip read
    to its checksum) and validate every record before anything of it is stored: a malformed
    record, an id repeated in the file with other content, or an id the memory holds with
    other content (``stored_conflicts(ids, fingerprints)``: per id, whether it is stored with
    another fingerprint, by id key (:func:`lifemem_ray.core.tenancy.id_key`); asked for
    ``STORE_CHECK_BATCH`` ids at a time, so a remote memory answers in few calls). ``tenant``
    is the tenant of records that do not name one.

    Without ``skip_invalid`` the first such record raises :class:`RecordError` (``FILE:LINE:
    reason``) and nothing of the file may be stored; with it, each is counted in ``report``,
    listed there by file and line, and left out."""
    if fmt not in FORMATS:
        raise InvalidArgumentError(f"expected one of {', '.join(FORMATS)}, got {fmt!r}", where="fmt")
    report = report if report is not None else ImportReport()
    name, stream, close = _open_binary(path)
    spool = None
    if str(path) == "-":
        # Open through the loop below, closed after it (or on its way out by an exception).
        spool = tempfile.NamedTemporaryFile(prefix="lifemem-stdin-", suffix=".jsonl", delete=False)  # noqa: SIM115
    checked = CheckedFile(name, spool.name if spool else str(path), set(), 0, spooled=spool is not None)
    seen: dict[str, tuple[str, int]] = {}  # id -> (fingerprint, first line)
    asking: list[tuple[int, Trajectory]] = []  # first occurrences not yet checked against the store

    def ask() -> None:
        if stored_conflicts is not None and asking:
            _check_stored(name, asking, stored_conflicts, skip_invalid, report, checked)
        asking.clear()

    try:
        for lineno, raw in _raw_records(name, stream, close):
            report.read += 1
            if spool is not None and not isinstance(raw, RecordError):
                spool.write(raw if raw.endswith(b"\n") else raw + b"\n")
            try:
                traj = _parse_raw(name, lineno, raw, fmt, env, tenant)
                if _first_occurrence(name, lineno, traj, seen):
                    asking.append((lineno, traj))
            except RecordError as err:
                if not skip_invalid:
                    ask()  # an earlier record stored with other content is the first error
                report.add_error(err)
                if not skip_invalid:
                    raise
                if isinstance(raw, RecordError):  # corrupt compressed data: nothing of it is trusted
                    checked.unreadable, checked.valid = True, 0
                    break
                checked.skip.add(lineno)
                continue
            report.add_valid(traj)
            checked.valid += 1
            if len(asking) >= STORE_CHECK_BATCH:
                ask()
        if not checked.unreadable:
            ask()
    except BaseException:
        if spool is not None:
            spool.close()
        checked.close()
        raise
    if spool is not None:
        spool.close()
    return checked


def _first_occurrence(name: str, lineno: int, traj: Trajectory, seen: dict[str, tuple[str, int]]) -> bool:
    """Whether this is the id's first line (of its tenant); a repeat with other content is a RecordError."""
    key = id_key(traj.tenant, traj.id)
    first = seen.get(key)
    if first is not None:
        if first[0] != traj.fingerprint:
            raise RecordError(name, lineno, f"id {traj.id!r} repeats line {first[1]} with different content")
        return False
    seen[key] = (traj.fingerprint, lineno)
    return True


def _check_stored(
    name: str,
    asking: list[tuple[int, Trajectory]],
    stored_conflicts: Callable[[list[str], list[str]], list[bool]],
    skip_invalid: bool,
    report: ImportReport,
    checked: CheckedFile,
) -> None:
    """Records whose id the memory holds with other content: a RecordError, or left out."""
    flags = stored_conflicts([id_key(t.tenant, t.id) for _, t in asking], [t.fingerprint for _, t in asking])
    for (lineno, traj), conflict in zip(asking, flags, strict=True):
        if not conflict:
            continue
        err = RecordError(
            name,
            lineno,
            f"id {traj.id!r} is already stored with different content "
            "(give the new content a new id, or remove the stored one first)",
        )
        report.add_error(err)
        if not skip_invalid:
            raise err
        checked.skip.add(lineno)
        checked.valid -= 1
        report.valid -= 1
        report.by_env[traj.env] -= 1


def read_jsonl(
    paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]], **kw: Any
) -> tuple[list[Trajectory], ImportReport]:
    """Read one path or several into memory; ``kw`` as for :func:`iter_jsonl`."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    report = kw.pop("report", None) or ImportReport()
    out: list[Trajectory] = []
    for p in paths:
        out.extend(iter_jsonl(p, report=report, **kw))
    return out, report


def write_jsonl(trajectories: Iterable[Trajectory], path: str | os.PathLike[str]) -> int:
    """Write native JSONL atomically (temp file + rename; gzip for ``.gz``); returns the count."""
    if str(path) == "-":
        n = 0
        for traj in trajectories:
            sys.stdout.write(_dump(traj) + "\n")
            n += 1
        sys.stdout.flush()
        return n
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent or ".")
    n = 0
    try:
        with os.fdopen(fd, "wb") as raw:
            sink: BinaryIO = gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) if target.suffix == ".gz" else raw  # type: ignore[assignment]
            for traj in trajectories:
                if not isinstance(traj, Trajectory):
                    raise ArgumentTypeError(
                        f"item {n}: expected a Trajectory, got {type(traj).__name__}", where="write_jsonl"
                    )
                sink.write(_dump(traj).encode("utf-8") + b"\n")
                n += 1
            if sink is not raw:
                sink.close()
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return n


def _dump(traj: Trajectory) -> str:
    return json.dumps(traj.to_dict(), ensure_ascii=False, separators=(",", ":"))
