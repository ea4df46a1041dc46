"""The ``lifemem-ray`` argument parser: every command, its options and the function it runs."""

from __future__ import annotations

import argparse
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
    parser = argparse.ArgumentParser(
        prog="lifemem-ray", description="Lifelong workflow memory for LLM agents (LifeMem)."
    )
    parser.add_argument("--version", action="version", version=f"lifemem-ray {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common, remote, llm = shared_options()
    experiment_commands(sub, common, llm)
    store_commands(sub, common, remote, llm)
    deployment_commands(sub, common, remote, llm)
    return parser


def shared_options() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser, argparse.ArgumentParser]:
    """The option groups commands share: common, a deployment's address, an LLM endpoint."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", metavar="FILE", help="TOML configuration file")
    common.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override one setting (repeatable)")
    common.add_argument("--json", action="store_true", help="machine-readable output")
    common.add_argument("--quiet", action="store_true", help="no progress bar")
    common.add_argument("-v", "--verbose", action="store_true", help="log what the engine does")
    remote = argparse.ArgumentParser(add_help=False)
    remote.add_argument(
        "--address",
        metavar="HOST:PORT",
        help="the Ray cluster of the deployment (default: RAY_ADDRESS, else the head `serve` started on this machine; never one found by searching)",
    )
    remote.add_argument("--namespace", help="Ray namespace of the deployment (default: cluster.namespace)")
    llm = argparse.ArgumentParser(add_help=False)
    llm.add_argument("--llm-base-url", metavar="URL", help="OpenAI-compatible endpoint; turns on the LLM backend")
    llm.add_argument("--llm-model", metavar="NAME", help="model name at that endpoint")
    return common, remote, llm


def experiment_commands(sub: Any, common: argparse.ArgumentParser, llm: argparse.ArgumentParser) -> None:
    p = sub.add_parser("demo", parents=[common, llm], help="build a memory from the shipped sample and query it")
    p.add_argument("--store", metavar="DIR", help="where to build it (default: a new temporary folder)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser(
        "run", parents=[common, llm], help="run a lifelong experiment (rollout workers, OP/BwT table, plots)"
    )
    p.add_argument(
        "--address",
        metavar="HOST:PORT",
        help="Ray cluster to run on (default: RAY_ADDRESS, else a Ray of its own started for the run)",
    )
    p.add_argument("--envs", nargs="+", metavar="ENV", help="environments in stream order (default: experiment.envs)")
    p.add_argument(
        "--eval-envs",
        nargs="*",
        metavar="ENV",
        help="evaluation-only environments: zero-shot transfer (default: experiment.eval_envs)",
    )
    p.add_argument(
        "--modes",
        nargs="+",
        metavar="MODE",
        help="memory modes: none trajectory global-skills lifemem lifemem-no-skills skills-only (default: all)",
    )
    p.add_argument("--workers", type=int, help="rollout workers")
    p.add_argument(
        "--seeds", type=int, help="runs with seeds seed..seed+N-1, pooled with bootstrap intervals (default: 3)"
    )
    p.add_argument("--stream", choices=("similarity", "random", "buffer"))
    p.add_argument("--agent", help="skill-guided | exemplar | react | random | gold | noisy-gold")
    p.add_argument("--output", metavar="DIR", help="where the report goes (default: runs/<name>)")
    p.set_defaults(func=cmd_run)


def store_commands(
    sub: Any, common: argparse.ArgumentParser, remote: argparse.ArgumentParser, llm: argparse.ArgumentParser
) -> None:
    p = sub.add_parser("ingest", parents=[remote, common, llm], help="add trajectories from JSONL files")
    p.add_argument("paths", nargs="+", metavar="PATH", help="JSONL files (.jsonl, .jsonl.gz, or - for stdin)")
    p.add_argument("--store", metavar="DIR", help="the store folder (or --address/--namespace for a deployment)")
    p.add_argument("--env", help="environment of records that do not name one")
    p.add_argument("--format", choices=("auto", "native", "chat"), default="auto")
    p.add_argument("--skip-invalid", action="store_true", help="skip malformed records (counted and reported)")
    p.add_argument("--tenant", help="tenant of records that do not name one (default: the default tenant)")
    p.set_defaults(func=cmd_ingest)

    p = sub.add_parser("retrieve", parents=[remote, common], help="exemplars and skills for a task")
    p.add_argument("task")
    p.add_argument("--store", metavar="DIR")
    p.add_argument("--env", required=True)
    p.add_argument("-k", type=int, default=None, help="trajectories to return, 1-1024 (default: retrieval.k)")
    p.add_argument("--context", action="store_true", help="also print the prompt block an agent would get")
    p.add_argument("--tenant", default="default", help="whose trajectories to search (default: default)")
    p.set_defaults(func=cmd_retrieve)

    p = sub.add_parser("stats", parents=[remote, common], help="counts per environment, LLM usage")
    p.add_argument("--store", metavar="DIR")
    p.add_argument("--tenant", help="only this tenant's data (default: everything, with counts per tenant)")
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("clusters", parents=[remote, common], help="list workflow clusters with descriptions and skills")
    p.add_argument("--store", metavar="DIR")
    p.add_argument("--env")
    p.add_argument("--tenant", default="default", help="whose clusters (default: default)")
    p.set_defaults(func=cmd_clusters)

    p = sub.add_parser("delete", parents=[remote, common], help="delete trajectories by id, or everything of a tenant")
    p.add_argument("ids", nargs="*", metavar="ID", help="trajectory ids of --tenant")
    p.add_argument("--store", metavar="DIR")
    p.add_argument("--tenant", default="default", help="whose trajectories (default: default)")
    p.add_argument(
        "--purge-tenant",
        action="store_true",
        help="delete every trajectory of --tenant (its clusters and skills go too)",
    )
    p.set_defaults(func=cmd_delete)

    p = sub.add_parser("export", parents=[common], help="write trajectories (native JSONL) and clusters")
    p.add_argument("--store", required=True, metavar="DIR")
    p.add_argument("out", metavar="OUT.jsonl")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("check", parents=[remote, common], help="verify the store's invariants")
    p.add_argument("--store", metavar="DIR")
    p.add_argument(
        "--deep",
        action="store_true",
        help="also recompute every record's fingerprint from its content (reads every record)",
    )
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("mcp", parents=[common, llm], help="serve the store to an agent host over MCP (stdio, no Ray)")
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
    p = sub.add_parser(
        "serve", parents=[remote, common, llm], help="start a sharded deployment on Ray (named, detached)"
    )
    p.add_argument("--store", metavar="DIR", help="folder for the shards' and the coordinator's stores")
    p.add_argument("--shards", type=int, default=None, help="number of shards (default: cluster.shards)")
    p.add_argument(
        "--http",
        action="store_true",
        help="also serve REST and MCP on Ray Serve (without --store: in front of the running deployment)",
    )
    p.add_argument("--host", default=None, help="HTTP address (default: http.host, 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="HTTP port (default: http.port, 8000)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("keys", help="API keys of the HTTP front door")
    keys = p.add_subparsers(dest="keys_command", required=True, metavar="KEYS_COMMAND")
    p = keys.add_parser(
        "new", parents=[common], help="a fresh random key and its config entry (only the hash is stored)"
    )
    p.add_argument("--tenant", required=True, help="the tenant every request of the key acts as")
    p.add_argument("--scopes", required=True, help="comma-separated: read, write, admin")
    p.add_argument("--name", help="a non-secret name for the key (default: TENANT-random)")
    p.set_defaults(func=cmd_keys_new)

    p = sub.add_parser("stop", parents=[remote, common], help="stop a deployment (closing every shard cleanly)")
    p.add_argument("--ray", action="store_true", help="also stop the local Ray head `serve` started (only that one)")
    p.set_defaults(func=cmd_stop)

    p = sub.add_parser(
        "status",
        parents=[remote, common],
        help="each shard's node, address, health, last checkpoint and how far behind the shared log is",
    )
    p.set_defaults(func=cmd_status)

    p = sub.add_parser(
        "snapshot", parents=[remote, common], help="consistent snapshot of every shard and the routing table"
    )
    p.add_argument("out", metavar="DIR")
    p.set_defaults(func=cmd_snapshot)

    p = sub.add_parser(
        "compact",
        parents=[remote, common],
        help="rewrite a store (or every shard of a deployment) in place, dropping the bytes of deleted trajectories",
    )
    p.add_argument(
        "--store", metavar="DIR", help="a store folder no process has open (or --address/--namespace for a deployment)"
    )
    p.set_defaults(func=cmd_compact)

    p = sub.add_parser(
        "restore", parents=[remote, common, llm], help="a new deployment from a snapshot (any shard count)"
    )
    p.add_argument("snapshot", metavar="SNAPSHOT_DIR")
    p.add_argument(
        "--store",
        required=True,
        metavar="DIR",
        help="a new, empty folder for the restored deployment (or the folder of an interrupted run of the same restore)",
    )
    p.add_argument("--shards", type=int, default=None)
    p.add_argument(
        "--accept-loss",
        action="append",
        metavar="SHARD_LOG:ENTRY",
        help="from a durable address: accept the loss of a damaged entry of a shard log and of every later entry "
        "(e.g. shard-01:12, as a refused rebuild names it); repeat per shard",
    )
    p.set_defaults(func=cmd_restore)
