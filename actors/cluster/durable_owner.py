"""One durable address, one deployment: the ownership record at
``<cluster.durable_uri>/<namespace>/deployment.json``.

Two deployments (two Ray heads, each its own store folder) given the same namespace and
``durable_uri`` would otherwise write the same shard logs: the second would start as a clone
of the first's shards and fork their logs. A deployment therefore claims its durable address
when it is served, with an exclusive create (a hard link on a filesystem, ``If-None-Match`` on
S3), and a deployment whose id is not the record's is refused before any actor starts,
naming the owner. The record stays after ``stop``: the store folder that wrote the logs is
still their only writer. Within the deployment, each shard opening takes its log over with a
higher epoch (:mod:`lifemem_ray.engine.store.redo`), which deposes a shard left running on a
node the deployment gave up on.
"""

from __future__ import annotations

import datetime
import json
import logging
import socket
from pathlib import Path
from typing import Any

from lifemem_ray.actors.cluster.checkpoints import deployment_address
from lifemem_ray.actors.cluster.cluster_config import ClusterConfig
from lifemem_ray.engine.store.log_errors import DurableAddressOwnedError, SharedLogError
from lifemem_ray.engine.store.shared_log import create_exclusive, open_shared_log, shard_logs

__all__ = ["OWNER_RECORD", "claim_durable_address", "durable_owner"]

log = logging.getLogger(__name__)

OWNER_RECORD = "deployment.json"


def durable_owner(cluster: ClusterConfig) -> dict[str, Any] | None:
    """The ownership record of the deployment's durable address (None: unclaimed, or no
    ``durable_uri``).

    Raises:
        SharedLogError: the durable storage cannot be read.
    """
    if not cluster.durable_uri:
        return None
    root = open_shared_log(deployment_address(cluster.durable_uri, cluster.namespace), cluster.durable_endpoint_url)
    assert root is not None
    path = f"{root.root}/{OWNER_RECORD}"
    try:
        return json.loads(root.fs.cat_file(path)) if root.fs.exists(path) else None
    except Exception as exc:
        raise SharedLogError(f"{root.uri}/{OWNER_RECORD}: cannot read the ownership record ({exc})") from exc


def claim_durable_address(cluster: ClusterConfig, deployment_id: str, store: Path) -> dict[str, Any] | None:
    """Claim the deployment's durable address for ``deployment_id`` (served from ``store``), or
    find it already claimed by it. Returns the record (None without ``durable_uri``).

    Args:
        cluster: the deployment's ``[cluster]`` settings (``durable_uri``, ``namespace``).
        deployment_id: the deployment's id, kept in its routing table.
        store: the deployment's store folder (named in the record, for the operator).

    Raises:
        DurableAddressOwnedError: another deployment owns the address.
        SharedLogError: the durable storage cannot be read or written.
    """
    if not cluster.durable_uri:
        return None
    address = deployment_address(cluster.durable_uri, cluster.namespace)
    owner = durable_owner(cluster)
    if owner is None:
        record = {
            "deployment_id": deployment_id,
            "store": str(store),
            "host": socket.gethostname(),
            "claimed_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        earlier = shard_logs(address, cluster.durable_endpoint_url)
        root = open_shared_log(address, cluster.durable_endpoint_url)
        assert root is not None
        try:
            root.fs.makedirs(root.root, exist_ok=True)
            create_exclusive(root, f"{root.root}/{OWNER_RECORD}", json.dumps(record, indent=2).encode())
        except FileExistsError:  # claimed meanwhile: whose it is decides below
            owner = durable_owner(cluster)
        except Exception as exc:
            raise SharedLogError(f"{address}/{OWNER_RECORD}: cannot write the ownership record ({exc})") from exc
        else:
            if earlier:
                log.warning(
                    "%s: claimed for deployment %s; its %d shard logs were written before ownership records",
                    address,
                    deployment_id,
                    len(earlier),
                )
            return record
    if owner is not None and owner.get("deployment_id") != deployment_id:
        raise DurableAddressOwnedError(address, owner)
    return owner
