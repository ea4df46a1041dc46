"""Agents that act in the rollout environments, with or without the memory.

* :class:`ExemplarAgent` (offline, no LLM): follows the retrieved trajectories. At each
  step it picks the valid action that best matches the next step of the exemplars it is
  aligned with, and explores (seeded) otherwise. A nearest-neighbour imitation baseline:
  its success rate measures how useful what the memory returns is, without an LLM.
* :class:`SkillGuidedAgent` (offline, no LLM): the exemplar agent on this environment's
  exemplars; where none applies (none retrieved, all from other environments, none matching)
  it follows the retrieved skills' procedures, mapping the valid actions to their steps by
  workflow category, verb frame and argument roles (:mod:`lifemem_ray.engine.clustering.steps`). Its success
  over the exemplar agent's measures what the skills add, without an LLM.
* :class:`ReActAgent`: an LLM through the project's OpenAI-compatible client, with the
  retrieved skills as guidance and the retrieved trajectories as example data in its
  prompt, under a token budget.
* :class:`GoldAgent` / :class:`NoisyGoldAgent`: scripted data collection where the
  environment knows a solution (noisy: a random valid action with probability epsilon).
  Their steps carry no thought: a label such as "following the known solution" would be
  stored in the trajectory and shown to later agents as if it were reasoning.

Agents are deterministic given their seed and the task id, so a task retried after a
crash produces the same trajectory (and the memory stores it once).
"""

from __future__ import annotations

import abc
import functools
import hashlib
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lifemem_ray.core.errors import ConfigError, InvalidArgumentError, TaskError
from lifemem_ray.core.model import Trajectory
from lifemem_ray.engine.clustering.steps import AbstractStep, abstract_step, goal_words
from lifemem_ray.engine.clustering.workflow import canonical_token
from lifemem_ray.engine.retrieval import Retrieval
from lifemem_ray.lab.envs.base import Task

__all__ = [
    "AGENTS",
    "Agent",
    "AgentStep",
    "ExemplarAgent",
    "GoldAgent",
    "NoisyGoldAgent",
    "RandomAgent",
    "ReActAgent",
    "SkillGuidedAgent",
    "SkillStep",
    "make_agent",
    "parse_procedure",
    "step_match",
]


@dataclass(frozen=True)
class AgentStep:
    action: str
    thought: str = ""


def task_seed(seed: int, task: Task) -> int:
    """A per-task seed: stable across processes (unlike ``hash``)."""
    digest = hashlib.blake2b(f"{seed}\x00{task.env}\x00{task.id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class Agent(abc.ABC):
    """One agent instance runs one episode at a time."""

    name = "agent"
    uses_gold = False  # the runner passes env.gold_actions(task) to start()

    @abc.abstractmethod
    def start(
        self,
        task: Task,
        observation: str,
        info: dict[str, Any],
        memory: Retrieval | None,
        gold: list[str] | None = None,
    ) -> None:
        """Begin an episode: the task, the first observation and what the memory returned."""

    @abc.abstractmethod
    def act(self, observation: str, info: dict[str, Any]) -> AgentStep:
        """The next action, given the latest observation."""

    async def astart(
        self,
        task: Task,
        observation: str,
        info: dict[str, Any],
        memory: Retrieval | None,
        gold: list[str] | None = None,
    ) -> None:
        """:meth:`start` for the async episode loop (:func:`lifemem_ray.lab.episode.arun_episode`):
        inline, as no agent here waits on anything to start."""
        self.start(task, observation, info, memory, gold)

    async def aact(self, observation: str, info: dict[str, Any]) -> AgentStep:
        """:meth:`act` for the async episode loop: inline by default (the offline agents
        compute in microseconds); an agent that waits on a server awaits it instead."""
        return self.act(observation, info)

    def close(self) -> None:  # noqa: B027 - optional: most agents hold nothing to free
        """Free what the agent holds (an HTTP client)."""


# -- offline agents -----------------------------------------------------------------------

_WORD = re.compile(r"[a-z0-9]+")


def _words(text: str) -> frozenset[str]:
    return frozenset(_WORD.findall(text.lower()))


@functools.lru_cache(maxsize=16_384)
def _action_words(action: str) -> frozenset[str]:
    """An action's words, kept: an episode compares the same few actions at every step."""
    return _words(action)


def _observations_before_steps(traj: Trajectory) -> list[frozenset[str]]:
    """The words of what ``traj`` saw before each of its steps (one set per step)."""
    seen = [traj.initial_observation] + [step.observation for step in traj.steps]
    return [_words(text) for text in seen[: len(traj.steps)]]


def action_similarity(a: str, b: str) -> float:
    """1 for the same action, else the word overlap (Jaccard) of the two."""
    if a.strip().lower() == b.strip().lower():
        return 1.0
    wa, wb = _action_words(a), _action_words(b)
    if not wa or not wb:
        return 0.0
    return len(wa & wb) / len(wa | wb)


class RandomAgent(Agent):
    """Uniform over the valid actions (seeded per task): the floor of every comparison."""

    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._rng = random.Random(seed)
        self._last: str | None = None

    def start(
        self,
        task: Task,
        observation: str,
        info: dict[str, Any],
        memory: Retrieval | None,
        gold: list[str] | None = None,
    ) -> None:
        self._rng = random.Random(task_seed(self.seed, task))
        self._last = None

    def _explore(self, info: dict[str, Any], exclude: set[str] = frozenset()) -> AgentStep:  # type: ignore[assignment]
        valid = list(info.get("valid_actions") or [])
        if not valid:
            return AgentStep("look", "no valid actions listed: looking around")
        fresh = [a for a in valid if a not in exclude]
        valid = fresh or valid
        if len(valid) > 1 and self._last in valid:
            valid.remove(self._last)  # do not repeat an action just taken
        action = self._rng.choice(sorted(valid))
        self._last = action
        return AgentStep(action, "exploring")

    def act(self, observation: str, info: dict[str, Any]) -> AgentStep:
        return self._explore(info)


class ExemplarAgent(RandomAgent):
    """Follows the retrieved trajectories step by step, explores when none applies.

    Each exemplar keeps an alignment pointer: after every action the agent takes, the
    pointer moves past the exemplar step it matches (looking a few steps ahead), so an
    exemplar is followed in order even when the two runs differ for a while. Where an
    exemplar met (almost) the current observation (word overlap >= ``state_match``), its
    next action there is proposed too, at half weight: a state-to-action neighbour. Successful
    exemplars weigh more than failed ones; an action whose best match scores below
    ``min_match`` is not imitated.
    """

    name = "exemplar"

    def __init__(
        self,
        seed: int = 0,
        *,
        min_match: float = 0.5,
        lookahead: int = 3,
        failed_weight: float = 0.25,
        state_match: float = 0.6,
    ) -> None:
        super().__init__(seed)
        self.state_match = state_match
        if not 0.0 < min_match <= 1.0:
            raise InvalidArgumentError(f"min_match must be in (0, 1], got {min_match!r}", where="ExemplarAgent")
        self.min_match = min_match
        self.lookahead = lookahead
        self.failed_weight = failed_weight
        self._exemplars: list[tuple[Trajectory, float]] = []
        # each exemplar's observations as word sets, the one before each of its steps (computed
        # once at start: every act compares the current observation with all of them)
        self._seen_before: list[list[frozenset[str]]] = []
        self._pos: list[int] = []
        self.imitated = 0
        self.explored = 0

    def start(
        self,
        task: Task,
        observation: str,
        info: dict[str, Any],
        memory: Retrieval | None,
        gold: list[str] | None = None,
    ) -> None:
        super().start(task, observation, info, memory, gold)
        self._exemplars = []
        if memory is not None:
            for hit in memory.trajectories:
                traj = hit.trajectory
                if not self._admits(traj, task):
                    continue
                weight = max(hit.score, 0.0) * (1.0 if traj.outcome.success is not False else self.failed_weight)
                self._exemplars.append((traj, weight))
        self._seen_before = [_observations_before_steps(traj) for traj, _ in self._exemplars]
        self._pos = [0] * len(self._exemplars)
        self._tried: set[tuple[int, str]] = set()
        self.imitated = self.explored = 0

    def _admits(self, traj: Trajectory, task: Task) -> bool:
        """Whether a retrieved trajectory may be imitated: not this very task's own earlier run
        (imitating it would be cheating)."""
        return not (traj.env == task.env and traj.metadata.get("task_id") == task.id)

    def act(self, observation: str, info: dict[str, Any]) -> AgentStep:
        state = hash(observation)
        step = self._imitate(observation, info, state)
        if step is None:
            step = self._fallback(observation, info, state)
        self._tried.add((state, step.action))  # never the same action twice in the same state: no loops
        self._advance(step.action)
        self._last = step.action
        return step

    def _fallback(self, observation: str, info: dict[str, Any], state: int) -> AgentStep:
        """What to do when no exemplar proposes an action: seeded exploration."""
        self.explored += 1
        return self._explore(info, exclude={a for (st, a) in self._tried if st == state})

    def _imitate(self, observation: str, info: dict[str, Any], state: int) -> AgentStep | None:
        """The action the exemplars propose here, or None when none applies."""
        valid = info.get("valid_actions")
        proposals: dict[str, float] = {}
        seen = _words(observation)
        for (traj, weight), pos, views in zip(self._exemplars, self._pos, self._seen_before, strict=True):
            if pos < len(traj.steps):
                wanted = traj.steps[pos].action
                proposals[wanted] = proposals.get(wanted, 0.0) + weight
            # State matching: where the exemplar saw (almost) this observation, what did it do next?
            for step, before in zip(traj.steps, views, strict=True):
                if before and seen:
                    sim = len(before & seen) / len(before | seen)
                    if sim >= self.state_match:
                        proposals[step.action] = proposals.get(step.action, 0.0) + weight * sim * 0.5
        best: tuple[float, str] | None = None
        if proposals:
            if valid:
                for action in sorted(valid):
                    score = 0.0
                    for wanted, weight in proposals.items():
                        sim = action_similarity(action, wanted)
                        if sim >= self.min_match:
                            score += weight * sim
                    if score > 0 and (state, action) not in self._tried and (best is None or score > best[0]):
                        best = (score, action)
            else:  # free-form environment: repeat the best-supported exemplar action
                wanted, weight = max(proposals.items(), key=lambda kv: (kv[1], kv[0]))
                best = (weight, wanted)
        if best is None:
            return None
        self.imitated += 1
        return AgentStep(best[1], f"following {len(proposals)} exemplar step(s)")

    def _advance(self, action: str) -> None:
        for i, (traj, _) in enumerate(self._exemplars):
            pos = self._pos[i]
            for ahead in range(pos, min(len(traj.steps), pos + self.lookahead + 1)):
                if action_similarity(action, traj.steps[ahead].action) >= self.min_match:
                    self._pos[i] = ahead + 1
                    break


# -- following skills ---------------------------------------------------------------------

_NUMBERED = re.compile(r"^\s*(?:step\s*)?\d{1,2}\s*[.):]\s+(\S.*)$", re.I)
_BULLET = re.compile(r"^\s*[-*\u2022]\s+(\S.*)$")
MAX_BULLET_WORDS = 12  # a longer bullet (placeholders counting one word) is a remark, not a step
MAX_PROCEDURE_STEPS = 40
MAX_STEP_CHARS = 300
MIN_SKILL_WEIGHT = 0.01  # a skill retrieved with score <= 0 still guides, barely
# Role placeholders a skill writes instead of one run's values (lifemem_ray.engine.clustering.skills, or an LLM).
_ANGLE = re.compile(r"<([^<>\n]{1,40})>")
_NAMED_ROLE = re.compile(
    r"\b(?:the|an?)\s+(?:\w+\s+)?(?:object|item|place|thing|location|target|value|room|container)s?\s+"
    r"(?:named|given|mentioned)\s+in\s+the\s+(?:goal|task|instruction)\b",
    re.I,
)
_ANY_ROLE = re.compile(
    r"\b(?:the|an?|any)\s+(?:(?:right|next|correct|matching|relevant|required|target|other|same)\s+)?"
    r"(?:object|item|place|thing|location|container)s?\b",
    re.I,
)
_SENTINEL = {"goal": "slotgoal", "any": "slotany", "dir": "slotdir", "num": "slotnum"}
_SENTINEL_KIND = {word: kind for kind, word in _SENTINEL.items()}
_SAMPLE = {"slotdir": "north", "slotnum": "1"}  # what a placeholder stands for when the step's token is read
_FILLER = frozenset(["a", "an", "the", "or"])
# How a procedure step and a valid action are compared (see SkillGuidedAgent).
CATEGORY_WEIGHT, FRAME_WEIGHT, SLOT_WEIGHT = 0.2, 0.3, 0.5
_SLOT_SCORE = {"any": 0.5, "dir": 0.5, "num": 0.5}  # a placeholder is weaker evidence than a literal
SHOWN_LITERAL, SHOWN_BONUS = 0.5, 0.25  # an argument the latest observation names (see step_match)


@dataclass(frozen=True, slots=True)
class SkillStep:
    """One step of a skill's procedure, parsed once: its category and verb frame (through
    :func:`lifemem_ray.engine.clustering.steps.abstract_step`), the kind of each argument slot (``lit``, or a
    placeholder: ``goal``, ``any``, ``dir``, ``num``) and its literal argument words."""

    text: str
    token: str
    frame: str
    category: str
    kinds: tuple[str, ...]
    words: frozenset[str]  # literal argument words, alternatives ("salt or red apple") included
    all_words: frozenset[str]  # every literal word, the verb included


def _placeholders(text: str) -> str:
    """``text`` with its role placeholders replaced by sentinel words."""

    def angle(m: re.Match[str]) -> str:
        inner = m.group(1).lower()
        if "goal" in inner or "task" in inner:
            return _SENTINEL["goal"]
        if "direction" in inner:
            return _SENTINEL["dir"]
        if "number" in inner or re.search(r"\bid\b", inner):
            return _SENTINEL["num"]
        return _SENTINEL["any"]

    text = _ANGLE.sub(angle, text)
    text = _NAMED_ROLE.sub(_SENTINEL["goal"], text)
    return _ANY_ROLE.sub(_SENTINEL["any"], text)


def _slot_kind(role: str) -> str:
    if role.startswith("lit:"):
        for word in role[4:].split():
            if word in _SENTINEL_KIND:
                return _SENTINEL_KIND[word]
        return "lit"
    if role in ("dir", "number", "id", "goal"):
        return "lit"  # a direction or number the step itself names
    return "any"  # a call's value (expr, list, flag ...) or an empty slot


def parse_step(text: str) -> SkillStep | None:
    """One procedure line as a :class:`SkillStep` (None for a thought-only line)."""
    text = " ".join(text.split())[:MAX_STEP_CHARS].rstrip(" .;:")
    if not text:
        return None
    marked = _placeholders(text)
    sample = " ".join(_SAMPLE.get(w, w) for w in marked.split(" "))
    token = abstract_step(sample, frozenset()).token
    category = canonical_token(token)
    if category == "THINK":
        return None
    parsed = abstract_step(marked, frozenset())  # no goal: the step's own words stay literals
    fixed = {w for w in _WORD.findall(parsed.frame) if w not in _SENTINEL_KIND}
    words = _words(marked) - _FILLER - set(_SENTINEL_KIND)
    return SkillStep(
        text,
        token,
        parsed.frame,
        category,
        tuple(_slot_kind(r) for r in parsed.roles),
        frozenset(words - fixed),
        frozenset(words),
    )


def parse_procedure(text: str) -> tuple[SkillStep, ...]:
    """The ordered steps of a skill: its numbered lines (``1. pick up thermometer``), or, in
    a skill without any, its short bullet lines; every other line (headers, remarks, prose)
    is ignored, so free LLM text yields few or no steps rather than wrong ones.

    >>> [s.text for s in parse_procedure("Procedure (3 of 3 runs succeeded):\\n1. look around\\n"
    ...                                   "2. take the object named in the goal.\\nUsual failure: none.")]
    ['look around', 'take the object named in the goal']
    >>> parse_procedure("Be careful and check your work before you answer.")
    ()
    """
    lines = text.splitlines()[: 4 * MAX_PROCEDURE_STEPS]
    found = [m.group(1) for m in map(_NUMBERED.match, lines) if m]
    if not found:
        found = [
            m.group(1)
            for m in map(_BULLET.match, lines)
            if m and len(_placeholders(m.group(1)).split()) <= MAX_BULLET_WORDS
        ]
    steps = (parse_step(line) for line in found[:MAX_PROCEDURE_STEPS])
    return tuple(s for s in steps if s is not None)


@dataclass(frozen=True, slots=True)
class _Action:
    """A valid action as the skill matcher reads it (relative to the task's goal)."""

    text: str
    step: AbstractStep
    category: str
    words: frozenset[str]


def _read_action(text: str, goal: frozenset[str]) -> _Action:
    step = abstract_step(text, goal)
    return _Action(" ".join(text.lower().split()), step, canonical_token(step.token), _words(text))


def step_match(action: _Action, step: SkillStep, seen: frozenset[str] = frozenset()) -> float:
    """How well ``action`` carries out ``step``, in [0, 1]: the same category, the same verb
    frame (or at least verb), and arguments that fit the step's slots: a literal the step
    names, a goal word where it says "the object named in the goal", any argument of the
    right kind where it says "the object" or "<direction>". An argument the latest
    observation names (``seen``: its words) fits a literal slot it does not match at half
    credit, and a placeholder slot a little better: what the environment just showed is
    usually what the step is about (the ingredients in the fridge, the item a note asks for)."""
    if action.text == " ".join(step.text.lower().split()):
        return 1.0
    score = CATEGORY_WEIGHT * (action.category == step.category)
    if action.step.frame != step.frame:
        if action.step.token == step.token:
            score += FRAME_WEIGHT / 2
        union = action.words | step.all_words
        return score + (SLOT_WEIGHT * len(action.words & step.all_words) / len(union) if union else 0.0)
    score += FRAME_WEIGHT
    if not step.kinds or len(step.kinds) != len(action.step.roles):
        return score + SLOT_WEIGHT
    phrases = action.step.phrases or ("",) * len(step.kinds)
    fits = [
        _slot_fit(kind, role, phrase, step.words, seen)
        for kind, role, phrase in zip(step.kinds, action.step.roles, phrases, strict=False)
    ]
    return score + SLOT_WEIGHT * sum(fits) / len(fits)


def _slot_fit(kind: str, role: str, phrase: str, literals: frozenset[str], seen: frozenset[str]) -> float:
    words = _words(phrase) - _FILLER
    shown = bool(words) and words <= seen
    if kind == "lit":
        return max(len(words & literals) / len(words) if words else 0.0, SHOWN_LITERAL * shown)
    if kind == "goal":
        return 1.0 if role == "goal" else 0.0
    if kind == "dir":
        return _SLOT_SCORE["dir"] if role == "dir" else 0.0
    if kind == "num":
        return _SLOT_SCORE["num"] if role in ("number", "id") else 0.0
    return _SLOT_SCORE["any"] + SHOWN_BONUS * shown


class SkillGuidedAgent(ExemplarAgent):
    """An :class:`ExemplarAgent` that follows the retrieved skills' procedures when no
    exemplar of this environment applies (none retrieved, all from other environments, or
    none matching the valid actions here).

    Each skill's numbered steps are parsed once (:func:`parse_procedure`) and followed with
    a pointer, as the exemplar agent follows a trajectory. At each turn every valid action
    is scored (:func:`step_match`) against the skill's last step (it may repeat: procedures
    collapse repeats, e.g. several moves), its current step and the next ``skill_lookahead``
    ones, each later step weighing ``decay`` times less; a skill supports an action by its
    best such score when it reaches ``skill_match``, weighted by the skill's retrieval score.
    The best-supported action not yet tried in this state is taken (ties broken by the seeded
    generator), and the pointer moves past the step it carried out. Where the environment
    lists no valid actions, the current step's text is the action. Otherwise: seeded
    exploration. Nothing here knows an environment: only the project's action categories,
    verb frames and argument roles.

    >>> from lifemem_ray.lab.envs import Task
    >>> from lifemem_ray.engine.retrieval import Retrieval, RetrievedSkill
    >>> skill = RetrievedSkill(1, "Procedure:\\n1. open the door\\n2. take the object named in the goal", 0.9)
    >>> task = Task("house", "t1", "Find the red key and take it.")
    >>> agent = SkillGuidedAgent(seed=0)
    >>> agent.start(task, "A hall.", {}, Retrieval(task.instruction, "house", skills=[skill]))
    >>> agent.act("A hall.", {"valid_actions": ["go north", "open door", "take lamp"]}).action
    'open door'
    >>> agent.act("The door is open.", {"valid_actions": ["go north", "take lamp", "take red key"]}).action
    'take red key'
    """

    name = "skill-guided"

    def __init__(
        self,
        seed: int = 0,
        *,
        skill_match: float = 0.2,
        skill_lookahead: int = 3,
        decay: float = 0.8,
        repeat: float = 0.8,
        **exemplar_options: Any,
    ) -> None:
        super().__init__(seed, **exemplar_options)
        if not 0.0 < skill_match <= 1.0:
            raise InvalidArgumentError(f"skill_match must be in (0, 1], got {skill_match!r}", where="SkillGuidedAgent")
        if not (0.0 < decay <= 1.0 and 0.0 <= repeat <= 1.0) or skill_lookahead < 0:
            raise InvalidArgumentError(
                "decay must be in (0, 1], repeat in [0, 1], skill_lookahead >= 0",
                where="SkillGuidedAgent",
            )
        self.skill_match, self.skill_lookahead, self.decay, self.repeat = skill_match, skill_lookahead, decay, repeat
        self._skills: list[tuple[tuple[SkillStep, ...], float]] = []
        self._spos: list[int] = []
        self._goal: frozenset[str] = frozenset()
        self._read: dict[str, _Action] = {}
        self._seen: frozenset[str] = frozenset()
        self._uses: dict[str, int] = {}
        self.guided = 0

    def start(
        self,
        task: Task,
        observation: str,
        info: dict[str, Any],
        memory: Retrieval | None,
        gold: list[str] | None = None,
    ) -> None:
        super().start(task, observation, info, memory, gold)
        self._goal = goal_words(info.get("instruction") or task.instruction)
        self._skills = []
        for skill in memory.skills if memory is not None else ():
            steps = parse_procedure(skill.text)
            if steps:
                self._skills.append((steps, max(skill.score, MIN_SKILL_WEIGHT)))
        self._spos = [0] * len(self._skills)
        self._read, self._uses = {}, {}
        self.guided = 0

    def _admits(self, traj: Trajectory, task: Task) -> bool:
        """Only exemplars of this very environment are imitated; the skills carry the rest."""
        return traj.env == task.env and super()._admits(traj, task)

    def act(self, observation: str, info: dict[str, Any]) -> AgentStep:
        self._seen = _words(observation[-4000:])
        return super().act(observation, info)

    def _fallback(self, observation: str, info: dict[str, Any], state: int) -> AgentStep:
        step = self._follow_skills(info, state)
        if step is None:
            return super()._fallback(observation, info, state)
        self.guided += 1
        return step

    def _action(self, text: str) -> _Action:
        read = self._read.get(text)
        if read is None:
            if len(self._read) > 4096:
                self._read.clear()
            read = self._read[text] = _read_action(text, self._goal)
        return read

    def _support(self, action: str, steps: tuple[SkillStep, ...], pos: int) -> tuple[float, int]:
        """(score, step index) of the step of this skill that ``action`` carries out best."""
        read, seen = self._action(action), self._seen
        best = (0.0, -1)
        if pos > 0:  # the step just carried out, again: less each time this action was taken (no loops)
            best = (self.repeat * step_match(read, steps[pos - 1], seen) / (1 + self._uses.get(action, 0)), pos - 1)
        for ahead in range(min(self.skill_lookahead + 1, len(steps) - pos)):
            score = self.decay**ahead * step_match(read, steps[pos + ahead], seen)
            if score > best[0]:
                best = (score, pos + ahead)
        return best

    def _follow_skills(self, info: dict[str, Any], state: int) -> AgentStep | None:
        valid = info.get("valid_actions")
        if not valid:  # free-form environment: the current step of the best-weighted skill, as written
            live = [
                (weight, -i)
                for i, ((steps, weight), pos) in enumerate(zip(self._skills, self._spos, strict=True))
                if pos < len(steps)
            ]
            if not live:
                return None
            i = -max(live)[1]
            step = self._skills[i][0][self._spos[i]]
            return AgentStep(step.text, f"following skill step {self._spos[i] + 1}")
        tried = {a for (st, a) in self._tried if st == state}
        totals: dict[str, float] = {}
        why: dict[str, tuple[float, str]] = {}
        for action in sorted(set(valid) - tried):
            total = 0.0
            for (steps, weight), pos in zip(self._skills, self._spos, strict=True):
                score, j = self._support(action, steps, pos)
                if score >= self.skill_match:
                    total += weight * score
                    if score > why.get(action, (0.0, ""))[0]:
                        why[action] = (score, f"following skill step {j + 1}: {steps[j].text[:120]}")
            if total > 0:
                totals[action] = round(total, 9)
        if not totals:
            return None
        top = max(totals.values())
        best = [a for a, t in totals.items() if t == top]
        action = best[0] if len(best) == 1 else self._rng.choice(best)
        return AgentStep(action, why[action][1])

    def _advance(self, action: str) -> None:
        super()._advance(action)
        self._uses[action] = self._uses.get(action, 0) + 1
        for i, (steps, _) in enumerate(self._skills):
            pos = self._spos[i]
            score, j = self._support(action, steps, pos)
            if score >= self.skill_match and j >= pos:
                self._spos[i] = j + 1


class GoldAgent(Agent):
    """Replays the environment's known solution."""

    name = "gold"
    uses_gold = True

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._plan: list[str] = []
        self._i = 0

    def start(
        self,
        task: Task,
        observation: str,
        info: dict[str, Any],
        memory: Retrieval | None,
        gold: list[str] | None = None,
    ) -> None:
        if not gold:
            raise TaskError(f"{self.name} agent: environment {task.env!r} has no gold actions for task {task.id!r}")
        self._plan = list(gold)
        self._i = 0

    def act(self, observation: str, info: dict[str, Any]) -> AgentStep:
        if self._i >= len(self._plan):
            return AgentStep(self._plan[-1] if self._plan else "look")
        action = self._plan[self._i]
        self._i += 1
        return AgentStep(action)  # no thought: a data-collection label would end up in the stored trajectory


class NoisyGoldAgent(GoldAgent):
    """The known solution, with a random valid action instead of the planned one with
    probability ``epsilon`` (the plan resumes afterwards): realistic successes and failures."""

    name = "noisy-gold"

    def __init__(self, seed: int = 0, epsilon: float = 0.2) -> None:
        super().__init__(seed)
        if not 0.0 <= epsilon <= 1.0:
            raise InvalidArgumentError(f"noisy-gold agent: epsilon must be in [0, 1], got {epsilon!r}")
        self.epsilon = epsilon
        self._rng = random.Random(seed)

    def start(
        self,
        task: Task,
        observation: str,
        info: dict[str, Any],
        memory: Retrieval | None,
        gold: list[str] | None = None,
    ) -> None:
        super().start(task, observation, info, memory, gold)
        self._rng = random.Random(task_seed(self.seed, task))

    def act(self, observation: str, info: dict[str, Any]) -> AgentStep:
        valid = info.get("valid_actions")
        if valid and self._rng.random() < self.epsilon:
            return AgentStep(self._rng.choice(sorted(valid)))  # unlabelled, like the planned steps
        return super().act(observation, info)


# -- the LLM agent ------------------------------------------------------------------------


class ReActAgent(Agent):
    """Thought + action per turn from an OpenAI-compatible model, with the memory in the
    prompt (:func:`lifemem_ray.lab.agent_prompts.act_prompt`): the retrieved skills as guidance, the
    retrieved trajectories as untrusted example data headed by their environment and
    outcome, together within the token budget (``token_budget``, else the budget the
    retrieval was rendered under, else the default ``retrieval.token_budget``). This very
    task's own earlier run is not shown, as :class:`ExemplarAgent` does not imitate it.

    Every answer is validated: JSON with ``thought`` and ``action``; where the environment
    lists valid actions, the action must be one of them (matched case- and
    space-insensitively). An invalid or failed answer does not end the episode: the agent
    sends a no-op the environment rejects (``invalid_action``), counted in ``invalid``.

    :meth:`act` blocks on the model; :meth:`aact` awaits it (the async episode loop), with the
    same prompt and checks. Agents given one ``client`` share its ``llm.concurrency`` bound.
    """

    name = "react"

    def __init__(
        self,
        llm_config: Any,
        *,
        seed: int = 0,
        client: Any = None,
        history_chars: int = 12000,
        token_budget: int | None = None,
        metrics: Any = None,
    ) -> None:
        from lifemem_ray.llm.transport import LLMClient

        if token_budget is not None and token_budget < 0:
            raise InvalidArgumentError(f"token_budget must be >= 0, got {token_budget!r}", where="ReActAgent")
        self.config = llm_config
        self._client = client or LLMClient(llm_config, metrics=metrics)  # metrics: where its calls are recorded
        self._owns_client = client is None
        self.history_chars = history_chars
        self.token_budget = token_budget
        self._instruction = ""
        self._skills: list[str] = []
        self._exemplars: list[Trajectory] = []
        self._budget = 0
        self._history: list[tuple[str, str]] = []
        self._pending: str | None = None
        self.invalid = 0
        self.calls = 0

    def start(
        self,
        task: Task,
        observation: str,
        info: dict[str, Any],
        memory: Retrieval | None,
        gold: list[str] | None = None,
    ) -> None:
        from lifemem_ray.lab.agent_prompts import DEFAULT_MEMORY_TOKENS

        self._instruction = info.get("instruction") or task.instruction
        self._skills = [s.text for s in memory.skills] if memory is not None else []
        self._exemplars = []
        for hit in memory.trajectories if memory is not None else ():
            traj = hit.trajectory
            if not (traj.env == task.env and traj.metadata.get("task_id") == task.id):
                self._exemplars.append(traj)
        budget = self.token_budget if self.token_budget is not None else getattr(memory, "budget", None)
        self._budget = DEFAULT_MEMORY_TOKENS if budget is None else budget
        self._history = []
        self._pending = None
        self.invalid = self.calls = 0

    def act(self, observation: str, info: dict[str, Any]) -> AgentStep:
        prompt, check = self._turn(observation, info)
        self.calls += 1
        return self._took(self._client.request(prompt, self.config.model, check))

    async def aact(self, observation: str, info: dict[str, Any]) -> AgentStep:
        """:meth:`act` awaiting the model: the same prompt, validation, timeout and retries
        (the client's :meth:`~lifemem_ray.llm.transport.LLMClient.arequest`, on its own
        loop), and the same bound on calls in flight: ``llm.concurrency`` per client, shared
        by every agent given that client. The caller's event loop runs other episodes meanwhile."""
        prompt, check = self._turn(observation, info)
        self.calls += 1
        call = self._client.arequest(prompt, self.config.model, check)
        return self._took(await self._client.arun(call))

    def _turn(
        self, observation: str, info: dict[str, Any]
    ) -> tuple[Any, Callable[[dict[str, Any]], tuple[AgentStep | None, list[str]]]]:
        """This turn's prompt and the check its answer must pass (the history updated first)."""
        from lifemem_ray.lab.agent_prompts import ACT_MAX_CHARS, act_prompt
        from lifemem_ray.llm.answers import schema_errors

        if self._pending is not None:
            self._history.append((self._pending, observation))
        valid: Sequence[str] | None = info.get("valid_actions")
        # The latest action's result is the current observation: shown once, in full.
        shown = [*self._history[:-1], (self._history[-1][0], "")] if self._history else []
        prompt = act_prompt(
            self._instruction,
            self._skills,
            self._exemplars,
            shown,
            observation,
            valid,
            token_budget=self._budget,
            char_budget=self.history_chars,
        )
        by_key = {" ".join(a.lower().split()): a for a in valid} if valid else {}

        def check(data: dict[str, Any]) -> tuple[AgentStep | None, list[str]]:
            errors = schema_errors(data, prompt.schema)
            if errors:
                return None, errors
            action = data["action"].strip() if isinstance(data.get("action"), str) else ""
            if not action or len(action) > ACT_MAX_CHARS:
                return None, [f"action: expected 1-{ACT_MAX_CHARS} characters"]
            if by_key:
                key = " ".join(action.lower().split())
                if key not in by_key:
                    return None, [f"action {action[:80]!r} is not one of the {len(by_key)} valid actions"]
                action = by_key[key]
            return AgentStep(action, str(data.get("thought", ""))[:2000]), []

        return prompt, check

    def _took(self, step: AgentStep | None) -> AgentStep:
        """The turn's action: the validated answer, or the no-op when there was none."""
        if step is None:
            self.invalid += 1
            step = AgentStep("invalid_action", "the model gave no valid answer")
        self._pending = step.action
        return step

    def usage(self) -> dict[str, float]:
        return dict(self._client.usage().get("act", {}))

    def close(self) -> None:
        if self._owns_client:
            self._client.close()


AGENTS = {
    "exemplar": ExemplarAgent,
    "skill-guided": SkillGuidedAgent,
    "random": RandomAgent,
    "gold": GoldAgent,
    "noisy-gold": NoisyGoldAgent,
    "react": ReActAgent,
}


def make_agent(name: str, *, seed: int = 0, llm_config: Any = None, **options: Any) -> Agent:
    """An agent by name; ``react`` needs ``llm_config`` (an :class:`~lifemem_ray.llm.llm_config.LLMConfig`)."""
    if name not in AGENTS:
        raise InvalidArgumentError(f"unknown agent {name!r}; known: {', '.join(sorted(AGENTS))}")
    if name == "react":
        if llm_config is None or getattr(llm_config, "backend", "offline") != "openai":
            raise ConfigError("agent 'react' needs llm.backend = 'openai' with llm.base_url and llm.model set")
        return ReActAgent(llm_config, seed=seed, **options)
    return AGENTS[name](seed=seed, **options)
