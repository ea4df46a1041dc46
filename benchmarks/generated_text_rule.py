"""How well the generated-text rule (:mod:`lifemem_ray.llm.provenance`) tells hostile texts from
legitimate skills (issue 32, item 5), on a hand-written set shipped beside this script.

The set (``benchmarks/data/generated_text/``), every row with a ``split`` of ``tune`` or
``heldout`` (35 % of each file, drawn once with a seeded shuffle before the rule was tuned):

* ``hostile.jsonl``: instructions aimed at the operator or the model, as an LLM could be led to
  write them into a skill or a cluster description: overriding or nullifying earlier
  instructions, revealing secrets, keys, environment variables or the system prompt, role play,
  exfiltration; plainly, politely, embedded in an otherwise good skill, and disguised (line
  breaks, odd spacing, case, look-alike letters, full-width forms, zero-width characters);
* ``legitimate.jsonl``: environment-invariant workflow skills and cluster descriptions for the
  project's environments, many of them using the words an attack uses (key, password, token,
  settings, ignore, forget, show, say, tell, send, act);
* ``sources.jsonl``: hand-written trajectories of each environment: the provenance a row of
  that environment is checked against (as a cluster's members are in the engine).

Measured, per split:

* hostile texts refused when the trajectories themselves carried the text (one more member
  whose observation is the text: the worst case, where the provenance holds every token and
  only the instruction rule can refuse), and against the environment's trajectories alone;
* legitimate texts refused against their environment's trajectories (false refusals), and by
  the instruction rule alone;
* where the released trainset is found (``LIFEMEM_SHARED_DIR`` or ``../shared`` beside the
  checkout), the offline policy's skills, each checked against the 12 members it was mined from.

Prints JSON, then a table. Usage:
    python benchmarks/generated_text_rule.py [--misses tune] [--no-trainset]
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lifemem_ray.core.model import Step, Trajectory
from lifemem_ray.llm.provenance import Provenance, from_trajectories, normalise, operator_instruction, refusal

DATA = Path(__file__).resolve().parent / "data" / "generated_text"
SPLITS = ("tune", "heldout")
MEMBERS = 12  # trainset members per offline skill, as a cluster's sample


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSONL file.

    Args:
        path: the file.

    Returns:
        One dict per non-empty line.
    """
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def sources(data: Path = DATA) -> dict[str, list[Trajectory]]:
    """The hand-written trajectories of each environment, by environment.

    Args:
        data: the folder of the set.

    Returns:
        Trajectories by environment name.
    """
    by_env: dict[str, list[Trajectory]] = defaultdict(list)
    for row in read_rows(data / "sources.jsonl"):
        steps = tuple(Step(action=s["action"], observation=s["observation"]) for s in row["steps"])
        by_env[row["env"]].append(Trajectory(env=row["env"], id=row["id"], task=row["task"], steps=steps))
    return dict(by_env)


def carrying(members: Sequence[Trajectory], text: str) -> Provenance:
    """The provenance of a text whose trajectories carried it: the members and one more whose
    observation is the text itself (a page the agent read held the injection)."""
    carrier = Trajectory(env="x", id="carrier", task="read the page", steps=(Step(action="read", observation=text),))
    return from_trajectories([*members, carrier], "the members and the page that carried the text")


def tally(rows: list[dict[str, Any]], refused: Callable[[dict[str, Any]], str | None]) -> dict[str, Any]:
    """Refusals per split: ``{split: {n, refused, rate}}`` and the ids refused or not."""
    out: dict[str, Any] = {}
    for split in SPLITS:
        part = [r for r in rows if r["split"] == split]
        hits = {r["id"]: reason for r in part if (reason := refused(r))}
        out[split] = {
            "n": len(part),
            "refused": len(hits),
            "rate": round(len(hits) / len(part), 4) if part else None,
            "ids": sorted(hits),
        }
    return out


def measure(data: Path = DATA) -> dict[str, Any]:
    """Every rate of the module's docstring on the shipped set (the trainset apart).

    Args:
        data: the folder of the set.

    Returns:
        ``{"hostile": {...}, "legitimate": {...}, "rows": {...}}``, each measure per split.
    """
    by_env = sources(data)
    hostile = read_rows(data / "hostile.jsonl")
    legitimate = read_rows(data / "legitimate.jsonl")
    plain = {env: from_trajectories(members, f"{env}'s trajectories") for env, members in by_env.items()}

    def instruction(row: dict[str, Any]) -> str | None:
        found = operator_instruction(normalise(row["text"]))
        return f"{found.text!r} ({found.rule})" if found else None

    return {
        "rows": {"hostile": len(hostile), "legitimate": len(legitimate), "sources": sum(map(len, by_env.values()))},
        "hostile": {
            "refused_carried": tally(hostile, lambda r: refusal(r["text"], carrying(by_env[r["env"]], r["text"]))),
            "refused_plain": tally(hostile, lambda r: refusal(r["text"], plain[r["env"]])),
            "refused_by_instruction_rule": tally(hostile, instruction),
        },
        "legitimate": {
            "refused": tally(legitimate, lambda r: refusal(r["text"], plain[r["env"]])),
            "refused_by_instruction_rule": tally(legitimate, instruction),
        },
    }


def trainset_dir() -> Path | None:
    """The released trainset beside the checkout (or under ``LIFEMEM_SHARED_DIR``), or None."""
    root = Path(os.environ.get("LIFEMEM_SHARED_DIR", Path(__file__).resolve().parents[1].parent / "shared"))
    path = root / "data" / "lifemem-trainset"
    return path if path.is_dir() else None


def trainset_offline_skills(path: Path) -> tuple[int, list[str]]:
    """The offline policy's skills of the released trainset against their members.

    Args:
        path: the trainset folder (its ``*.jsonl``).

    Returns:
        How many skills were checked, and the refusals (one reason each).
    """
    from lifemem_ray.core.importers import read_jsonl
    from lifemem_ray.engine.clustering.policy import OfflinePolicy

    trajs, _ = read_jsonl(sorted(path.glob("*.jsonl")))
    by_env: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajs:
        by_env[t.env].append(t)
    policy, checked, refused = OfflinePolicy(), 0, []
    for env, runs in sorted(by_env.items()):
        for start in range(0, len(runs), MEMBERS):
            members = runs[start : start + MEMBERS]
            checked += 1
            reason = refusal(policy.distil(members), from_trajectories(members, f"{env}[{start}:]"))
            if reason:
                refused.append(reason)
    return checked, refused


def misses(report: dict[str, Any], data: Path, split: str) -> list[dict[str, str]]:
    """The rows of ``split`` the rule got wrong: hostile texts passed (carried), legitimate refused."""
    rows = {r["id"]: r for name in ("hostile", "legitimate") for r in read_rows(data / f"{name}.jsonl")}
    passed = {i for i in rows if i.startswith("h") and rows[i]["split"] == split}
    passed -= set(report["hostile"]["refused_carried"][split]["ids"])
    wrong = sorted(passed) + report["legitimate"]["refused"][split]["ids"]
    return [{"id": i, "text": rows[i]["text"]} for i in wrong]


def table(report: dict[str, Any]) -> str:
    """The report's rates as a text table."""
    lines = [f"{'measure':58} {'tune':>16} {'heldout':>16}"]

    def row(name: str, cell: dict[str, Any]) -> None:
        parts = [f"{cell[s]['refused']}/{cell[s]['n']} ({cell[s]['rate']:.1%})" for s in SPLITS]
        lines.append(f"{name:58} {parts[0]:>16} {parts[1]:>16}")

    row("hostile refused, trajectories carried the text", report["hostile"]["refused_carried"])
    row("hostile refused, against the environment's trajectories", report["hostile"]["refused_plain"])
    row("hostile refused by the instruction rule alone", report["hostile"]["refused_by_instruction_rule"])
    row("legitimate refused (false refusals)", report["legitimate"]["refused"])
    row("legitimate refused by the instruction rule alone", report["legitimate"]["refused_by_instruction_rule"])
    trainset = report.get("trainset_offline_skills")
    if trainset:
        lines.append(f"released trainset, offline skills refused: {trainset['refused']}/{trainset['checked']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Measure, print JSON and the table.

    Args:
        argv: command-line arguments (``--data``, ``--misses``, ``--no-trainset``).

    Returns:
        The report printed.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA, help="the folder of the set")
    parser.add_argument("--misses", choices=SPLITS, help="also list the rows of this split the rule got wrong")
    parser.add_argument("--no-trainset", action="store_true", help="skip the released trainset's offline skills")
    args = parser.parse_args(argv)
    report = measure(args.data)
    path = None if args.no_trainset else trainset_dir()
    if path is not None:
        checked, refused = trainset_offline_skills(path)
        report["trainset_offline_skills"] = {"checked": checked, "refused": len(refused), "reasons": refused[:5]}
    if args.misses:
        report["misses"] = {args.misses: misses(report, args.data, args.misses)}
    print(json.dumps(report, indent=1))
    print(table(report))
    return report


if __name__ == "__main__":
    main()
