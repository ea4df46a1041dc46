"""The commands on a memory's records, on a store folder (the engine, no Ray) or, with
``--address`` / ``--namespace``, on a running deployment: ``ingest``, ``retrieve``, ``stats``,
``clusters``, ``delete``, ``export``, ``check``, ``mcp`` and ``demo``."""

from __future__ import annotations

import argparse
import tempfile
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.cli.options import config_from_args, emit, progress, remote
from lifemem_ray.cli.ray_session import deployment_client
from lifemem_ray.core.errors import CommandError
from lifemem_ray.core.ids import id_label
from lifemem_ray.core.tenancy import check_tenant


# -- commands ------------------------------------------------------------------------------
def cmd_ingest(args: argparse.Namespace) -> int:
    """Each file is read and validated whole before anything of it is stored: all or nothing
    per file, unless ``--skip-invalid`` (bad records, conflicting ids included, are left out
    and listed by file:line). The summary always says how many records were stored."""
    from lifemem_ray.core.importers import ImportReport
    from lifemem_ray.engine.memory import Memory

    config = config_from_args(args)
    if args.tenant is not None:
        check_tenant(args.tenant, "--tenant")
    if remote(args):
        return ingest_remote(args, config)
    if not args.store:
        raise CommandError("--store DIR is required (or --address/--namespace for a deployment)")
    report = ImportReport()
    counts = {"added": 0, "duplicates": 0}
    with Memory.open(args.store, config) as memory:

        def stored_conflicts(ids: list[str], fingerprints: list[str]) -> list[bool]:
            return [r is not None and r.status == "conflict" for r in memory.shard.known(ids, fingerprints)]

        def store(batch: list) -> None:
            count_results(memory.add_many(batch), counts)

        ingest_files(args, report, stored_conflicts, store, lambda: counts["added"], config.evolution.batch_size)
        stats = memory.stats()
    emit_ingest(args, report, counts, stats, f"store {args.store}")
    return 0


def ingest_remote(args: argparse.Namespace, config: DeploymentConfig) -> int:
    """Remote ingest answers bad input as local ingest does: each file is read and validated
    whole here first (ids checked against the deployment's shards), then its passing records
    go to the coordinator in batches (embedded by its embedder actors), at most
    ``REMOTE_IN_FLIGHT`` batches in flight. No Ray task is needed on the way, so a cluster
    whose CPUs the deployment's actors hold still makes progress."""
    from lifemem_ray.core.importers import ImportReport

    client = deployment_client(args, config)
    report = ImportReport()
    counts = {"added": 0, "duplicates": 0}
    pending: list[Any] = []

    def settle(limit: int) -> None:
        while len(pending) > limit:
            count_results(pending.pop(0).result(), counts)

    def store(batch: list) -> None:
        pending.append(client.add_many(batch))
        settle(REMOTE_IN_FLIGHT)

    def stored_so_far() -> int:
        settle(0)
        return counts["added"]

    ingest_files(args, report, client.stored_conflicts, store, stored_so_far, config.evolution.batch_size)
    settle(0)
    stats = client.stats()
    emit_ingest(args, report, counts, stats, f"deployment {client.namespace!r}")
    return 0


def ingest_files(
    args: argparse.Namespace,
    report: Any,
    stored_conflicts: Callable[[list[str], list[str]], list[bool]],
    store: Callable[[list], None],
    stored_so_far: Callable[[], int],
    batch_size: int,
) -> None:
    """Every file of ``args.paths``: checked whole (:func:`~lifemem_ray.core.importers.check_file`),
    then its passing records handed to ``store`` in batches; a file with a bad record stops
    the run with FILE:LINE and what earlier files stored."""
    from lifemem_ray.core.importers import RecordError, check_file

    bar = progress(0, "ingest", args)
    try:
        for n, path in enumerate(args.paths):
            try:
                checked = check_file(
                    path,
                    fmt=args.format,
                    env=args.env,
                    skip_invalid=args.skip_invalid,
                    report=report,
                    stored_conflicts=stored_conflicts,
                    tenant=args.tenant,
                )
            except RecordError as exc:
                raise CommandError(
                    f"{exc}; nothing of {exc.path} was stored ({stored_so_far()} record(s) stored from "
                    f"{n} earlier file(s)); fix the record, or pass --skip-invalid to leave such records out"
                ) from None
            try:
                batch: list = []
                for traj in checked.records(fmt=args.format, env=args.env, tenant=args.tenant):
                    batch.append(traj)
                    if len(batch) >= batch_size:
                        store(batch)
                        bar.update(len(batch))
                        batch = []
                if batch:
                    store(batch)
                    bar.update(len(batch))
            finally:
                checked.close()
    finally:
        bar.close()


def count_results(results: Sequence[Any], counts: dict[str, int]) -> None:
    for result in results:
        counts["added" if result.status in ("added", "pending") else "duplicates"] += 1


def emit_ingest(
    args: argparse.Namespace, report: Any, counts: dict[str, int], stats: dict[str, Any], where: str
) -> None:
    data = {
        "read": report.read,
        "valid": report.valid,
        "invalid": report.invalid,
        **counts,
        "errors": [str(e) for e in report.errors],
        "store": {"trajectories": stats["trajectories"], "clusters": stats["clusters"]},
    }

    def text() -> str:
        lines = [
            f"read {report.read} records: {counts['added']} stored, {counts['duplicates']} already present, {report.invalid} invalid",
            f"{where}: {stats['trajectories']} trajectories in {stats['clusters']} clusters",
        ]
        return "\n".join(lines + [f"  skipped {e}" for e in data["errors"][:20]])

    emit(args, data, text)


REMOTE_IN_FLIGHT = 4  # add requests of one remote ingest awaiting their acknowledgement


def open_or_connect(args: argparse.Namespace, config: DeploymentConfig, *, write: bool = False) -> Any:
    """The deployment's client (``--address``/``--namespace``), else the store at ``--store``:
    read-only, or (``write``) writable but only where a store already is, so a mistyped path
    is an error rather than a new empty store."""
    from lifemem_ray.engine.memory import Memory

    if remote(args):
        return deployment_client(args, config)
    if not args.store:
        raise CommandError("--store DIR is required (or --address/--namespace for a deployment)")
    if write:
        require_store(args.store)
    return Memory.open(args.store, config, read_only=not write)


def require_store(store: str | Path, remedy: str = "") -> None:
    """A command that writes into an existing store refuses a folder without one, so that a
    mistyped path is an error rather than a new empty store."""
    if not (Path(store) / "data.mdb").is_file():
        raise CommandError(f"{store}: no memory store here (data.mdb missing){remedy}")


def cmd_retrieve(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    from lifemem_ray.engine.retrieval import check_retrieve_args

    check_retrieve_args([args.task], [args.env], args.k, None, config.retrieval)  # before opening anything
    check_tenant(args.tenant, "--tenant")
    memory = open_or_connect(args, config)
    try:
        result = memory.retrieve(args.task, args.env, args.k, tenant=args.tenant)
    finally:
        memory.close()
    data = result.to_dict()
    if args.context:
        data["context"] = result.context

    def text() -> str:
        lines = [f"top {len(result.trajectories)} in {args.env} for: {args.task}", "  similarity  cluster  id  task"]
        for hit in result.trajectories:
            lines.append(
                f"  {hit.score:10.3f}  {id_label(hit.cluster_id):>7}  {hit.id}  {' '.join(hit.task.split())[:90]}"
            )
        for skill in result.skills:
            lines.append(f"skill of cluster {id_label(skill.cluster_id)}:")
            lines.append(textwrap.indent(skill.text, "    "))
        if args.context:
            lines += ["", result.context]
        return "\n".join(lines)

    emit(args, data, text)
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    if args.tenant is not None:
        check_tenant(args.tenant, "--tenant")
    memory = open_or_connect(args, config_from_args(args))
    try:
        stats = memory.stats(args.tenant)
    finally:
        memory.close()

    def text() -> str:
        splits = f"{stats['splits']} splits, " if "splits" in stats else ""
        lines = [
            (f"tenant {stats['tenant']}: " if "tenant" in stats else "")
            + f"{stats['trajectories']} trajectories, {stats['clusters']} clusters ({stats['mixed_env_clusters']} mix environments), "
            f"{splits}{stats['pending']} pending",
        ]
        for env, s in stats["per_env"].items():
            lines.append(f"  {env:<20} {s['trajectories']:>8} trajectories {s['clusters']:>6} clusters")
        llm = stats.get("llm")  # the store's as a whole: not in a tenant's view
        if llm is not None:
            lines.append(
                f"llm ({llm.get('backend', 'per shard')}): {llm['calls']} calls, {llm['tokens']} tokens, "
                f"{llm['fallbacks']} fallbacks, {llm.get('refused_generated', 0)} generated texts refused"
            )
        return "\n".join(lines)

    emit(args, stats, text)
    return 0


def cmd_clusters(args: argparse.Namespace) -> int:
    check_tenant(args.tenant, "--tenant")
    memory = open_or_connect(args, config_from_args(args))
    try:
        clusters = memory.clusters(args.env, tenant=args.tenant)
    finally:
        memory.close()
    data = [c.to_dict() for c in clusters]
    emit(args, data, lambda: format_clusters(clusters))
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    """Delete trajectories of ``--tenant`` by id, or with ``--purge-tenant`` everything of it;
    durable when it returns, and safe to run again (ids no longer stored are ignored). A tenant
    name stored by an older version with a final newline may be given, to delete what it holds."""
    tenant = check_tenant(args.tenant, "--tenant", stored=True)
    if bool(args.ids) == bool(args.purge_tenant):
        raise CommandError(
            "give the trajectory ids to delete, or --purge-tenant (with --tenant) to delete everything of a tenant"
        )
    memory = open_or_connect(args, config_from_args(args), write=True)
    try:
        removed = memory.purge_tenant(tenant) if args.purge_tenant else memory.remove(args.ids, tenant=tenant)
    finally:
        memory.close()
    data = {
        "removed": removed,
        "tenant": tenant,
        **({"purged": True} if args.purge_tenant else {"asked": len(args.ids)}),
    }
    what = (
        f"every trajectory of tenant {tenant!r}" if args.purge_tenant else f"{len(args.ids)} id(s) of tenant {tenant!r}"
    )
    emit(args, data, lambda: f"deleted {removed} trajectories ({what})")
    return 0


def format_clusters(clusters: Sequence[Any], skills: bool = True) -> str:
    lines = []
    for c in clusters:
        envs = ", ".join(f"{e}:{n}" for e, n in sorted(c.envs.items(), key=lambda kv: -kv[1]))
        lines.append(f"cluster {id_label(c.id)}: n = {c.count}, cohesion R = {c.mrl:.3f}, environments {envs}")
        lines.append(f"  {c.description}")
        if skills and c.skill:
            lines.append(textwrap.indent(c.skill, "    | "))
    return "\n".join(lines)


def cmd_export(args: argparse.Namespace) -> int:
    from lifemem_ray.engine.memory import Memory

    with Memory.open(args.store, config_from_args(args), read_only=True) as memory:
        result = memory.export(args.out)
    emit(
        args,
        result,
        lambda: (
            f"wrote {result['trajectories']} trajectories to {args.out} and {result['clusters']} clusters to {result['clusters_path']}"
        ),
    )
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    memory = open_or_connect(args, config_from_args(args))
    try:
        report = memory.verify(deep=True) if args.deep else memory.verify()
    finally:
        memory.close()
    parts = report.get("shards", [report])
    emit(
        args,
        report,
        lambda: (
            ("ok: " if report["ok"] else "PROBLEMS: ")
            + f"{sum(p['trajectories'] for p in parts)} trajectories, {sum(p['clusters'] for p in parts)} clusters"
            + "".join(f"\n  {problem}" for p in parts for problem in p["problems"])
        ),
    )
    return 0 if report["ok"] else 1


def cmd_mcp(args: argparse.Namespace) -> int:
    """The MCP server over stdin / stdout as one principal (the tenant, read and write), on the
    engine alone; stdout is the protocol, logs go to stderr. Closes the store on EOF or SIGTERM.
    Serves an existing store only, unless ``--create``."""
    from lifemem_ray.engine.memory import Memory
    from lifemem_ray.service.mcp_server import run_stdio
    from lifemem_ray.service.principal import Principal

    config = config_from_args(args)
    principal = Principal(check_tenant(args.tenant, "--tenant"), frozenset({"read", "write"}), "stdio")
    if not args.create:
        require_store(args.store, "; pass --create to start a new store there")
    memory = Memory.open(args.store, config)
    try:
        run_stdio(memory, principal)
    finally:
        memory.close()
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from lifemem_ray.lab.demo import run_demo

    config = config_from_args(args)
    store = Path(args.store) if args.store else Path(tempfile.mkdtemp(prefix="lifemem-demo-"))
    report = run_demo(store, config, progress=lambda total: progress(total, "demo ingest", args))
    emit(args, report, lambda: report["text"])
    return 0
