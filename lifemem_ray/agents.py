"""Agents that act in the rollout environments, with or without the memory.

* :class:`ExemplarAgent` (offline, no LLM): follows the retrieved trajectories. At each
  step it picks the valid action that best matches the next step of the exemplars it is
  aligned with, and explores (seeded) otherwise. A nearest-neighbour imitation baseline:
  its success rate measures how useful what the memory returns is, without an LLM.
* :class:`ReActAgent`: an LLM through the project's OpenAI-compatible client, with the
  retrieved trajectories and skills in its prompt under a token budget.
* :class:`GoldAgent` / :class:`NoisyGoldAgent`: scripted data collection where the
  environment knows a solution (noisy: a random valid action with probability epsilon).

Agents are deterministic given their seed and the task id, so a task retried after a
crash produces the same trajectory (and the memory stores it once).
"""

from __future__ import annotations

import abc
import hashlib
import random
import re
from dataclasses import dataclass
from typing import Any, Sequence

from .envs.base import Task
from .model import Trajectory
from .retrieval import Retrieval

__all__ = ["AGENTS", "Agent", "AgentStep", "ExemplarAgent", "GoldAgent", "NoisyGoldAgent", "RandomAgent", "ReActAgent", "make_agent"]


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
    def start(self, task: Task, observation: str, info: dict[str, Any], memory: Retrieval | None, gold: list[str] | None = None) -> None:
        """Begin an episode: the task, the first observation and what the memory returned."""

    @abc.abstractmethod
    def act(self, observation: str, info: dict[str, Any]) -> AgentStep:
        """The next action, given the latest observation."""

    def close(self) -> None:
        """Free what the agent holds (an HTTP client)."""


# -- offline agents -----------------------------------------------------------------------

_WORD = re.compile(r"[a-z0-9]+")


def _words(text: str) -> frozenset[str]:
    return frozenset(_WORD.findall(text.lower()))


def action_similarity(a: str, b: str) -> float:
    """1 for the same action, else the word overlap (Jaccard) of the two."""
    if a.strip().lower() == b.strip().lower():
        return 1.0
    wa, wb = _words(a), _words(b)
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

    def start(self, task: Task, observation: str, info: dict[str, Any], memory: Retrieval | None, gold: list[str] | None = None) -> None:
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

    def __init__(self, seed: int = 0, *, min_match: float = 0.5, lookahead: int = 3, failed_weight: float = 0.25,
                 state_match: float = 0.6) -> None:
        super().__init__(seed)
        self.state_match = state_match
        if not 0.0 < min_match <= 1.0:
            raise ValueError(f"ExemplarAgent: min_match must be in (0, 1], got {min_match!r}")
        self.min_match = min_match
        self.lookahead = lookahead
        self.failed_weight = failed_weight
        self._exemplars: list[tuple[Trajectory, float]] = []
        self._pos: list[int] = []
        self.imitated = 0
        self.explored = 0

    def start(self, task: Task, observation: str, info: dict[str, Any], memory: Retrieval | None, gold: list[str] | None = None) -> None:
        super().start(task, observation, info, memory, gold)
        self._exemplars = []
        if memory is not None:
            for hit in memory.trajectories:
                traj = hit.trajectory
                if traj.env == task.env and traj.metadata.get("task_id") == task.id:
                    continue  # this very task's own earlier run: imitating it would be cheating
                weight = max(hit.score, 0.0) * (1.0 if traj.outcome.success is not False else self.failed_weight)
                self._exemplars.append((traj, weight))
        self._pos = [0] * len(self._exemplars)
        self._tried: set[tuple[int, str]] = set()
        self.imitated = self.explored = 0

    def act(self, observation: str, info: dict[str, Any]) -> AgentStep:
        valid = info.get("valid_actions")
        proposals: dict[str, float] = {}
        seen = _words(observation)
        state = hash(observation)
        for (traj, weight), pos in zip(self._exemplars, self._pos):
            if pos < len(traj.steps):
                wanted = traj.steps[pos].action
                proposals[wanted] = proposals.get(wanted, 0.0) + weight
            # State matching: where the exemplar saw (almost) this observation, what did it do next?
            before = _words(traj.initial_observation)
            for step in traj.steps:
                if before and seen:
                    sim = len(before & seen) / len(before | seen)
                    if sim >= self.state_match:
                        proposals[step.action] = proposals.get(step.action, 0.0) + weight * sim * 0.5
                before = _words(step.observation)
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
        if best is not None:
            step = AgentStep(best[1], f"following {len(proposals)} exemplar step(s)")
            self.imitated += 1
        else:
            step = self._explore(info, exclude={a for (st, a) in self._tried if st == state})
            self.explored += 1
        self._tried.add((state, step.action))  # never the same action twice in the same state: no loops
        self._advance(step.action)
        self._last = step.action
        return step

    def _advance(self, action: str) -> None:
        for i, (traj, _) in enumerate(self._exemplars):
            pos = self._pos[i]
            for ahead in range(pos, min(len(traj.steps), pos + self.lookahead + 1)):
                if action_similarity(action, traj.steps[ahead].action) >= self.min_match:
                    self._pos[i] = ahead + 1
                    break


class GoldAgent(Agent):
    """Replays the environment's known solution."""

    name = "gold"
    uses_gold = True

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._plan: list[str] = []
        self._i = 0

    def start(self, task: Task, observation: str, info: dict[str, Any], memory: Retrieval | None, gold: list[str] | None = None) -> None:
        if not gold:
            raise ValueError(f"{self.name} agent: environment {task.env!r} has no gold actions for task {task.id!r}")
        self._plan = list(gold)
        self._i = 0

    def act(self, observation: str, info: dict[str, Any]) -> AgentStep:
        if self._i >= len(self._plan):
            return AgentStep(self._plan[-1] if self._plan else "look", "plan exhausted")
        action = self._plan[self._i]
        self._i += 1
        return AgentStep(action, "following the known solution")


class NoisyGoldAgent(GoldAgent):
    """The known solution, with a random valid action instead of the planned one with
    probability ``epsilon`` (the plan resumes afterwards): realistic successes and failures."""

    name = "noisy-gold"

    def __init__(self, seed: int = 0, epsilon: float = 0.2) -> None:
        super().__init__(seed)
        if not 0.0 <= epsilon <= 1.0:
            raise ValueError(f"noisy-gold agent: epsilon must be in [0, 1], got {epsilon!r}")
        self.epsilon = epsilon
        self._rng = random.Random(seed)

    def start(self, task: Task, observation: str, info: dict[str, Any], memory: Retrieval | None, gold: list[str] | None = None) -> None:
        super().start(task, observation, info, memory, gold)
        self._rng = random.Random(task_seed(self.seed, task))

    def act(self, observation: str, info: dict[str, Any]) -> AgentStep:
        valid = info.get("valid_actions")
        if valid and self._rng.random() < self.epsilon:
            return AgentStep(self._rng.choice(sorted(valid)), "a deliberate deviation")
        return super().act(observation, info)


# -- the LLM agent ------------------------------------------------------------------------


class ReActAgent(Agent):
    """Thought + action per turn from an OpenAI-compatible model; the memory's rendered
    context (skills, then exemplars, within ``retrieval.token_budget``) is in the prompt.

    Every answer is validated: JSON with ``thought`` and ``action``; where the environment
    lists valid actions, the action must be one of them (matched case- and
    space-insensitively). An invalid or failed answer does not end the episode: the agent
    sends a no-op the environment rejects (``invalid_action``), counted in ``invalid``.
    """

    name = "react"

    def __init__(self, llm_config: Any, *, seed: int = 0, client: Any = None, history_chars: int = 12000) -> None:
        from .llm import LLMClient

        self.config = llm_config
        self._client = client or LLMClient(llm_config)
        self._owns_client = client is None
        self.history_chars = history_chars
        self._instruction = ""
        self._context = ""
        self._history: list[tuple[str, str]] = []
        self._pending: str | None = None
        self.invalid = 0
        self.calls = 0

    def start(self, task: Task, observation: str, info: dict[str, Any], memory: Retrieval | None, gold: list[str] | None = None) -> None:
        self._instruction = info.get("instruction") or task.instruction
        self._context = memory.context if memory is not None else ""
        self._history = []
        self._pending = None
        self.invalid = self.calls = 0

    def act(self, observation: str, info: dict[str, Any]) -> AgentStep:
        from .llm import schema_errors
        from .prompts import ACT_MAX_CHARS, act_prompt

        if self._pending is not None:
            self._history.append((self._pending, observation))
        valid: Sequence[str] | None = info.get("valid_actions")
        # The latest action's result is the current observation: shown once, in full.
        shown = self._history[:-1] + [(self._history[-1][0], "")] if self._history else []
        prompt = act_prompt(self._instruction, self._context, shown, observation, valid, char_budget=self.history_chars)
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

        self.calls += 1
        step = self._client.request(prompt, self.config.model, check)
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


AGENTS = {"exemplar": ExemplarAgent, "random": RandomAgent, "gold": GoldAgent, "noisy-gold": NoisyGoldAgent, "react": ReActAgent}


def make_agent(name: str, *, seed: int = 0, llm_config: Any = None, **options: Any) -> Agent:
    """An agent by name; ``react`` needs ``llm_config`` (an :class:`~lifemem_ray.config.LLMConfig`)."""
    if name not in AGENTS:
        raise ValueError(f"unknown agent {name!r}; known: {', '.join(sorted(AGENTS))}")
    if name == "react":
        if llm_config is None or getattr(llm_config, "backend", "offline") != "openai":
            raise ValueError("agent 'react' needs llm.backend = 'openai' with llm.base_url and llm.model set")
        return ReActAgent(llm_config, seed=seed, **options)
    return AGENTS[name](seed=seed, **options)
