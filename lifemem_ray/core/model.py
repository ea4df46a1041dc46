"""The data model: trajectories and their steps, validated at the boundary.

Everything that enters the store passes through :meth:`Trajectory.from_dict` or
the constructor, so a record that is stored is always well formed. Errors name
the field that is wrong; importers add the file and line.
"""

from __future__ import annotations

import hashlib
import math
import re
import unicodedata
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from lifemem_ray.core.errors import InvalidTrajectoryError, TenantError, join_where
from lifemem_ray.core.tenancy import DEFAULT_TENANT, check_tenant

__all__ = [
    "InvalidTrajectoryError",
    "Outcome",
    "Step",
    "Trajectory",
    "content_hash",
    "env_name_problem",
    "render_text",
]

MAX_ID_LENGTH = 512
# Hard bounds of one trajectory: far above real trajectories (the longest observation of the
# shipped and released data is a few tens of kB), low enough that one record cannot exhaust
# a process. Every entry point (engine, client, CLI, Ray Data) builds Trajectory objects, so
# these hold everywhere.
MAX_TEXT_CHARS = 1_000_000  # any one text: task, observation, thought, action, metadata string
MAX_STEPS = 10_000
MAX_METADATA_ITEMS = 10_000  # keys and list items of the metadata, all levels together
MAX_ENV_CHARS = 128
_LABELLED = re.compile(r"(?:Thought|Action|Observation)\s*\d*\s*:", re.I)


def env_name_problem(value: Any) -> str | None:
    """Why ``value`` is not an environment name, or None. A name is the whole string: 1-128
    characters, no surrounding spaces, no control or format characters (a newline, a tab, a
    zero-width space; a NUL is the tenancy rules' to refuse), so that two names that print
    alike are one name.

    >>> env_name_problem("webshop"), env_name_problem("webshop\\n") is not None
    (None, True)
    """
    if not isinstance(value, str):
        return f"expected a string, got {type(value).__name__}"
    if not value.strip():
        return "must not be empty"
    if value != value.strip() or len(value) > MAX_ENV_CHARS:
        return f"{value[:80]!r} must be at most {MAX_ENV_CHARS} characters without surrounding spaces"
    # NUL is left to the tenancy rules, which refuse it as a key separator (TenantError).
    bad = next((c for c in value if c != "\x00" and unicodedata.category(c) in ("Cc", "Cf", "Cs")), None)
    if bad is not None:
        return f"{value[:80]!r} contains the control character U+{ord(bad):04X}; an environment name is printable text"
    return None


def _check_str(value: Any, where: str, *, allow_empty: bool = True) -> str:
    if not isinstance(value, str):
        raise InvalidTrajectoryError(f"expected a string, got {type(value).__name__}", where=where)
    if "\x00" in value:
        raise InvalidTrajectoryError("contains a NUL character", where=where)
    if len(value) > MAX_TEXT_CHARS:
        raise InvalidTrajectoryError(
            f"{len(value):,} characters, more than the {MAX_TEXT_CHARS:,} a text may have", where=where
        )
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidTrajectoryError(
                f"not valid Unicode text (lone surrogate at position {exc.start})", where=where
            ) from None
    if not allow_empty and not value.strip():
        raise InvalidTrajectoryError("must not be empty", where=where)
    return value


def _check_json_value(value: Any, where: str, depth: int = 0, budget: list[int] | None = None) -> None:
    """Metadata must survive msgpack and JSON unchanged: plain JSON types only, text as
    :func:`_check_str` wants it, at most ``MAX_METADATA_ITEMS`` keys and items in all."""
    budget = [MAX_METADATA_ITEMS] if budget is None else budget
    if depth > 32:
        raise InvalidTrajectoryError("nested too deeply", where=where)
    if isinstance(value, str):
        _check_str(value, where)
        return
    if value is None or isinstance(value, (bool, int)):
        if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**64:
            raise InvalidTrajectoryError("integer out of 64-bit range", where=where)
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidTrajectoryError("non-finite number", where=where)
        return
    if isinstance(value, (list, tuple, dict)):
        budget[0] -= len(value)
        if budget[0] < 0:
            raise InvalidTrajectoryError(
                f"the metadata holds more than {MAX_METADATA_ITEMS:,} keys and items", where=where
            )
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_json_value(item, f"{where}[{i}]", depth + 1, budget)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise InvalidTrajectoryError(f"keys must be strings, got {key!r}", where=where)
            _check_str(key, f"{where}: key {key[:40]!r}")
            _check_json_value(item, f"{where}.{key}", depth + 1, budget)
        return
    raise InvalidTrajectoryError(f"unsupported type {type(value).__name__}", where=where)


@dataclass(frozen=True, slots=True)
class Step:
    """One agent turn: what it thought, what it did, what the environment answered."""

    action: str
    thought: str = ""
    observation: str = ""

    def __post_init__(self) -> None:
        _check_str(self.action, "action")
        _check_str(self.thought, "thought")
        _check_str(self.observation, "observation")
        if not (self.action.strip() or self.thought.strip()):
            raise InvalidTrajectoryError("step has neither an action nor a thought")

    def to_dict(self) -> dict[str, str]:
        return {"thought": self.thought, "action": self.action, "observation": self.observation}

    @classmethod
    def trusted(cls, action: str, thought: str, observation: str) -> Step:
        """A step without validation: only for what this project validated before storing."""
        step = object.__new__(cls)
        object.__setattr__(step, "action", action)
        object.__setattr__(step, "thought", thought)
        object.__setattr__(step, "observation", observation)
        return step

    @classmethod
    def from_dict(cls, data: Any, where: str = "step") -> Step:
        if not isinstance(data, Mapping):
            raise InvalidTrajectoryError(f"expected an object, got {type(data).__name__}", where=where)
        unknown = set(data) - {"thought", "action", "observation"}
        if unknown:
            raise InvalidTrajectoryError(f"unknown field(s) {sorted(unknown)}", where=where)
        try:
            return cls(
                action=_check_str(data.get("action", ""), f"{where}.action"),
                thought=_check_str(data.get("thought", ""), f"{where}.thought"),
                observation=_check_str(data.get("observation", ""), f"{where}.observation"),
            )
        except InvalidTrajectoryError as exc:
            if (exc.where or "").startswith(where):
                raise
            raise InvalidTrajectoryError(exc.problem, where=join_where(where, exc.where)) from None


@dataclass(frozen=True, slots=True)
class Outcome:
    """How the task ended. Either part may be unknown (None)."""

    success: bool | None = None
    reward: float | None = None

    def __post_init__(self) -> None:
        if self.success is not None and not isinstance(self.success, bool):
            raise InvalidTrajectoryError(f"expected true/false/null, got {self.success!r}", where="outcome.success")
        if self.reward is not None:
            if isinstance(self.reward, bool) or not isinstance(self.reward, (int, float)):
                raise InvalidTrajectoryError(f"expected a number or null, got {self.reward!r}", where="outcome.reward")
            if not math.isfinite(self.reward):
                raise InvalidTrajectoryError("must be finite", where="outcome.reward")
            object.__setattr__(self, "reward", float(self.reward))

    def to_dict(self) -> dict[str, Any]:
        return {"success": self.success, "reward": self.reward}

    @classmethod
    def from_dict(cls, data: Any, where: str = "outcome") -> Outcome:
        if data is None:
            return cls()
        if isinstance(data, bool):
            return cls(success=data)
        if not isinstance(data, Mapping):
            raise InvalidTrajectoryError(f"expected an object, got {type(data).__name__}", where=where)
        unknown = set(data) - {"success", "reward"}
        if unknown:
            raise InvalidTrajectoryError(f"unknown field(s) {sorted(unknown)}", where=where)
        return cls(success=data.get("success"), reward=data.get("reward"))


def content_hash(
    env: str,
    task: str,
    initial_observation: str,
    steps: tuple[Step, ...],
    outcome: Outcome,
    tenant: str = DEFAULT_TENANT,
) -> str:
    """Stable id for a trajectory that came without one: same content, same id.

    SHA-256 over a msgpack encoding of (env, task, initial observation, steps,
    outcome), and the tenant when it is not the default one (so the default tenant's
    fingerprints are those of stores written before tenants); metadata is left out, so
    annotating a trajectory keeps its id.
    """
    parts: list[Any] = [
        env,
        task,
        initial_observation,
        [[s.thought, s.action, s.observation] for s in steps],
        [outcome.success, outcome.reward],
    ]
    if tenant != DEFAULT_TENANT:
        parts.append(tenant)
    canonical = msgpack.packb(parts, use_bin_type=True)
    return "h-" + hashlib.sha256(canonical).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class Trajectory:
    """A finished task: goal, ordered steps, outcome, free metadata.

    ``id`` is the caller's, or a content hash when empty. ``initial_observation``
    holds what the environment showed before the first action (the instruction
    or first page), kept so nothing of an imported record is dropped. ``tenant`` owns it
    (see :mod:`lifemem_ray.core.tenancy`): only queries of that tenant see it.
    """

    env: str
    task: str
    steps: tuple[Step, ...]
    outcome: Outcome = field(default_factory=Outcome)
    id: str = ""
    initial_observation: str = ""
    metadata: Mapping[str, Any] = field(default_factory=dict)
    tenant: str = DEFAULT_TENANT
    _fingerprint: str = field(default="", init=False, repr=False, compare=False)

    def __hash__(self) -> int:
        return hash((self.id, self.fingerprint))

    def __post_init__(self) -> None:
        _check_str(self.env, "env", allow_empty=False)  # NUL, lone surrogates, length
        problem = env_name_problem(self.env)
        if problem:
            raise InvalidTrajectoryError(f"{problem}", where="env")
        _check_str(self.task, "task")
        _check_str(self.initial_observation, "initial_observation")
        if not self.task.strip() and not self.initial_observation.strip():
            raise InvalidTrajectoryError("empty, and there is no initial_observation to stand in for it", where="task")
        steps = tuple(self.steps)
        if not steps:
            raise InvalidTrajectoryError("a trajectory needs at least one step", where="steps")
        if len(steps) > MAX_STEPS:
            raise InvalidTrajectoryError(
                f"{len(steps):,} steps, more than the {MAX_STEPS:,} a trajectory may have",
                where="steps",
            )
        for i, step in enumerate(steps):
            if not isinstance(step, Step):
                raise InvalidTrajectoryError(f"expected a Step, got {type(step).__name__}", where=f"steps[{i}]")
        object.__setattr__(self, "steps", steps)
        if not isinstance(self.outcome, Outcome):
            raise InvalidTrajectoryError(f"expected an Outcome, got {type(self.outcome).__name__}", where="outcome")
        if not isinstance(self.metadata, Mapping):
            raise InvalidTrajectoryError(f"expected an object, got {type(self.metadata).__name__}", where="metadata")
        _check_json_value(dict(self.metadata), "metadata")
        object.__setattr__(self, "metadata", dict(self.metadata))
        if self.tenant != DEFAULT_TENANT:
            try:  # a stored record keeps decoding under a name an older version let through; adds refuse it
                check_tenant(self.tenant, "tenant", stored=True)
            except TenantError as exc:
                raise InvalidTrajectoryError(exc.problem, where=exc.where) from None
        _check_str(self.id, "id")
        if len(self.id) > MAX_ID_LENGTH:
            raise InvalidTrajectoryError(f"longer than {MAX_ID_LENGTH} characters", where="id")
        if not self.id:
            object.__setattr__(self, "id", self.fingerprint)
        elif not self.id.strip():
            raise InvalidTrajectoryError("must not be blank", where="id")

    @classmethod
    def trusted(
        cls,
        *,
        env: str,
        task: str,
        steps: tuple[Step, ...],
        outcome: Outcome,
        id: str,
        initial_observation: str,
        metadata: dict[str, Any],
        fingerprint: str = "",
        tenant: str = DEFAULT_TENANT,
    ) -> Trajectory:
        """A trajectory without validation: only for records this project validated before
        storing them. Decoding retrieved records is retrieval's hot path; re-checking every
        string of every step there cost more than the search."""
        traj = object.__new__(cls)
        for name, value in (
            ("env", env),
            ("task", task),
            ("steps", steps),
            ("outcome", outcome),
            ("id", id),
            ("initial_observation", initial_observation),
            ("metadata", metadata),
            ("_fingerprint", fingerprint),
            ("tenant", tenant),
        ):
            object.__setattr__(traj, name, value)
        return traj

    @property
    def fingerprint(self) -> str:
        """Content hash over everything but id and metadata (computed once)."""
        if not self._fingerprint:
            fp = content_hash(self.env, self.task, self.initial_observation, self.steps, self.outcome, self.tenant)
            object.__setattr__(self, "_fingerprint", fp)
        return self._fingerprint

    @property
    def query_text(self) -> str:
        """The text a future task is matched against: the goal (or the first observation)."""
        return self.task if self.task.strip() else self.initial_observation

    def to_dict(self) -> dict[str, Any]:
        """The native JSON form; ``tenant`` only when it is not the default one."""
        out = {
            "id": self.id,
            "env": self.env,
            "task": self.task,
            "initial_observation": self.initial_observation,
            "steps": [s.to_dict() for s in self.steps],
            "outcome": self.outcome.to_dict(),
            "metadata": dict(self.metadata),
        }
        if self.tenant != DEFAULT_TENANT:
            out["tenant"] = self.tenant
        return out

    @classmethod
    def from_dict(cls, data: Any, *, env: str | None = None, tenant: str | None = None) -> Trajectory:
        """Build from the native JSON form; ``env`` fills in a missing ``env`` field, ``tenant``
        a missing ``tenant`` (the default tenant when neither is given)."""
        if not isinstance(data, Mapping):
            raise InvalidTrajectoryError(f"expected an object, got {type(data).__name__}", where="record")
        known = {"id", "env", "task", "initial_observation", "steps", "outcome", "metadata", "tenant"}
        unknown = set(data) - known
        if unknown:
            raise InvalidTrajectoryError(f"unknown field(s) {sorted(unknown)}", where="record")
        record_env = data.get("env")
        if record_env is None:
            record_env = env
        if record_env is None:
            raise InvalidTrajectoryError("missing (give it in the record or with --env)", where="env")
        if "task" not in data:
            raise InvalidTrajectoryError("missing", where="task")
        steps_raw = data.get("steps")
        if not isinstance(steps_raw, list):
            raise InvalidTrajectoryError("expected a list of steps", where="steps")
        steps = tuple(Step.from_dict(s, f"steps[{i}]") for i, s in enumerate(steps_raw))
        metadata = data.get("metadata")
        if metadata is None:
            metadata = {}
        raw_id = data.get("id", "")
        if raw_id is None:
            raw_id = ""
        if isinstance(raw_id, int) and not isinstance(raw_id, bool):
            raw_id = str(raw_id)
        return cls(
            env=record_env,
            task=data["task"],
            steps=steps,
            outcome=Outcome.from_dict(data.get("outcome")),
            id=raw_id,
            initial_observation=data.get("initial_observation", ""),
            metadata=metadata,
            tenant=_record_tenant(data.get("tenant"), tenant),
        )

    def render(self, max_chars: int | None = None) -> str:
        """A plain-text rendering for prompts, cut step-wise to ``max_chars``."""
        steps = ((s.thought, s.action, s.observation) for s in self.steps)
        return render_text(self.query_text, steps, self.outcome.success, max_chars)


def _record_tenant(given: Any, fallback: str | None) -> str:
    """The tenant of a record: its own ``tenant`` field, else the caller's, else the default."""
    value = given if given is not None else (fallback if fallback is not None else DEFAULT_TENANT)
    try:
        return check_tenant(value, "tenant")
    except TenantError as exc:
        raise InvalidTrajectoryError(exc.problem, where=exc.where) from None


def _render_parts(query_text: str, steps: Iterable[Sequence[str]], success: bool | None) -> Iterator[str]:
    yield f"Task: {query_text.strip()}"
    match = _LABELLED.match
    for i, (thought, action, observation) in enumerate(steps, 1):
        lines = []
        # Imported turns often carry their own "Action 3:" label: do not say it twice (the
        # first-letter test skips the regex where it cannot match; unrolled: the hot path).
        if thought := thought.strip():
            lines.append(thought if thought[0] in "TtAaOo" and match(thought) else f"Thought {i}: {thought}")
        if action := action.strip():
            lines.append(action if action[0] in "TtAaOo" and match(action) else f"Action {i}: {action}")
        if observation := observation.strip():
            lines.append(
                observation if observation[0] in "TtAaOo" and match(observation) else f"Observation {i}: {observation}"
            )
        yield "\n".join(lines)
    if success is not None:
        yield f"Outcome: {'success' if success else 'failure'}"


def render_text(
    query_text: str, steps: Iterable[Sequence[str]], success: bool | None, max_chars: int | None = None
) -> str:
    """:meth:`Trajectory.render` from plain fields: steps as (thought, action, observation).
    Retrieval renders stored records through this without building Step objects."""
    out: list[str] = []
    used = 0
    for part in _render_parts(query_text, steps, success):  # lazily: a cut rendering never formats the steps past it
        if max_chars is not None and used + len(part) + 1 > max_chars:
            room = max_chars - used - 1
            if room > 40:
                out.append(part[: room - 4] + " ...")
            else:
                out.append("...")
            break
        out.append(part)
        used += len(part) + 1
    return "\n".join(out)
