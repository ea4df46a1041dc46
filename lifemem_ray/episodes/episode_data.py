"""What an episode's raw data becomes before the memory stores it: the one rule every adapter
(:class:`~lifemem_ray.episodes.memory_wrapper.MemoryWrapper`, SkyRL's ``lifemem-memory``, the verl
loop) applies, so that recording an episode never raises into the rollout.

An environment or a policy may hand the memory anything: a NaN reward, a reward that is a
string, an observation with a NUL byte or a lone surrogate, a dict or a numpy array where text
goes, a 50 MB action. :class:`EpisodeRecord` takes each value as it comes and keeps it in the
form the data model (:mod:`lifemem_ray.core.model`) accepts, noting every change by kind
(:data:`MADE_VALID_KINDS`); :meth:`EpisodeRecord.storable` then builds the trajectory, or says
why there is none (:data:`NOT_STORED_REASONS`). The bounds are the model's own
(``MAX_TEXT_CHARS``); the record keeps tighter ones of its own (:data:`MAX_OBSERVATION_CHARS`,
:data:`MAX_STEPS`).

What each value becomes:

* text (task, first observation, action, thought, observation, metadata strings): a string as
  it is; ``None`` as ""; bytes decoded as UTF-8 (invalid bytes as U+FFFD) and anything else as
  ``str(value)`` (``not_text``); a NUL as U+FFFD (``nul``); a lone surrogate as U+FFFD, a
  surrogate pair as the character it encodes (``surrogate``); a text over the model's
  ``MAX_TEXT_CHARS`` cut to it, ending in a marker that says how long it was (``truncated``).
  Observations are cut to :data:`MAX_OBSERVATION_CHARS` without a marker, as before (the
  record's own bound, not a repair). A blank action of a step without a thought is stored as
  ``(empty)``;
* a reward: a real number (a bool, a numpy scalar) as a float; ``None`` as no reward; NaN,
  +-inf, a string, a dict or anything else as no reward, and the trajectory's outcome reward is
  then unknown (None) rather than a sum that leaves a step out (``reward``); a finite sum that
  overflows is unknown too;
* success: true/false (a number or a numpy scalar by its truth); anything else unknown
  (``success``);
* steps beyond :data:`MAX_STEPS`: counted in ``metadata["dropped_steps"]``, not kept (``steps``).

A trajectory that still cannot be made valid is not stored: its environment name is not one
the memory takes (``env_name``), neither its task nor its first observation has any text
(``no_task``), the model refused it for another reason such as a tenant name or the caller's
metadata (``refused``); an adapter that could not read an environment's answer as a step
drops the record (``unreadable``). A stored trajectory says what was changed in
``metadata["made_valid"]`` (kind -> how many values).
"""

from __future__ import annotations

import math
import numbers
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lifemem_ray.core.errors import InvalidTrajectoryError
from lifemem_ray.core.model import MAX_TEXT_CHARS, Outcome, Step, Trajectory, env_name_problem
from lifemem_ray.core.tenancy import DEFAULT_TENANT

__all__ = [
    "MADE_VALID_KINDS",
    "MAX_OBSERVATION_CHARS",
    "MAX_STEPS",
    "NOT_STORED_REASONS",
    "UNREADABLE",
    "EpisodeRecord",
    "StorableEpisode",
    "storable_reward",
    "storable_success",
    "storable_text",
]

MAX_OBSERVATION_CHARS = 4000  # an observation kept in a stored step (the episode loop's own bound)
MAX_STEPS = 1000  # steps one record keeps (below the model's MAX_STEPS); later ones are counted, not stored

# What the rule may change in a value, and why a trajectory may not be stored (module docstring).
MADE_VALID_KINDS = ("not_text", "nul", "surrogate", "truncated", "reward", "success", "steps")
NOT_STORED_REASONS = ("env_name", "no_task", "refused", "unreadable")

UNREADABLE: Any = object()  # a value an adapter could not read at all (a success_of that raised)
_EMPTY_ACTION = "(empty)"


def _cut_marker(length: int) -> str:
    return f"\n[... cut by the episode memory: {length:,} characters in all]"


def _as_text(value: Any, note: list[str]) -> str:
    """``value`` as a string, noting ``not_text`` when it was not one (never raises)."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    note.append("not_text")
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value[: MAX_TEXT_CHARS * 4 + 4])  # at most 4 bytes a character: enough to reach the bound
        return raw.decode("utf-8", "replace")
    try:
        text = str(value)
    except Exception:  # noqa: BLE001 - a __str__ that fails: the type stands for the value
        return f"<{type(value).__name__}>"
    return text if isinstance(text, str) else f"<{type(value).__name__}>"


def storable_text(value: Any, keep: int | None = None) -> tuple[str, list[str]]:
    """``value`` as text the data model accepts, and the kinds of change made (a subset of
    :data:`MADE_VALID_KINDS`, in the order made; empty when it was valid text already).

    Args:
        value: anything; a string is kept as it is when the model accepts it.
        keep: cut the text to this many characters first, without a marker and without
            noting it (a record's own bound, e.g. :data:`MAX_OBSERVATION_CHARS`).

    Returns:
        The text (at most the model's ``MAX_TEXT_CHARS``) and the kinds changed.

    >>> storable_text("a\\x00b")
    ('a\\ufffdb', ['nul'])
    """
    changes: list[str] = []
    text = _as_text(value, changes)
    if keep is not None:
        text = text[:keep]
    if len(text) > MAX_TEXT_CHARS:
        marker = _cut_marker(len(text))
        text = text[: MAX_TEXT_CHARS - len(marker)] + marker
        changes.append("truncated")
    if "\x00" in text:
        text = text.replace("\x00", "\ufffd")
        changes.append("nul")
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates: pairs become their character, the rest U+FFFD
            text = text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
            changes.append("surrogate")
    return text, changes


def storable_reward(value: Any) -> tuple[float | None, bool]:
    """``value`` as a reward the model accepts: ``(float, False)`` for a finite real number
    (a bool, an int, a numpy scalar), ``(None, False)`` for None (no reward), and
    ``(None, True)`` for anything else (NaN, +-inf, a string, a dict, an array): changed."""
    if value is None:
        return None, False
    if isinstance(value, (str, bytes, bytearray)) or not (
        isinstance(value, numbers.Real) or callable(getattr(type(value), "__float__", None))
    ):
        return None, True
    try:
        number = float(value)
    except Exception:  # noqa: BLE001 - an array of several values, an int too large for a float ...
        return None, True
    return (number, False) if math.isfinite(number) else (None, True)


def storable_success(value: Any) -> tuple[bool | None, bool]:
    """``value`` as a success the model accepts: ``(value, False)`` for True, False or None;
    a real number or a numpy scalar by its truth; ``(None, True)`` for anything else (a
    string, a list, an array of several values, NaN, :data:`UNREADABLE`): changed."""
    if value is None or isinstance(value, bool):
        return value, False
    if isinstance(value, numbers.Real) or getattr(value, "shape", None) == ():
        try:
            number = float(value)
        except Exception:  # noqa: BLE001 - not a number after all
            return None, True
        return (number != 0.0, False) if math.isfinite(number) else (None, True)
    return None, True


@dataclass(frozen=True)
class StorableEpisode:
    """What :meth:`EpisodeRecord.storable` made of an episode: the trajectory (None when it
    is not stored), what was changed to make it valid (kind -> how many values), and, when
    not stored, the reason (one of :data:`NOT_STORED_REASONS`) and the model's message."""

    trajectory: Trajectory | None
    made_valid: dict[str, int]
    not_stored: str = ""
    problem: str = ""


@dataclass
class EpisodeRecord:
    """One episode's trajectory as it happens: the task, the first observation, each step.

    Every value is kept as the data model accepts it (the module's rule), so recording never
    raises: ``task`` and ``initial_observation`` may be given as any value and are kept as
    text (the first observation cut to :data:`MAX_OBSERVATION_CHARS`); :attr:`made_valid`
    counts the changes by kind (:data:`MADE_VALID_KINDS`). ``env`` is checked when the
    trajectory is built (:meth:`storable`)."""

    env: str
    task: str
    initial_observation: str = ""
    steps: list[Step] = field(default_factory=list)
    dropped_steps: int = 0  # steps beyond MAX_STEPS (counted in the metadata, not stored)
    reward: float = 0.0  # the sum of the readable rewards seen so far
    made_valid: dict[str, int] = field(default_factory=dict)  # kind -> values changed

    def __post_init__(self) -> None:
        self.task = self._text(self.task)
        self.initial_observation = self._text(self.initial_observation, MAX_OBSERVATION_CHARS)

    def step(self, action: Any, observation: Any, reward: Any = 0.0, thought: Any = "") -> None:
        """Record one action and what the environment answered, each made valid (never raises).

        Args:
            action: what the agent did (text; anything else is stored as its text).
            observation: what the environment answered (cut to :data:`MAX_OBSERVATION_CHARS`).
            reward: the step's reward (None: none; not a finite number: none, and the
                trajectory's reward unknown).
            thought: the agent's reasoning before the action.
        """
        number, changed = storable_reward(reward)
        if changed:
            self.made_valid["reward"] = self.made_valid.get("reward", 0) + 1
        elif number is not None:
            self.reward += number
        if len(self.steps) >= MAX_STEPS:
            self.dropped_steps += 1
            return
        action, thought = self._text(action), self._text(thought)
        if not action.strip() and not thought.strip():
            action = _EMPTY_ACTION
        observation = self._text(observation, MAX_OBSERVATION_CHARS)
        self.steps.append(Step(action=action, thought=thought, observation=observation))

    @property
    def total_reward(self) -> float | None:
        """The sum of the step rewards; None (unknown) when a reward could not be read or the
        sum is not finite."""
        return None if self.made_valid.get("reward") or not math.isfinite(self.reward) else self.reward

    def storable(
        self,
        success: Any,
        reward: Any = None,
        *,
        tenant: str = DEFAULT_TENANT,
        metadata: Mapping[str, Any] | None = None,
    ) -> StorableEpisode:
        """The finished episode as a trajectory (a new id each call), made valid, or the reason
        it cannot be stored (never raises).

        Args:
            success: whether the episode succeeded (None: unknown; not true/false: unknown, noted).
            reward: the outcome's reward (default: :attr:`total_reward`).
            tenant: the tenant that owns it.
            metadata: stored with it; its strings (and lists of strings) are made valid.

        Returns:
            A :class:`StorableEpisode`: the trajectory, or None with the reason.
        """
        made = dict(self.made_valid)  # this call's tally: the record's own stays as recorded
        success, changed = storable_success(success)
        if changed:
            made["success"] = 1
        if reward is None:
            reward = self.total_reward
            if reward is None and not made.get("reward"):
                made["reward"] = 1  # finite rewards whose sum overflowed
        else:
            reward, changed = storable_reward(reward)
            if changed:
                made["reward"] = made.get("reward", 0) + 1
        meta = self._metadata(metadata, made)
        if self.dropped_steps:
            made["steps"] = self.dropped_steps
            meta["dropped_steps"] = self.dropped_steps
        made_valid = {kind: made[kind] for kind in MADE_VALID_KINDS if made.get(kind)}
        if made_valid:
            meta["made_valid"] = made_valid
        env_problem = env_name_problem(self.env) or ("contains a NUL character" if "\x00" in self.env else None)
        if env_problem:
            return StorableEpisode(None, made_valid, "env_name", f"env: {env_problem}")
        if not self.task.strip() and not self.initial_observation.strip():
            return StorableEpisode(None, made_valid, "no_task", "neither the task nor the first observation has text")
        try:
            trajectory = Trajectory(
                env=self.env,
                task=self.task,
                steps=tuple(self.steps) or (Step(action="(no action)"),),
                outcome=Outcome(success=success, reward=reward),
                id=f"ep-{uuid.uuid4().hex}",
                initial_observation=self.initial_observation,
                metadata=meta,
                tenant=tenant,
            )
        except InvalidTrajectoryError as exc:  # a tenant or metadata the rule does not mend
            return StorableEpisode(None, made_valid, "refused", str(exc))
        return StorableEpisode(trajectory, made_valid)

    def trajectory(
        self,
        success: bool | None,
        reward: float | None = None,
        *,
        tenant: str = DEFAULT_TENANT,
        metadata: dict[str, Any] | None = None,
    ) -> Trajectory:
        """The finished episode as a trajectory (a new id each call), made valid as
        :meth:`storable` makes it; ``reward`` defaults to :attr:`total_reward`.

        Raises:
            InvalidTrajectoryError: when it cannot be stored; the message says why.
        """
        result = self.storable(success, reward, tenant=tenant, metadata=metadata)
        if result.trajectory is None:
            raise InvalidTrajectoryError(f"episode not storable ({result.not_stored}): {result.problem}")
        return result.trajectory

    # -- helpers ----------------------------------------------------------------------------------
    def _text(self, value: Any, keep: int | None = None, made: dict[str, int] | None = None) -> str:
        """``value`` made valid (:func:`storable_text`), its changes counted in ``made``
        (default: the record's :attr:`made_valid`)."""
        text, changes = storable_text(value, keep)
        tally = self.made_valid if made is None else made
        for kind in changes:
            tally[kind] = tally.get(kind, 0) + 1
        return text

    def _metadata(self, metadata: Mapping[str, Any] | None, made: dict[str, int]) -> dict[str, Any]:
        """``metadata`` with its keys, its strings and its lists of strings made valid (other
        values are the model's to judge), the changes counted in ``made``."""
        out: dict[str, Any] = {}
        for key, value in (metadata or {}).items():
            if isinstance(value, str):
                value = self._text(value, made=made)
            elif isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value):
                value = [self._text(item, made=made) for item in value]
            out[self._text(key, made=made)] = value
        return out
