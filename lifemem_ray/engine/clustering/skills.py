"""Offline skills: the ordered, abstract procedure a cluster's successful members follow.

A skill an agent can act on says what to do, in what order, with what: *go to the place
named in the goal; pick up thermometer; focus on the object named in the goal; ...*. Without an
LLM it is mined from the members' :mod:`abstract steps <lifemem_ray.engine.clustering.steps>`:

1. each successful member (all members when none succeeded) becomes a sequence of step
   *shapes* (frame and role kinds, repeats collapsed), each numbered by its occurrence
   (the second ``go to _`` is another step than the first);
2. the steps present in at least half of those members make the procedure, ordered by their
   median relative position;
3. each step is written with its arguments: a literal most members share (``thermometer``),
   the role where it is the goal's own object (``the object named in the goal``), a generic
   phrase otherwise;
4. beside it: the usual length, the steps successful runs end with, and the usual failure
   (the most common first deviation of failed runs from the procedure, or their running out
   of steps, or a loop).

Step lines are written the way the environment spells its actions (``teleport to ...``,
``book_flight(...)``, ``Operation: SELECT ...``), so the trajectories' own tokenizer reads a
skill's steps back as action categories; the cluster-quality benchmark compares them with
held-out trajectories that way. Only words the step parser extracted (letters, digits) and
fixed phrases go into the text: no trajectory text reaches a skill verbatim.

Example:

>>> from lifemem_ray.core.model import Outcome, Step, Trajectory
>>> runs = [Trajectory(env="sw", task=f"Your task is to measure the temperature of {x}.",
...                    steps=(Step(action="pick up thermometer"), Step(action=f"use thermometer on {x}")),
...                    outcome=Outcome(success=True)) for x in ("water", "milk", "juice")]
>>> print(distil_procedure(runs).splitlines()[1])
1. pick up thermometer
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from lifemem_ray.core.model import Trajectory
from lifemem_ray.engine.clustering.steps import AbstractStep, abstract_steps
from lifemem_ray.engine.clustering.workflow import canonical_token

__all__ = ["Procedure", "ProcedureStep", "distil_procedure", "mine_procedure", "render"]

MIN_SUPPORT = 0.5  # a step is in the procedure when at least this share of the runs takes it
LITERAL_SHARE = 0.6  # an argument is written literally when this share of the runs uses it
MAX_STEPS = 12
MAX_STEPS_PER_RUN = 80  # only the first actions of a long run are read
_SQL_WORDS = {
    "join": "JOIN", "where": "WHERE", "groupby": "GROUP BY", "having": "HAVING", "orderby": "ORDER BY",
    "limit": "LIMIT", "distinct": "DISTINCT", "subquery": "a subquery", "count": "COUNT(...)",
    "sum": "SUM(...)", "avg": "AVG(...)", "minmax": "MIN/MAX(...)",
}  # fmt: skip
_PLACE_WORDS = frozenset(["to", "from", "in", "into", "onto", "in/on", "inside"])  # before a second slot: a place
_GENERIC = {"NAVIGATE": "the next place", "MANIPULATE": "the object", "SELECT": "the right item", "INSPECT": "the item"}
_CALL_ROLE = {
    "goal": "<from the goal>",
    "id": "<id>",
    "number": "<number>",
    "flag": "<true/false>",
    "list": "<list>",
    "object": "<object>",
    "lit": "<value>",
    "none": "<value>",
    "expr": "<value>",
    "dir": "<direction>",
}


@dataclass(frozen=True, slots=True)
class ProcedureStep:
    """One step of a mined procedure: its text, category and the share of runs taking it."""

    text: str
    category: str
    support: float


@dataclass(frozen=True)
class Procedure:
    steps: tuple[ProcedureStep, ...]
    runs: int  # members the procedure was mined from
    successes: int
    failures: int
    length: tuple[int, int, int]  # median, min, max actions of the members
    ending: tuple[str, ...]  # the last steps of successful runs
    failure: str  # the usual failure, or ""


def distil_procedure(members: Sequence[Trajectory]) -> str:
    """The skill text of a cluster from a sample of its members ("" when there are none)."""
    if not members:
        return ""
    return render(mine_procedure(members))


def mine_procedure(members: Sequence[Trajectory]) -> Procedure:
    """The procedure of these members (see the module docstring)."""
    seqs = [
        _occurrences(abstract_steps([s.action for s in m.steps[:MAX_STEPS_PER_RUN]], m.query_text)) for m in members
    ]
    ok = [i for i, m in enumerate(members) if m.outcome.success is True]
    ko = [i for i, m in enumerate(members) if m.outcome.success is False]
    basis = ok or list(range(len(members)))
    kept = _common_items(seqs, basis)
    steps = tuple(
        ProcedureStep(
            _render_step([seqs[i][item] for i in basis if item in seqs[i]]),
            _category(item, seqs, basis),
            round(sum(item in seqs[i] for i in basis) / len(basis), 2),
        )
        for item in kept
    )
    lengths = sorted(len(m.steps) for m in members)
    return Procedure(
        steps=steps,
        runs=len(members),
        successes=len(ok),
        failures=len(ko),
        length=(int(statistics.median(lengths)), lengths[0], lengths[-1]),
        ending=_ending(seqs, ok),
        failure=_usual_failure(seqs, members, ok, ko, kept),
    )


def render(p: Procedure) -> str:
    outcome = f"{p.successes} of {p.runs} runs succeeded" if p.successes or p.failures else f"{p.runs} runs"
    median, low, high = p.length
    lines = [f"Procedure ({outcome}; usually {median} actions, {low}-{high}):"]
    lines += [f"{n}. {step.text}" for n, step in enumerate(p.steps, 1)] or ["1. think about what the goal needs first"]
    if p.ending:
        lines.append("Successful runs end with: " + ", then ".join(p.ending) + ".")
    if p.failure:
        lines.append("Usual failure: " + p.failure + ".")
    return "\n".join(lines)


# --------------------------------------------------------------------------- mining

Item = tuple[str, int]  # (step shape, occurrence number)


def _occurrences(steps: list[AbstractStep]) -> dict[Item, tuple[float, AbstractStep]]:
    """Each collapsed step as (shape, occurrence) -> (relative position, the step)."""
    collapsed = [s for i, s in enumerate(steps) if i == 0 or steps[i - 1].key != s.key]
    seen: Counter = Counter()
    out: dict[Item, tuple[float, AbstractStep]] = {}
    last = max(len(collapsed) - 1, 1)
    for pos, step in enumerate(collapsed):
        seen[step.shape] += 1
        out[(step.shape, seen[step.shape])] = (pos / last, step)
    return out


def _common_items(seqs: list[dict[Item, tuple[float, AbstractStep]]], basis: list[int]) -> list[Item]:
    positions: dict[Item, list[float]] = defaultdict(list)
    for i in basis:
        for item, (pos, _) in seqs[i].items():
            positions[item].append(pos)
    need = MIN_SUPPORT * len(basis)
    common = [(statistics.median(p), item) for item, p in positions.items() if len(p) >= need]
    if not common:  # no step most runs share: the most frequent few
        common = [(statistics.median(p), item) for item, p in sorted(positions.items(), key=lambda kv: -len(kv[1]))[:3]]
    common.sort()
    if len(common) > MAX_STEPS:  # keep the best supported, in their order
        best = set(sorted(common, key=lambda pc: -len(positions[pc[1]]))[:MAX_STEPS])
        common = [pc for pc in common if pc in best]
    return [item for _, item in common]


def _category(item: Item, seqs: list[dict], basis: list[int]) -> str:
    for i in basis:
        if item in seqs[i]:
            return canonical_token(seqs[i][item][1].token)
    return "OTHER"


def _render_step(instances: list[tuple[float, AbstractStep]]) -> str:
    steps = [s for _, s in instances]
    first = steps[0]
    category = canonical_token(first.token)
    if first.frame.startswith("sql:"):
        kind, *clauses = first.frame.split("+")
        extra = ", ".join(_SQL_WORDS.get(c, c) for c in clauses)
        return f"Operation: {kind[4:].upper()}" + (f" with {extra}" if extra else "")
    if "(" in first.frame and first.frame.endswith(")"):
        names = first.phrases
        roles = [
            Counter(s.roles[j].split(":", 1)[0] for s in steps if j < len(s.roles)).most_common(1)[0][0]
            for j in range(len(names))
        ]
        return (
            f"{first.token}("
            + ", ".join(
                f"{n}={_CALL_ROLE.get(r, '<value>')}" if n != "_" else _CALL_ROLE.get(r, "<value>")
                for n, r in zip(names, roles, strict=True)
            )
            + ")"
        )
    if first.frame.endswith("[_]"):
        return f"{first.frame[:-3].split(':', 1)[0]}[{_slot(steps, 0, category, False)}]"
    if "_" not in first.frame.split():
        return _readable(first.frame)
    words, slot, previous = [], 0, ""
    for piece in first.frame.split():
        if piece == "_":
            words.append(_slot(steps, slot, category, slot > 0 and previous in _PLACE_WORDS))
            slot += 1
        else:
            words.append(piece)
        previous = piece
    return " ".join(words)


def _slot(steps: list[AbstractStep], j: int, category: str, place: bool) -> str:
    """The words for argument slot ``j``: a literal most runs share, else its role; ``place``:
    the slot follows a preposition of place (to, from, in/on ...)."""
    roles = Counter(s.roles[j].split(":", 1)[0] for s in steps if j < len(s.roles))
    role = roles.most_common(1)[0][0] if roles else "none"
    if role in ("id", "number", "dir"):
        return "<direction>" if role == "dir" else f"<{role}>"  # never one run's identifier
    phrases = Counter(s.phrases[j] for s in steps if j < len(s.phrases) and s.phrases[j])
    n = len(steps)
    if phrases:
        phrase, count = phrases.most_common(1)[0]
        if count >= LITERAL_SHARE * n:  # the same words in most runs: say them
            return phrase
    if role == "goal":
        return "the place named in the goal" if place or category == "NAVIGATE" else "the object named in the goal"
    if len(phrases) >= 2:
        (a, na), (b, nb) = phrases.most_common(2)
        if na + nb >= LITERAL_SHARE * n:
            return f"{a} or {b}"
    if place:
        return "the right place"
    return _GENERIC.get(category, "the item")


def _readable(frame: str) -> str:
    return {
        "respond": "reply to the user with the outcome.",
        "answer": "Answer: give the final answer",
        "think": "think about what is still missing",
    }.get(frame, frame)


def _ending(seqs: list[dict], ok: list[int]) -> tuple[str, ...]:
    """The one or two steps most successful runs end with."""
    if not ok:
        return ()
    ordered = {i: sorted(seqs[i].values(), key=lambda ps: ps[0]) for i in ok}
    tail_of = {i: tuple(step.shape for _, step in ordered[i][-2:]) for i in ok}
    tail, count = Counter(tail_of.values()).most_common(1)[0]
    if count < MIN_SUPPORT * len(ok):
        return ()
    runs = [ordered[i][-len(tail) :] for i in ok if tail_of[i] == tail]
    return tuple(_render_step([run[k] for run in runs]) for k in range(len(tail)))


def _usual_failure(
    seqs: list[dict], members: Sequence[Trajectory], ok: list[int], ko: list[int], kept: list[Item]
) -> str:
    if not ko:
        return ""
    if ok:
        usual = statistics.median(len(members[i].steps) for i in ok)
        long_runs = sum(len(members[i].steps) >= 1.5 * usual + 2 for i in ko)
        if long_runs >= MIN_SUPPORT * len(ko):
            return (
                f"{long_runs} of {len(ko)} failed runs went on past {round(1.5 * usual + 2)} actions without finishing"
            )
    kept_set = set(kept)
    deviations: Counter = Counter()
    examples: dict[str, list[tuple[float, AbstractStep]]] = defaultdict(list)
    for i in ko:
        ordered = sorted(seqs[i].items(), key=lambda kv: kv[1][0])
        first = next(((item, ps) for item, ps in ordered if item not in kept_set), None)
        if first is None:
            continue
        deviations[first[0][0]] += 1
        examples[first[0][0]].append(first[1])
    if deviations:
        shape, count = deviations.most_common(1)[0]
        if count >= 2 or len(ko) == 1:
            return f"{count} of {len(ko)} failed runs left the procedure with: {_render_step(examples[shape])}"
    loops = sum(_loops(members[i]) for i in ko)
    if loops >= MIN_SUPPORT * len(ko):
        return f"{loops} of {len(ko)} failed runs repeated one action that made no progress"
    return f"{len(ko)} runs failed without a common pattern"


def _loops(traj: Trajectory) -> bool:
    actions = [s.action for s in traj.steps]
    return any(actions[i] == actions[i + 1] == actions[i + 2] for i in range(len(actions) - 2))
