"""The ``lifemem-ray`` command line.

Every command prints a readable report, or JSON with ``--json``. Errors go to
stderr as one line naming what is wrong and where, with exit status 1 (2 for
usage errors).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any, Callable, Sequence

from lifemem_ray.engine.memory_config import ConfigError

from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.core.model import InvalidTrajectoryError
from lifemem_ray.core.errors import CommandError
from lifemem_ray.core.tenancy import check_tenant

__all__ = ["main"]

log = logging.getLogger("lifemem_ray.cli")


def _set_overrides(args: argparse.Namespace) -> dict[str, str]:
    overrides: dict[str, Any] = {}
    for item in args.set or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r}: expected SECTION.KEY=VALUE")
        overrides[key.strip()] = value
    return overrides


def _config(args: argparse.Namespace) -> DeploymentConfig:
    overrides = {k: v for k, v in _set_overrides(args).items() if not k.startswith("experiment.")}
    if getattr(args, "llm_base_url", None):
        overrides["llm.base_url"] = args.llm_base_url
        overrides.setdefault("llm.backend", "openai")
    if getattr(args, "llm_model", None):
        overrides["llm.model"] = args.llm_model
    return DeploymentConfig.load(args.config, overrides=overrides)


# Characters a terminal may act on (escape sequences, C1 controls, bidirectional overrides):
# stored text is untrusted, so it is shown escaped, never interpreted. Newline and tab stay.
_TERMINAL_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """``text`` safe to print on a terminal: each such character shown as ``\\uNNNN`` (also a
    valid escape inside a JSON string, so JSON output stays JSON)."""
    return _TERMINAL_UNSAFE.sub(lambda m: f"\\u{ord(m.group(0)):04x}", text)


def _emit(args: argparse.Namespace, data: Any, text: Callable[[], str]) -> None:
    if args.json:
        print(printable(json.dumps(data, ensure_ascii=False, indent=2)))  # JSON escapes C0, not C1 or bidi
    else:
        print(printable(text()))


def _progress(total: int, desc: str, args: argparse.Namespace) -> Any:
    from tqdm import tqdm

    # A bar on an interactive terminal; silent in logs and pipes (tqdm's disable=None).
    return tqdm(total=total, desc=desc, unit="traj", file=sys.stderr, disable=None if not args.quiet else True)


# -- the sharded deployment --------------------------------------------------------------
def _remote(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "address", None) or getattr(args, "namespace", None))


HEAD_MARKER = "lifemem-ray-head.json"  # in the Ray session folder of a head `serve` started: its pid
HEAD_START_S = 180


def _free_port() -> int:
    """A TCP port of this machine nothing listens on now."""
    import socket

    with socket.socket() as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


class NoRayCluster(CommandError):
    """No Ray cluster answers where the command would join (nothing to stop, for ``stop``)."""


def _connect(args: argparse.Namespace, config: DeploymentConfig, *, start_local: bool = False) -> Any:
    """Connect this process to Ray (the running cluster, or with ``start_local`` a new local head).

    The address Ray would join is probed first (:mod:`lifemem_ray.actors.cluster.ray_address`), so a
    dead one is reported in seconds, naming who named it, instead of Ray retrying it for
    minutes; with ``start_local``, a dead address left in Ray's address file (a crashed head's)
    is passed over and a head of our own started."""
    import ray

    from lifemem_ray.actors.cluster.ray_address import answers, named_address

    namespace = args.namespace or config.cluster.namespace
    target = named_address(args.address)
    if target.address is not None and not answers(target.address):
        if not (start_local and target.from_file):
            raise NoRayCluster(_dead(target.address, target.source))
        log.warning("%s names %s, where no Ray cluster answers (a head that is gone); starting a local head",
                    target.source, target.address)
        _start_local_head(namespace)
        return namespace
    try:
        # "auto" unless given: Ray turns its token authentication on by itself only for an address it found.
        ray.init(address=args.address or "auto", namespace=namespace, include_dashboard=False, log_to_driver=False,
                 logging_level=logging.ERROR)
    except ConnectionError:
        if target.address is not None and answers(target.address):
            raise CommandError(_refused(target.address)) from None
        if not (start_local and target.address is None):
            raise NoRayCluster(f"no Ray cluster found at {target.address or 'auto'!r}; start one (`ray start --head`) or "
                               "run `lifemem-ray serve`") from None
        _start_local_head(namespace)
    return namespace


def _dead(address: str, source: str) -> str:
    """Why a command cannot join ``address`` (named by ``source``), and what to do."""
    if source in ("--address", "RAY_ADDRESS"):
        return (f"no Ray cluster answers at {address!r} (given by {source}): check the address, or start the cluster "
                "(`ray start --head`)")
    return (f"no Ray cluster answers at {address!r}, which Ray's address file {source} names (left by a head that "
            "is gone): start one (`lifemem-ray serve --store DIR` starts its own), or give --address")


def _refused(address: str) -> str:
    """Why a listening Ray cluster refused this client: almost always its token authentication."""
    token_env, token_path = os.environ.get("RAY_AUTH_TOKEN"), os.environ.get("RAY_AUTH_TOKEN_PATH")
    default = Path.home() / ".ray" / "auth_token"
    if token_env:
        where = "the token in RAY_AUTH_TOKEN was not accepted"
    elif token_path:
        where = f"the token in {token_path} (RAY_AUTH_TOKEN_PATH) was not accepted"
    elif default.is_file():
        where = f"the token in {default} was not accepted"
    else:
        where = f"no token was found (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or {default})"
    return (f"the Ray cluster at {address!r} refused this client (it listens, but the handshake failed: almost always "
            f"Ray's token authentication, and {where}); "
            "run `ray get-auth-token` on the cluster's head node and set RAY_AUTH_TOKEN to its output (or copy it to "
            f"{default}), then try again")


def _start_local_head(namespace: str) -> None:
    """A local Ray head that ``lifemem-ray stop --ray`` can stop alone: ``ray start --block`` in
    a session of its own (its Ray processes are its children and end with it), its pid recorded
    in the head's session folder."""
    import json
    import signal
    import subprocess
    import time

    import ray

    from lifemem_ray.actors.cluster import ray_internals
    from lifemem_ray.actors.cluster.ray_address import answers, named_address

    # Logical CPUs: the deployment's actors reserve fractions, and bulk loads need room beside them.
    cpus = str(max(4, 2 * (os.cpu_count() or 2)))
    # Token authentication stays on: `ray start` turns it on when a token exists, so make one
    # first where none does (Ray's own command; it keeps an existing token, and prints it: not shown).
    subprocess.run([str(Path(sys.executable).with_name("ray")), "get-auth-token", "--generate"], stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, check=False, timeout=60)
    port = _free_port()  # our own port, not the default 6379 another cluster of this machine may hold
    cmd = [str(Path(sys.executable).with_name("ray")), "start", "--head", "--block", f"--port={port}", f"--num-cpus={cpus}",
           "--include-dashboard=false", "--disable-usage-stats"]
    head = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + HEAD_START_S
    while True:
        if head.poll() is not None:
            raise CommandError(f"could not start a local Ray head: `{' '.join(cmd)}` exited with code {head.returncode}")
        named = named_address(None).address  # `ray start` writes it once its GCS runs
        try:
            if not (named and named.endswith(f":{port}") and answers(named)):
                raise ConnectionError(f"the new head's GCS on port {port} does not answer yet")
            ray.init(address="auto", namespace=namespace, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
            break
        except ConnectionError:
            if time.monotonic() > deadline:
                os.killpg(head.pid, signal.SIGKILL)
                raise CommandError(f"a local Ray head did not come up within {HEAD_START_S} s") from None
            time.sleep(1.0)
    session = ray_internals.session_dir()
    (session / HEAD_MARKER).write_text(json.dumps({"pid": head.pid, "cmd": cmd}))


def _stop_local_head() -> str:
    """Stop the Ray head this machine's ``lifemem-ray serve`` started (by its pid), or say why not."""
    import json
    import signal

    import ray

    from lifemem_ray.actors.cluster import ray_internals

    session, address = ray_internals.session_dir(), ray.get_runtime_context().gcs_address
    marker = session / HEAD_MARKER
    ray.shutdown()
    if not marker.exists():
        raise CommandError("the Ray cluster was not started by `lifemem-ray serve`, so it is left running; "
                           "stop it the way it was started (by its address or pid)")
    pid = int(json.loads(marker.read_text())["pid"])
    try:
        os.kill(pid, signal.SIGTERM)  # ray start --block stops its Ray processes on the way out
    except ProcessLookupError:
        said = "the local Ray head had already stopped"
    else:
        said = _wait_gone(pid)
    _forget_current_cluster(address)
    return said


def _wait_gone(pid: int, timeout_s: float = 60.0) -> str:
    """Wait for the head's ``ray start --block`` to exit; past the timeout, kill its session."""
    import signal
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return f"stopped the local Ray head (pid {pid})"
        time.sleep(0.5)
    os.killpg(pid, signal.SIGKILL)  # its session: the head and the Ray processes it started, nothing else
    return f"killed the local Ray head (pid {pid}) after {timeout_s:.0f} s"


def _forget_current_cluster(address: str, path: Path | None = None) -> None:
    """Remove Ray's "current cluster" file (``path``: Ray's default) when it names the head just
    stopped, as Ray's own stop command does: a stale one makes the next plain ``ray.init()``
    try to join the dead cluster. A file naming another cluster is left alone."""
    if path is None:
        from lifemem_ray.actors.cluster.ray_address import address_file

        path = address_file()
    try:
        if path.read_text().strip() == address:
            path.unlink()
    except OSError:  # no file, or not ours to remove
        pass


def _client(args: argparse.Namespace, config: DeploymentConfig) -> Any:
    from lifemem_ray.actors.cluster.client import MemoryClient

    namespace = _connect(args, config)
    return MemoryClient(namespace, config.replace({"cluster.namespace": namespace}))


def cmd_serve(args: argparse.Namespace) -> int:
    from lifemem_ray.actors.cluster.deployment import deploy, find_coordinator

    config = _config(args)
    keyring = _http_keys(args, config) if args.http else None  # refused before anything starts
    if not args.store and not args.http:
        raise CommandError("--store DIR is required (or --http alone, in front of a running deployment)")
    namespace = _connect(args, config, start_local=bool(args.store))  # --http alone stands in front of a running one
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
    _emit(args, info, lambda: said + f"; stop with `lifemem-ray stop --namespace {namespace}`")
    return 0


def _http_keys(args: argparse.Namespace, config: DeploymentConfig) -> Any:
    """The front door's keys (config and LIFEMEM_API_KEYS), and its bind address checked."""
    from lifemem_ray.service.auth import KeyRing, check_bind

    keyring = KeyRing.from_config(config.http)
    check_bind(args.host or config.http.host, keyring.mode)
    return keyring


def cmd_keys_new(args: argparse.Namespace) -> int:
    """A fresh random API key, shown once, and the entry (its hash) the server's config keeps."""
    from lifemem_ray.service.auth import ENV_KEYS, new_key

    key, entry = new_key(args.tenant, args.scopes, args.name)
    data = {"key": key, "entry": entry.to_dict()}
    scopes = ", ".join(f'"{s}"' for s in sorted(entry.scopes))
    toml = (f'[[http.api_keys]]\nname = "{entry.name}"\nsha256 = "{entry.sha256}"\ntenant = "{entry.tenant}"\n'
            f"scopes = [{scopes}]")
    _emit(args, data, lambda: f"key (shown once; give it to the client, store it nowhere else):\n  {key}\n\n"
          f"add to the server's config file (or as JSON to {ENV_KEYS}):\n{toml}")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    from lifemem_ray.actors.cluster.deployment import stop

    config = _config(args)
    try:
        namespace = _connect(args, config)
    except NoRayCluster as exc:  # no cluster answers: no deployment, front door or head of it runs to stop
        said = f"nothing to stop: {exc}"
        _emit(args, {"stopped": False, "namespace": args.namespace or config.cluster.namespace, "http": False,
                     "ray": "no Ray cluster answers", "detail": str(exc)}, lambda: said)
        return 0
    from lifemem_ray.actors.frontdoor.app import stop_http

    http = stop_http(namespace)  # the front door goes with the deployment it stands in front of
    stopped = stop(namespace)
    head = _stop_local_head() if args.ray else ""
    said = f"stopped the deployment in {namespace!r}" if stopped else f"no deployment in {namespace!r}"
    said += " and its HTTP front door" if http else ""
    _emit(args, {"stopped": stopped, "namespace": namespace, "http": http, **({"ray": head} if head else {})},
          lambda: said + (f"; {head}" if head else ""))
    return 0


def cmd_snapshot(args: argparse.Namespace) -> int:
    from lifemem_ray.actors.cluster.deployment import snapshot

    config = _config(args)
    namespace = _connect(args, config)
    manifest = snapshot(args.out, namespace)
    _emit(args, manifest, lambda: f"snapshot of {manifest['shards']} shards ({manifest['bytes']:,} bytes) in {args.out}")
    return 0


def cmd_compact(args: argparse.Namespace) -> int:
    """Rewrite a store no process uses (``--store``) or every shard of a running deployment in
    place into fresh pages: the bytes of deleted trajectories LMDB keeps in free pages and page
    slack go (:mod:`lifemem_ray.engine.store.compaction`, :func:`lifemem_ray.actors.cluster.deployment.compact`)."""
    config = _config(args)
    if _remote(args) and args.store:
        raise CommandError("give --store DIR (a store no process has open) or --address/--namespace (a running deployment), not both")
    if _remote(args):
        from lifemem_ray.actors.cluster.deployment import compact

        out = compact(_connect(args, config))
    elif args.store:
        from lifemem_ray.engine.store.compaction import compact_store

        out = compact_store(args.store, config)
    else:
        raise CommandError("--store DIR is required (or --address/--namespace for a deployment)")
    _emit(args, out, lambda: f"compacted: {out['bytes_before']:,} bytes before, {out['bytes_after']:,} bytes after")
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    from lifemem_ray.actors.cluster.deployment import restore

    config = _config(args)
    namespace = _connect(args, config, start_local=True)
    info = restore(args.snapshot, args.store, config.replace({"cluster.namespace": namespace}), shards=args.shards)
    _emit(args, info, lambda: f"restored {info['trajectories']} trajectories in {info['clusters']} clusters onto {len(info['shards'])} shards")
    return 0


# -- commands ------------------------------------------------------------------------------
def cmd_ingest(args: argparse.Namespace) -> int:
    """Each file is read and validated whole before anything of it is stored: all or nothing
    per file, unless ``--skip-invalid`` (bad records, conflicting ids included, are left out
    and listed by file:line). The summary always says how many records were stored."""
    from lifemem_ray.core.importers import ImportReport
    from lifemem_ray.engine.memory import Memory

    config = _config(args)
    if args.tenant is not None:
        check_tenant(args.tenant, "--tenant")
    if _remote(args):
        return _ingest_remote(args, config)
    if not args.store:
        raise CommandError("--store DIR is required (or --address/--namespace for a deployment)")
    report = ImportReport()
    counts = {"added": 0, "duplicates": 0}
    with Memory.open(args.store, config) as memory:

        def stored_conflicts(ids: list[str], fingerprints: list[str]) -> list[bool]:
            return [r is not None and r.status == "conflict" for r in memory.shard.known(ids, fingerprints)]

        def store(batch: list) -> None:
            _count(memory.add_many(batch), counts)

        _ingest_files(args, report, stored_conflicts, store, lambda: counts["added"], config.evolution.batch_size)
        stats = memory.stats()
    _emit_ingest(args, report, counts, stats, f"store {args.store}")
    return 0


def _ingest_remote(args: argparse.Namespace, config: DeploymentConfig) -> int:
    """Remote ingest answers bad input as local ingest does: each file is read and validated
    whole here first (ids checked against the deployment's shards), then its passing records
    go to the coordinator in batches (embedded by its embedder actors), at most
    ``REMOTE_IN_FLIGHT`` batches in flight. No Ray task is needed on the way, so a cluster
    whose CPUs the deployment's actors hold still makes progress."""
    from lifemem_ray.core.importers import ImportReport

    client = _client(args, config)
    report = ImportReport()
    counts = {"added": 0, "duplicates": 0}
    pending: list[Any] = []

    def settle(limit: int) -> None:
        while len(pending) > limit:
            _count(pending.pop(0).result(), counts)

    def store(batch: list) -> None:
        pending.append(client.add_many(batch))
        settle(REMOTE_IN_FLIGHT)

    def stored_so_far() -> int:
        settle(0)
        return counts["added"]

    _ingest_files(args, report, client.stored_conflicts, store, stored_so_far, config.evolution.batch_size)
    settle(0)
    stats = client.stats()
    _emit_ingest(args, report, counts, stats, f"deployment {client.namespace!r}")
    return 0


def _ingest_files(args: argparse.Namespace, report: Any, stored_conflicts: Callable[[list[str], list[str]], list[bool]],
                  store: Callable[[list], None], stored_so_far: Callable[[], int], batch_size: int) -> None:
    """Every file of ``args.paths``: checked whole (:func:`~lifemem_ray.core.importers.check_file`),
    then its passing records handed to ``store`` in batches; a file with a bad record stops
    the run with FILE:LINE and what earlier files stored."""
    from lifemem_ray.core.importers import RecordError, check_file

    bar = _progress(0, "ingest", args)
    try:
        for n, path in enumerate(args.paths):
            try:
                checked = check_file(path, fmt=args.format, env=args.env, skip_invalid=args.skip_invalid, report=report,
                                     stored_conflicts=stored_conflicts, tenant=args.tenant)
            except RecordError as exc:
                raise CommandError(f"{exc}; nothing of {exc.path} was stored ({stored_so_far()} record(s) stored from "
                                   f"{n} earlier file(s)); fix the record, or pass --skip-invalid to leave such records out") from None
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


def _count(results: Sequence[Any], counts: dict[str, int]) -> None:
    for result in results:
        counts["added" if result.status in ("added", "pending") else "duplicates"] += 1


def _emit_ingest(args: argparse.Namespace, report: Any, counts: dict[str, int], stats: dict[str, Any], where: str) -> None:
    data = {"read": report.read, "valid": report.valid, "invalid": report.invalid, **counts,
            "errors": [str(e) for e in report.errors], "store": {"trajectories": stats["trajectories"], "clusters": stats["clusters"]}}

    def text() -> str:
        lines = [f"read {report.read} records: {counts['added']} stored, {counts['duplicates']} already present, {report.invalid} invalid",
                 f"{where}: {stats['trajectories']} trajectories in {stats['clusters']} clusters"]
        return "\n".join(lines + [f"  skipped {e}" for e in data["errors"][:20]])

    _emit(args, data, text)


REMOTE_IN_FLIGHT = 4  # add requests of one remote ingest awaiting their acknowledgement


def _open_or_connect(args: argparse.Namespace, config: DeploymentConfig, *, write: bool = False) -> Any:
    """The deployment's client (``--address``/``--namespace``), else the store at ``--store``:
    read-only, or (``write``) writable but only where a store already is, so a mistyped path
    is an error rather than a new empty store."""
    from lifemem_ray.engine.memory import Memory

    if _remote(args):
        return _client(args, config)
    if not args.store:
        raise CommandError("--store DIR is required (or --address/--namespace for a deployment)")
    if write:
        _require_store(args.store)
    return Memory.open(args.store, config, read_only=not write)


def _require_store(store: str | Path, remedy: str = "") -> None:
    """A command that writes into an existing store refuses a folder without one, so that a
    mistyped path is an error rather than a new empty store."""
    if not (Path(store) / "data.mdb").is_file():
        raise CommandError(f"{store}: no memory store here (data.mdb missing){remedy}")


def cmd_retrieve(args: argparse.Namespace) -> int:
    config = _config(args)
    from lifemem_ray.engine.retrieval import check_retrieve_args

    check_retrieve_args([args.task], [args.env], args.k, None, config.retrieval)  # before opening anything
    check_tenant(args.tenant, "--tenant")
    memory = _open_or_connect(args, config)
    try:
        result = memory.retrieve(args.task, args.env, args.k, tenant=args.tenant)
    finally:
        memory.close()
    data = result.to_dict()
    if args.context:
        data["context"] = result.context

    def text() -> str:
        lines = [f"top {len(result.trajectories)} in {args.env} for: {args.task}"]
        for hit in result.trajectories:
            lines.append(f"  {hit.score:.3f}  [{hit.cluster_id}] {hit.id}  {' '.join(hit.task.split())[:90]}")
        for skill in result.skills:
            lines.append(f"skill of cluster {skill.cluster_id}:")
            lines.append(textwrap.indent(skill.text, "    "))
        if args.context:
            lines += ["", result.context]
        return "\n".join(lines)

    _emit(args, data, text)
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    if args.tenant is not None:
        check_tenant(args.tenant, "--tenant")
    memory = _open_or_connect(args, _config(args))
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
            lines.append(f"llm ({llm.get('backend', 'per shard')}): {llm['calls']} calls, {llm['tokens']} tokens, "
                         f"{llm['fallbacks']} fallbacks, {llm.get('refused_generated', 0)} generated texts refused")
        return "\n".join(lines)

    _emit(args, stats, text)
    return 0


def cmd_clusters(args: argparse.Namespace) -> int:
    check_tenant(args.tenant, "--tenant")
    memory = _open_or_connect(args, _config(args))
    try:
        clusters = memory.clusters(args.env, tenant=args.tenant)
    finally:
        memory.close()
    data = [c.to_dict() for c in clusters]
    _emit(args, data, lambda: _format_clusters(clusters))
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    """Delete trajectories of ``--tenant`` by id, or with ``--purge-tenant`` everything of it;
    durable when it returns, and safe to run again (ids no longer stored are ignored). A tenant
    name stored by an older version with a final newline may be given, to delete what it holds."""
    tenant = check_tenant(args.tenant, "--tenant", stored=True)
    if bool(args.ids) == bool(args.purge_tenant):
        raise CommandError("give the trajectory ids to delete, or --purge-tenant (with --tenant) to delete everything of a tenant")
    memory = _open_or_connect(args, _config(args), write=True)
    try:
        removed = memory.purge_tenant(tenant) if args.purge_tenant else memory.remove(args.ids, tenant=tenant)
    finally:
        memory.close()
    data = {"removed": removed, "tenant": tenant, **({"purged": True} if args.purge_tenant else {"asked": len(args.ids)})}
    what = f"every trajectory of tenant {tenant!r}" if args.purge_tenant else f"{len(args.ids)} id(s) of tenant {tenant!r}"
    _emit(args, data, lambda: f"deleted {removed} trajectories ({what})")
    return 0


def _format_clusters(clusters: Sequence[Any], skills: bool = True) -> str:
    lines = []
    for c in clusters:
        envs = ", ".join(f"{e}:{n}" for e, n in sorted(c.envs.items(), key=lambda kv: -kv[1]))
        lines.append(f"cluster {c.id}  n={c.count}  R={c.mrl:.3f}  [{envs}]")
        lines.append(f"  {c.description}")
        if skills and c.skill:
            lines.append(textwrap.indent(c.skill, "    | "))
    return "\n".join(lines)


def cmd_export(args: argparse.Namespace) -> int:
    from lifemem_ray.engine.memory import Memory

    with Memory.open(args.store, _config(args), read_only=True) as memory:
        result = memory.export(args.out)
    _emit(args, result, lambda: f"wrote {result['trajectories']} trajectories to {args.out} and {result['clusters']} clusters to {result['clusters_path']}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    memory = _open_or_connect(args, _config(args))
    try:
        report = memory.verify(deep=True) if args.deep else memory.verify()
    finally:
        memory.close()
    parts = report.get("shards", [report])
    _emit(
        args,
        report,
        lambda: ("ok: " if report["ok"] else "PROBLEMS: ")
        + f"{sum(p['trajectories'] for p in parts)} trajectories, {sum(p['clusters'] for p in parts)} clusters"
        + "".join(f"\n  {problem}" for p in parts for problem in p["problems"]),
    )
    return 0 if report["ok"] else 1


def cmd_run(args: argparse.Namespace) -> int:
    """The lifelong experiment: rollout workers on Ray against a memory per mode."""
    import ray

    from lifemem_ray.actors.rollout.experiment import run_experiment
    from lifemem_ray.actors.rollout.workers import print_progress
    from lifemem_ray.lab.experiment_config import ExperimentConfig

    config = _config(args)
    overrides = {k.split(".", 1)[1]: v for k, v in _set_overrides(args).items() if k.startswith("experiment.")}
    for flag in ("workers", "seeds", "stream", "agent", "output"):
        value = getattr(args, flag, None)
        if value is not None:
            overrides[flag] = value
    if args.envs:
        overrides["envs"] = args.envs
    if args.modes:
        overrides["modes"] = args.modes
    if args.eval_envs is not None:
        overrides["eval_envs"] = args.eval_envs
    if config.llm.backend == "openai" and "agent" not in overrides:
        overrides["agent"] = "react"  # an endpoint is configured: the LLM agent acts
    exp = ExperimentConfig.load(args.config, overrides=overrides)
    if args.address:
        ray.init(address=args.address, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    else:
        # A local Ray for this run: logical CPUs leave room for the workers beside the memory's actors.
        cpus = max(4, (os.cpu_count() or 2) + exp.workers)
        ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=args.verbose, logging_level=logging.WARNING)
    try:
        report = run_experiment(exp, config, progress=None if args.quiet else print_progress)
    finally:
        ray.shutdown()
    out = exp.output_dir

    def text() -> str:
        md = (out / "report.md").read_text()
        tp = report["throughput"]
        return (md + f"\n{tp['episodes']} episodes, {tp['steps_per_s']:.0f} steps/s, memory p50 {tp['memory_p50_ms']:.1f} ms, "
                f"{report['seconds']:.0f} s in all.\nReport: {out / 'report.md'}, {out / 'report.json'}; plots: "
                + ", ".join(report["plots"]))

    _emit(args, report, text)
    return 0


def cmd_mcp(args: argparse.Namespace) -> int:
    """The MCP server over stdin / stdout as one principal (the tenant, read and write), on the
    engine alone; stdout is the protocol, logs go to stderr. Closes the store on EOF or SIGTERM.
    Serves an existing store only, unless ``--create``."""
    from lifemem_ray.service.mcp_server import run_stdio
    from lifemem_ray.engine.memory import Memory
    from lifemem_ray.service.principal import Principal

    config = _config(args)
    principal = Principal(check_tenant(args.tenant, "--tenant"), frozenset({"read", "write"}), "stdio")
    if not args.create:
        _require_store(args.store, "; pass --create to start a new store there")
    memory = Memory.open(args.store, config)
    try:
        run_stdio(memory, principal)
    finally:
        memory.close()
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from lifemem_ray.lab.demo import run_demo

    config = _config(args)
    store = Path(args.store) if args.store else Path(tempfile.mkdtemp(prefix="lifemem-demo-"))
    report = run_demo(store, config, progress=lambda total: _progress(total, "demo ingest", args))
    _emit(args, report, lambda: report["text"])
    return 0


# -- parser --------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lifemem-ray", description="Lifelong workflow memory for LLM agents (LifeMem).")
    parser.add_argument("--version", action="version", version="lifemem-ray 0.1.0")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common, remote, llm = _shared_options()
    _experiment_commands(sub, common, llm)
    _store_commands(sub, common, remote, llm)
    _deployment_commands(sub, common, remote, llm)
    return parser


def _shared_options() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser, argparse.ArgumentParser]:
    """The option groups commands share: common, a deployment's address, an LLM endpoint."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", metavar="FILE", help="TOML configuration file")
    common.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override one setting (repeatable)")
    common.add_argument("--json", action="store_true", help="machine-readable output")
    common.add_argument("--quiet", action="store_true", help="no progress bar")
    common.add_argument("-v", "--verbose", action="store_true", help="log what the engine does")
    remote = argparse.ArgumentParser(add_help=False)
    remote.add_argument("--address", help="Ray address of a running deployment (default: auto, the local cluster)")
    remote.add_argument("--namespace", help="Ray namespace of the deployment (default: cluster.namespace)")
    llm = argparse.ArgumentParser(add_help=False)
    llm.add_argument("--llm-base-url", metavar="URL", help="OpenAI-compatible endpoint; turns on the LLM backend")
    llm.add_argument("--llm-model", metavar="NAME", help="model name at that endpoint")
    return common, remote, llm


def _experiment_commands(sub: Any, common: argparse.ArgumentParser, llm: argparse.ArgumentParser) -> None:
    p = sub.add_parser("demo", parents=[common, llm], help="build a memory from the shipped sample and query it")
    p.add_argument("--store", metavar="DIR", help="where to build it (default: a new temporary folder)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("run", parents=[common, llm], help="run a lifelong experiment (rollout workers, OP/BwT table, plots)")
    p.add_argument("--address", help="Ray cluster to run on (default: a local Ray started for the run)")
    p.add_argument("--envs", nargs="+", metavar="ENV", help="environments in stream order (default: experiment.envs)")
    p.add_argument("--eval-envs", nargs="*", metavar="ENV", help="evaluation-only environments: zero-shot transfer (default: experiment.eval_envs)")
    p.add_argument("--modes", nargs="+", metavar="MODE",
                   help="memory modes: none trajectory global-skills lifemem lifemem-no-skills skills-only (default: all)")
    p.add_argument("--workers", type=int, help="rollout workers")
    p.add_argument("--seeds", type=int, help="runs with seeds seed..seed+N-1, pooled with bootstrap intervals (default: 3)")
    p.add_argument("--stream", choices=("similarity", "random", "buffer"))
    p.add_argument("--agent", help="skill-guided | exemplar | react | random | gold | noisy-gold")
    p.add_argument("--output", metavar="DIR", help="where the report goes (default: runs/<name>)")
    p.set_defaults(func=cmd_run)


def _store_commands(sub: Any, common: argparse.ArgumentParser, remote: argparse.ArgumentParser, llm: argparse.ArgumentParser) -> None:
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
    p.add_argument("--purge-tenant", action="store_true", help="delete every trajectory of --tenant (its clusters and skills go too)")
    p.set_defaults(func=cmd_delete)

    p = sub.add_parser("export", parents=[common], help="write trajectories (native JSONL) and clusters")
    p.add_argument("--store", required=True, metavar="DIR")
    p.add_argument("out", metavar="OUT.jsonl")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("check", parents=[remote, common], help="verify the store's invariants")
    p.add_argument("--store", metavar="DIR")
    p.add_argument("--deep", action="store_true",
                   help="also recompute every record's fingerprint from its content (reads every record)")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("mcp", parents=[common, llm], help="serve the store to an agent host over MCP (stdio, no Ray)")
    p.add_argument("--store", required=True, metavar="DIR", help="the store folder (must hold a store, unless --create)")
    p.add_argument("--create", action="store_true", help="create the store when DIR has none (else that is an error: a mistyped path "
                   "would serve a new empty memory)")
    p.add_argument("--tenant", default="default", help="the tenant every call acts as (default: default)")
    p.set_defaults(func=cmd_mcp)


def _deployment_commands(sub: Any, common: argparse.ArgumentParser, remote: argparse.ArgumentParser, llm: argparse.ArgumentParser) -> None:
    p = sub.add_parser("serve", parents=[remote, common, llm], help="start a sharded deployment on Ray (named, detached)")
    p.add_argument("--store", metavar="DIR", help="folder for the shards' and the coordinator's stores")
    p.add_argument("--shards", type=int, default=None, help="number of shards (default: cluster.shards)")
    p.add_argument("--http", action="store_true", help="also serve REST and MCP on Ray Serve (without --store: in front of the running deployment)")
    p.add_argument("--host", default=None, help="HTTP address (default: http.host, 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="HTTP port (default: http.port, 8000)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("keys", help="API keys of the HTTP front door")
    keys = p.add_subparsers(dest="keys_command", required=True, metavar="KEYS_COMMAND")
    p = keys.add_parser("new", parents=[common], help="a fresh random key and its config entry (only the hash is stored)")
    p.add_argument("--tenant", required=True, help="the tenant every request of the key acts as")
    p.add_argument("--scopes", required=True, help="comma-separated: read, write, admin")
    p.add_argument("--name", help="a non-secret name for the key (default: TENANT-random)")
    p.set_defaults(func=cmd_keys_new)

    p = sub.add_parser("stop", parents=[remote, common], help="stop a deployment (closing every shard cleanly)")
    p.add_argument("--ray", action="store_true", help="also stop the local Ray head `serve` started (only that one)")
    p.set_defaults(func=cmd_stop)

    p = sub.add_parser("snapshot", parents=[remote, common], help="consistent snapshot of every shard and the routing table")
    p.add_argument("out", metavar="DIR")
    p.set_defaults(func=cmd_snapshot)

    p = sub.add_parser("compact", parents=[remote, common], help="rewrite a store (or every shard of a deployment) in place, "
                       "dropping the bytes of deleted trajectories")
    p.add_argument("--store", metavar="DIR", help="a store folder no process has open (or --address/--namespace for a deployment)")
    p.set_defaults(func=cmd_compact)

    p = sub.add_parser("restore", parents=[remote, common, llm], help="a new deployment from a snapshot (any shard count)")
    p.add_argument("snapshot", metavar="SNAPSHOT_DIR")
    p.add_argument("--store", required=True, metavar="DIR", help="a new, empty folder for the restored deployment")
    p.add_argument("--shards", type=int, default=None)
    p.set_defaults(func=cmd_restore)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        return int(args.func(args) or 0)
    except (ConfigError, InvalidTrajectoryError, CommandError, ValueError, OSError) as exc:
        print(printable(f"lifemem-ray {args.command}: error: {exc}"), file=sys.stderr)
        return 1
    except Exception as exc:  # StoreError and friends: one line, no traceback unless -v
        if args.verbose:
            raise
        print(printable(f"lifemem-ray {args.command}: error: {type(exc).__name__}: {exc}"), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"lifemem-ray {args.command}: interrupted; everything acknowledged so far is stored", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
