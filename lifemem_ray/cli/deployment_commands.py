"""The commands of a sharded deployment: ``serve`` (with ``--http``, the front door), ``stop``,
``status``, ``snapshot``, ``compact``, ``restore``, and ``keys new`` for the front door's API keys."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.cli.options import config_from_args, emit, remote
from lifemem_ray.cli.ray_session import NoRayCluster, connect, stop_local_head
from lifemem_ray.core.errors import CommandError


def cmd_serve(args: argparse.Namespace) -> int:
    from lifemem_ray.actors.cluster.deployment import deploy, find_coordinator

    config = config_from_args(args)
    keyring = http_keys(args, config) if args.http else None  # refused before anything starts
    if not args.store and not args.http:
        raise CommandError("--store DIR is required (or --http alone, in front of a running deployment)")
    namespace = connect(args, config, start_local=bool(args.store))  # --http alone stands in front of a running one
    config = config.replace({"cluster.namespace": namespace})
    if args.store:
        info = deploy(args.store, config, shards=args.shards)
    else:
        import ray

        info = ray.get(find_coordinator(namespace).deployment.remote())
    said = f"serving {len(info['shards'])} shards from {info['store']} in Ray namespace {namespace!r}"
    if keyring is not None:
        from lifemem_ray.actors.frontdoor.app import start_http

        info["http"] = start_http(namespace, config, keyring, host=args.host, port=args.port)
        said += f"; HTTP at {info['http']['url']} (auth: {keyring.mode}, OpenAPI at /openapi.json, MCP at /mcp)"
    emit(args, info, lambda: said + f"; stop with `lifemem-ray stop --namespace {namespace}`")
    return 0


def http_keys(args: argparse.Namespace, config: DeploymentConfig) -> Any:
    """The front door's keys (config and LIFEMEM_API_KEYS), and its bind address checked."""
    from lifemem_ray.service.auth import KeyRing, check_bind

    keyring = KeyRing.from_config(config.http)
    check_bind(args.host or config.http.host, keyring.mode)
    return keyring


def cmd_keys_new(args: argparse.Namespace) -> int:
    """A fresh random API key and the entry (its hash) the server's config keeps: the key
    printed once, or written to ``--key-file`` (mode 0600); the entry printed, or added to
    ``--entries``. Nothing is written where the user did not ask."""
    from lifemem_ray.service.auth import ENV_KEYS, new_key
    from lifemem_ray.service.key_files import add_entry, write_key_file

    key, entry = new_key(args.tenant, args.scopes, args.name)
    if args.key_file:
        write_key_file(args.key_file, key)
    try:
        entries = add_entry(args.entries, entry) if args.entries else None
    except BaseException:
        if args.key_file:  # a key without its entry is of no use: the same command can be run again
            Path(args.key_file).unlink(missing_ok=True)
        raise
    data: dict[str, Any] = {"entry": entry.to_dict()}
    said = []
    if args.key_file:
        data["key_file"] = args.key_file
        said.append(f"key written to {args.key_file} (readable by you alone); give it to the client")
    else:
        data["key"] = key
        said.append(f"key (shown once; give it to the client, store it nowhere else):\n  {key}")
    if args.entries:
        data["entries_file"], data["entries"] = args.entries, entries
        said.append(
            f"entry {entry.name} added to {args.entries} ({entries} keys): serve with {ENV_KEYS}={args.entries}"
        )
    else:
        scopes = ", ".join(f'"{s}"' for s in sorted(entry.scopes))
        said.append(
            f'add to the server\'s config file (or as JSON to {ENV_KEYS}):\n[[http.api_keys]]\nname = "{entry.name}"\n'
            f'sha256 = "{entry.sha256}"\ntenant = "{entry.tenant}"\nscopes = [{scopes}]'
        )
    emit(args, data, lambda: "\n\n".join(said))
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    from lifemem_ray.actors.cluster.deployment import stop

    config = config_from_args(args)
    try:
        namespace = connect(args, config)
    except NoRayCluster as exc:  # no cluster answers: no deployment, front door or head of it runs to stop
        said = f"nothing to stop: {exc}"
        emit(
            args,
            {
                "stopped": False,
                "namespace": args.namespace or config.cluster.namespace,
                "http": False,
                "ray": "no Ray cluster answers",
                "detail": str(exc),
            },
            lambda: said,
        )
        return 0
    from lifemem_ray.actors.frontdoor.app import stop_http

    http = stop_http(namespace)  # the front door goes with the deployment it stands in front of
    stopped = stop(namespace)
    head = stop_local_head() if args.ray else ""
    said = f"stopped the deployment in {namespace!r}" if stopped else f"no deployment in {namespace!r}"
    said += " and its HTTP front door" if http else ""
    emit(
        args,
        {"stopped": stopped, "namespace": namespace, "http": http, **({"ray": head} if head else {})},
        lambda: said + (f"; {head}" if head else ""),
    )
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """Each shard's node, address, health, last checkpoint and shared-log lag."""
    from lifemem_ray.actors.cluster.status import deployment_status, status_table

    config = config_from_args(args)
    namespace = connect(args, config)
    status = deployment_status(namespace)
    emit(args, status, lambda: status_table(status))
    return 0


def cmd_snapshot(args: argparse.Namespace) -> int:
    from lifemem_ray.actors.cluster.deployment import snapshot

    config = config_from_args(args)
    namespace = connect(args, config)
    manifest = snapshot(args.out, namespace)
    emit(args, manifest, lambda: f"snapshot of {manifest['shards']} shards ({manifest['bytes']:,} bytes) in {args.out}")
    return 0


def cmd_compact(args: argparse.Namespace) -> int:
    """Rewrite a store no process uses (``--store``) or every shard of a running deployment in
    place into fresh pages: the bytes of deleted trajectories LMDB keeps in free pages and page
    slack go (:mod:`lifemem_ray.engine.compaction`, :func:`lifemem_ray.actors.cluster.deployment.compact`)."""
    config = config_from_args(args)
    if remote(args) and args.store:
        raise CommandError(
            "give --store DIR (a store no process has open) or --address/--namespace (a running deployment), not both"
        )
    if remote(args):
        from lifemem_ray.actors.cluster.deployment import compact

        out = compact(connect(args, config))
    elif args.store:
        from lifemem_ray.engine.compaction import compact_store

        out = compact_store(args.store, config)
    else:
        raise CommandError("--store DIR is required (or --address/--namespace for a deployment)")
    emit(args, out, lambda: f"compacted: {out['bytes_before']:,} bytes before, {out['bytes_after']:,} bytes after")
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    from lifemem_ray.actors.cluster.restore import parse_accepted_loss, restore

    config = config_from_args(args)
    namespace = connect(args, config, start_local=True)
    accepted = parse_accepted_loss(args.accept_loss or [])
    info = restore(
        args.snapshot,
        args.store,
        config.replace({"cluster.namespace": namespace}),
        shards=args.shards,
        accept_loss=accepted,
    )
    loss = "; ".join(f"{name}: entries from {entry} lost, as accepted" for name, entry in info["accepted_loss"].items())
    emit(
        args,
        info,
        lambda: (
            f"restored {info['trajectories']} trajectories in {info['clusters']} clusters onto {len(info['shards'])} shards"
            + (" (an interrupted restore, finished)" if info["resumed"] else "")
            + (f"; {loss}" if loss else "")
        ),
    )
    return 0
