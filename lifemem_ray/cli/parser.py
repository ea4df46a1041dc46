"""The ``lifemem-ray`` argument parser: every command, its options and the function it runs."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from lifemem_ray import __version__
from lifemem_ray.cli.deployment_commands import (
    cmd_compact,
    cmd_keys_new,
    cmd_restore,
    cmd_serve,
    cmd_snapshot,
    cmd_status,
    cmd_stop,
)
from lifemem_ray.cli.experiment_commands import cmd_run
from lifemem_ray.cli.setting_flags import setting_flag
from lifemem_ray.cli.store_commands import (
    cmd_check,
    cmd_clusters,
    cmd_delete,
    cmd_demo,
    cmd_export,
    cmd_ingest,
    cmd_mcp,
    cmd_retrieve,
    cmd_stats,
)


# -- parser --------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The whole command line: every command with its description, options and function."""
    parser = argparse.ArgumentParser(
        prog="lifemem-ray",
        allow_abbrev=False,
        description="Lifelong workflow memory for LLM agents (LifeMem): one store on this machine, or a "
        "sharded memory on Ray with an HTTP front door. `lifemem-ray COMMAND --help` for a command.",
    )
    parser.add_argument("--version", action="version", version=f"lifemem-ray {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common, remote, llm = shared_options()
    experiment_commands(sub, common, llm)
    store_commands(sub, common, remote, llm)
    deployment_commands(sub, common, remote, llm)
    return parser


def parse_command_line(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``argv`` read by ``parser``; an unknown option is refused by the command it was given to,
    with that command's usage (argparse would answer with the top-level usage).

    Raises:
        SystemExit: a usage error (exit status 2, after the usage and the error on stderr).
    """
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        command_parser: argparse.ArgumentParser = getattr(args, "command_parser", parser)
        command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def command(
    sub: Any, name: str, summary: str, details: str, parents: Sequence[argparse.ArgumentParser] = ()
) -> argparse.ArgumentParser:
    """A command: ``summary`` in the list of commands, ``summary`` and ``details`` in its own
    ``--help``; it remembers its parser, so that its usage answers a wrong option."""
    p: argparse.ArgumentParser = sub.add_parser(
        name,
        parents=list(parents),
        help=summary,
        description=f"{summary[0].upper()}{summary[1:]}. {details}",
        allow_abbrev=False,  # a typo (--verbos) is refused, not taken for a flag it begins
    )
    p.set_defaults(command_parser=p)
    return p


def shared_options() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser, argparse.ArgumentParser]:
    """The option groups commands share: common, a deployment's address, an LLM endpoint."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", metavar="FILE", help="TOML configuration file (default: none, built-in settings)")
    common.add_argument(
        "--set",
        action="append",
        metavar="SECTION.KEY=VALUE",
        help="override one setting, e.g. --set evolution.top_k=8 (repeatable; see docs/configuration.md)",
    )
    common.add_argument("--json", action="store_true", help="print JSON instead of a readable report")
    common.add_argument("--quiet", action="store_true", help="no progress bar")
    common.add_argument("-v", "--verbose", action="store_true", help="log what the engine does; tracebacks on errors")
    remote = argparse.ArgumentParser(add_help=False)
    remote.add_argument(
        "--address",
        metavar="HOST:PORT",
        help="the Ray cluster of the deployment (default: RAY_ADDRESS, else the head `serve` started on this machine; "
        "never one found by searching)",
    )
    setting_flag(remote, "--namespace", key="cluster.namespace", help="Ray namespace of the deployment")
    llm = argparse.ArgumentParser(add_help=False)
    llm.add_argument(
        "--llm-base-url",
        metavar="URL",
        help="OpenAI-compatible endpoint; turns on the LLM backend (default: none, the offline policy decides)",
    )
    setting_flag(llm, "--llm-model", key="llm.model", metavar="NAME", help="model name at that endpoint")
    return common, remote, llm


def experiment_commands(sub: Any, common: argparse.ArgumentParser, llm: argparse.ArgumentParser) -> None:
    p = command(
        sub,
        "demo",
        "build a memory from the shipped sample and query it",
        "Ingests the shipped sample (six environments, one task of each held out), prints each environment's "
        "workflow clusters with their descriptions and skills, then retrieves for a held-out task. No Ray, no "
        "network.",
        [common, llm],
    )
    p.add_argument("--store", metavar="DIR", help="where to build it (default: a new temporary folder)")
    p.set_defaults(func=cmd_demo)

    p = command(
        sub,
        "run",
        "run a lifelong experiment (rollout workers, OP/BwT table, plots)",
        "Plays the paper's protocol: each environment's training tasks in turn, then the test tasks of every "
        "environment seen so far, for every memory mode, with rollout workers on Ray; writes report.md, "
        "report.json and plots. Settings: the [experiment] table of --config.",
        [common, llm],
    )
    p.add_argument(
        "--address",
        metavar="HOST:PORT",
        help="Ray cluster to run on (default: RAY_ADDRESS, else a Ray of its own started for the run)",
    )
    p.add_argument(
        "--envs", nargs="+", metavar="ENV", help="environments in stream order (default: setting experiment.envs)"
    )
    p.add_argument(
        "--eval-envs",
        nargs="*",
        metavar="ENV",
        help="evaluation-only environments: zero-shot transfer (default: setting experiment.eval_envs)",
    )
    p.add_argument(
        "--modes",
        nargs="+",
        metavar="MODE",
        help="memory modes: none trajectory global-skills lifemem lifemem-no-skills skills-only (default: all)",
    )
    setting_flag(p, "--workers", key="experiment.workers", metavar="N", help="rollout workers")
    setting_flag(
        p,
        "--seeds",
        key="experiment.seeds",
        metavar="N",
        help="runs with seeds seed..seed+N-1, pooled with bootstrap intervals",
    )
    setting_flag(p, "--stream", key="experiment.stream", choices=("similarity", "random", "buffer"), help="task order")
    setting_flag(
        p, "--agent", key="experiment.agent", help="skill-guided | exemplar | react | random | gold | noisy-gold"
    )
    p.add_argument("--output", metavar="DIR", help="where the report goes (default: runs/<experiment.name>)")
    p.set_defaults(func=cmd_run)


def store_commands(
    sub: Any, common: argparse.ArgumentParser, remote: argparse.ArgumentParser, llm: argparse.ArgumentParser
) -> None:
    store_help = "the store folder (or --address/--namespace for a deployment)"
    p = command(
        sub,
        "ingest",
        "add trajectories from JSONL files",
        "Each record is a trajectory (native or chat format); an invalid record stops the command naming its "
        "file and line, unless --skip-invalid. What was added before an error stays added.",
        [remote, common, llm],
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="JSONL files (.jsonl, .jsonl.gz, or - for stdin)")
    p.add_argument("--store", metavar="DIR", help=store_help)
    p.add_argument(
        "--env", help="environment of records that do not name one (default: none, such a record is refused)"
    )
    p.add_argument(
        "--format",
        choices=("auto", "native", "chat"),
        default="auto",
        help="record format: native trajectories, chat transcripts, or auto (each record by its keys) (default: auto)",
    )
    p.add_argument("--skip-invalid", action="store_true", help="skip malformed records (counted and reported)")
    p.add_argument("--tenant", help="tenant of records that do not name one (default: default)")
    p.set_defaults(func=cmd_ingest)

    p = command(
        sub,
        "retrieve",
        "exemplars and skills for a task",
        "The top-k stored trajectories of an environment for a task, with their clusters' skills; --context "
        "prints the prompt block an agent would get.",
        [remote, common],
    )
    p.add_argument("task", help="the task, as the agent would be given it")
    p.add_argument("--store", metavar="DIR", help=store_help)
    p.add_argument("--env", required=True, help="the environment whose trajectories to search")
    setting_flag(p, "-k", key="retrieval.k", help="trajectories to return")
    p.add_argument("--context", action="store_true", help="also print the prompt block an agent would get")
    p.add_argument("--tenant", default="default", help="whose trajectories to search (default: default)")
    p.set_defaults(func=cmd_retrieve)

    p = command(
        sub,
        "stats",
        "counts per environment, LLM usage",
        "Trajectories and clusters per environment, splits, pending work and the LLM's calls and tokens.",
        [remote, common],
    )
    p.add_argument("--store", metavar="DIR", help=store_help)
    p.add_argument("--tenant", help="only this tenant's data (default: everything, with counts per tenant)")
    p.set_defaults(func=cmd_stats)

    p = command(
        sub,
        "clusters",
        "list workflow clusters with descriptions and skills",
        "Each cluster's id, size, cohesion R (mean resultant length, 0-1), environments, description and skill.",
        [remote, common],
    )
    p.add_argument("--store", metavar="DIR", help=store_help)
    p.add_argument("--env", help="only clusters holding this environment's trajectories (default: all)")
    p.add_argument("--tenant", default="default", help="whose clusters (default: default)")
    p.set_defaults(func=cmd_clusters)

    p = command(
        sub,
        "delete",
        "delete trajectories by id, or everything of a tenant",
        "Durable when it returns, and safe to run again: ids no longer stored are ignored.",
        [remote, common],
    )
    p.add_argument("ids", nargs="*", metavar="ID", help="trajectory ids of --tenant")
    p.add_argument("--store", metavar="DIR", help=store_help)
    p.add_argument("--tenant", default="default", help="whose trajectories (default: default)")
    p.add_argument(
        "--purge-tenant",
        action="store_true",
        help="delete every trajectory of --tenant (its clusters and skills go too)",
    )
    p.set_defaults(func=cmd_delete)

    p = command(
        sub,
        "export",
        "write trajectories (native JSONL) and clusters",
        "Writes every trajectory to OUT.jsonl, which `ingest` reads back, and the clusters beside it.",
        [common],
    )
    p.add_argument("--store", required=True, metavar="DIR", help="the store folder (opened read-only)")
    p.add_argument("out", metavar="OUT.jsonl", help="the file to write")
    p.set_defaults(func=cmd_export)

    p = command(
        sub,
        "check",
        "verify the store's invariants",
        "Counts, cluster sums, index and log agree; exit status 1 and the problems listed when they do not.",
        [remote, common],
    )
    p.add_argument("--store", metavar="DIR", help=store_help)
    p.add_argument(
        "--deep",
        action="store_true",
        help="also recompute every record's fingerprint from its content (reads every record)",
    )
    p.set_defaults(func=cmd_check)

    p = command(
        sub,
        "mcp",
        "serve the store to an agent host over MCP (stdio, no Ray)",
        "An MCP server on standard input and output with the memory's tools (retrieve, add, stats...).",
        [common, llm],
    )
    p.add_argument(
        "--store", required=True, metavar="DIR", help="the store folder (must hold a store, unless --create)"
    )
    p.add_argument(
        "--create",
        action="store_true",
        help="create the store when DIR has none (else that is an error: a mistyped path "
        "would serve a new empty memory)",
    )
    p.add_argument("--tenant", default="default", help="the tenant every call acts as (default: default)")
    p.set_defaults(func=cmd_mcp)


def deployment_commands(
    sub: Any, common: argparse.ArgumentParser, remote: argparse.ArgumentParser, llm: argparse.ArgumentParser
) -> None:
    p = command(
        sub,
        "serve",
        "start a sharded deployment on Ray (named, detached)",
        "Shards (each its own LMDB store and FAISS index), a coordinator and embedders as named, detached Ray "
        "actors; without --address or RAY_ADDRESS it starts a Ray head on this machine. The same command on the "
        "same --store reopens it, and adopts live shards whose coordinator is gone. --http adds the REST and MCP "
        "front door on Ray Serve.",
        [remote, common, llm],
    )
    p.add_argument("--store", metavar="DIR", help="folder for the shards' and the coordinator's stores")
    setting_flag(p, "--shards", key="cluster.shards", metavar="N", help="number of shards")
    p.add_argument(
        "--http",
        action="store_true",
        help="also serve REST and MCP on Ray Serve (without --store: in front of the running deployment)",
    )
    setting_flag(p, "--host", key="http.host", help="HTTP address")
    setting_flag(p, "--port", key="http.port", help="HTTP port")
    p.set_defaults(func=cmd_serve)

    p = command(
        sub,
        "keys",
        "API keys of the HTTP front door",
        "A key acts as one tenant with its scopes; the server keeps only its SHA-256.",
    )
    keys = p.add_subparsers(dest="keys_command", required=True, metavar="KEYS_COMMAND")
    p = command(
        keys,
        "new",
        "a fresh random key and its config entry (only the hash is stored)",
        "The key is printed once, or written to --key-file (created readable by you alone, never over a file "
        "that exists); --entries adds its entry (the hash, no secret) to a keys file for LIFEMEM_API_KEYS.",
        [common],
    )
    p.add_argument("--tenant", required=True, help="the tenant every request of the key acts as")
    p.add_argument("--scopes", required=True, help="comma-separated: read, write, admin")
    p.add_argument("--name", help="a non-secret name for the key (default: TENANT-random)")
    p.add_argument(
        "--key-file",
        metavar="FILE",
        help="write the key to FILE (mode 0600; refused if FILE exists) instead of printing it (default: printed)",
    )
    p.add_argument(
        "--entries",
        metavar="FILE",
        help="add the key's entry to FILE, a JSON list of entries (created if missing) for LIFEMEM_API_KEYS "
        "(default: printed)",
    )
    p.set_defaults(func=cmd_keys_new)

    p = command(
        sub,
        "stop",
        "stop a deployment (closing every shard cleanly)",
        "Every shard saves its index and closes its store before its actor ends; the front door stops too. "
        "Shards left without a coordinator are ended as well.",
        [remote, common],
    )
    p.add_argument("--ray", action="store_true", help="also stop the local Ray head `serve` started (only that one)")
    p.set_defaults(func=cmd_stop)

    p = command(
        sub,
        "status",
        "each shard's node, address, health, last checkpoint and how far behind the shared log is",
        "Also says when the coordinator is down while shards live, with their counts and the command that recovers.",
        [remote, common],
    )
    p.set_defaults(func=cmd_status)

    p = command(
        sub,
        "snapshot",
        "consistent snapshot of every shard and the routing table",
        "Ingest pauses for the moment every shard copies its store; `restore` brings a snapshot back with any "
        "shard count.",
        [remote, common],
    )
    p.add_argument("out", metavar="DIR", help="a new folder for the snapshot (on a filesystem the nodes share)")
    p.set_defaults(func=cmd_snapshot)

    p = command(
        sub,
        "compact",
        "rewrite a store (or every shard of a deployment) in place, dropping the bytes of deleted trajectories",
        "Also ends the durable log's history: each shard checkpointed, only that checkpoint kept.",
        [remote, common],
    )
    p.add_argument(
        "--store", metavar="DIR", help="a store folder no process has open (or --address/--namespace for a deployment)"
    )
    p.set_defaults(func=cmd_compact)

    p = command(
        sub,
        "restore",
        "a new deployment from a snapshot (any shard count)",
        "All or nothing: interrupted, the same command finishes it. From a durable address a damaged log entry "
        "is refused by name unless its loss is accepted with --accept-loss.",
        [remote, common, llm],
    )
    p.add_argument(
        "snapshot",
        metavar="SNAPSHOT_DIR",
        help="a snapshot folder, a single store folder, or a deployment's durable address (DURABLE_URI/NAMESPACE)",
    )
    p.add_argument(
        "--store",
        required=True,
        metavar="DIR",
        help="a new, empty folder for the restored deployment (or the folder of an interrupted run of the same restore)",
    )
    setting_flag(p, "--shards", key="cluster.shards", metavar="N", help="shards of the restored deployment")
    p.add_argument(
        "--accept-loss",
        action="append",
        metavar="SHARD_LOG:ENTRY",
        help="from a durable address: accept the loss of a damaged entry of a shard log and of every later entry "
        "(e.g. shard-01:12, as a refused rebuild names it); repeat per shard",
    )
    p.set_defaults(func=cmd_restore)
