"""A trajectory's stored record, in bytes: the layout every store and every client shares (the
engine writes it, the Ray client packs it before it travels, retrieval reads named fields of
it without decoding the whole). The other stored layouts (briefs, vectors, cluster records)
are the store's: :mod:`lifemem_ray.engine.store.codec`.

========================  ==============================================================
record                    msgpack layout
========================  ==============================================================
trajectory record         map: id, env, task, io (initial observation), steps
                          ([thought, action, observation] each), out ([success, reward]),
                          meta, fp (fingerprint), wf (action tokens), t (time added),
                          tenant (only when not the default tenant)
========================  ==============================================================
"""

from __future__ import annotations

from typing import Any

import msgpack

from lifemem_ray.core.model import Outcome, Step, Trajectory
from lifemem_ray.core.tenancy import DEFAULT_TENANT, id_key


def pack(obj: Any) -> bytes:
    """A plain value (meta entries, log entries, maintenance flags) as msgpack."""
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


# -- trajectory records -----------------------------------------------------------------------
def encode_trajectory(traj: Trajectory, tokens: list[str], added: float) -> bytes:
    """The record of ``traj``: byte for byte what the writers before tenants wrote for the
    default tenant; another tenant's record ends with its ``tenant``."""
    fields = {
        "id": traj.id,
        "env": traj.env,
        "task": traj.task,
        "io": traj.initial_observation,
        "steps": [[s.thought, s.action, s.observation] for s in traj.steps],
        "out": [traj.outcome.success, traj.outcome.reward],
        "meta": dict(traj.metadata),
        "fp": traj.fingerprint,
        "wf": tokens,
        "t": added,
    }
    if traj.tenant != DEFAULT_TENANT:
        fields["tenant"] = traj.tenant
    return pack(fields)


class StoredFields:
    """A trajectory record's fields by name, without building the Trajectory (retrieval
    renders thousands of them a second). ``steps``: [thought, action, observation] lists."""

    __slots__ = (
        "added",
        "env",
        "fingerprint",
        "id",
        "initial_observation",
        "metadata",
        "reward",
        "steps",
        "success",
        "task",
        "tenant",
        "tokens",
    )

    def __init__(self, d: dict[str, Any]) -> None:
        self.id: str = d["id"]
        self.env: str = d["env"]
        self.task: str = d["task"]
        self.initial_observation: str = d["io"]
        self.steps: list[list[str]] = d["steps"]
        self.success: bool | None = d["out"][0]
        self.reward: float | None = d["out"][1]
        self.metadata: dict[str, Any] = d["meta"]
        self.fingerprint: str = d["fp"]
        self.tokens: list[str] = d["wf"]
        self.added: float = d["t"]
        self.tenant: str = d.get("tenant", DEFAULT_TENANT)


def record_fields(data: bytes) -> StoredFields:
    """A stored trajectory record's fields (see :class:`StoredFields`)."""
    return StoredFields(unpack(data))


def record_fingerprint(data: bytes) -> str:
    return unpack(data)["fp"]


def record_id(data: bytes) -> str:
    """The record's id key (tenant-qualified for a tenant other than the default: what the id index holds)."""
    d = unpack(data)
    return id_key(d.get("tenant", DEFAULT_TENANT), d["id"])


def fields_to_trajectory(f: StoredFields) -> Trajectory:
    """The trajectory of :func:`record_fields`' output, trusted (validated when stored)."""
    return Trajectory.trusted(
        env=f.env,
        task=f.task,
        steps=tuple(Step.trusted(a, t, o) for t, a, o in f.steps),
        outcome=Outcome(success=f.success, reward=f.reward),
        id=f.id,
        initial_observation=f.initial_observation,
        metadata=f.metadata,
        fingerprint=f.fingerprint,
        tenant=f.tenant,
    )


def decode_trajectory(data: bytes, *, trusted: bool = False) -> tuple[Trajectory, dict[str, Any]]:
    """A stored record as (trajectory, {fingerprint, tokens, added}); ``trusted`` skips
    re-validating what was validated when it was stored (checks and exports validate)."""
    f = record_fields(data)
    if trusted:
        traj = fields_to_trajectory(f)
    else:
        traj = Trajectory(
            env=f.env,
            task=f.task,
            steps=tuple(Step(thought=t, action=a, observation=o) for t, a, o in f.steps),
            outcome=Outcome(success=f.success, reward=f.reward),
            id=f.id,
            initial_observation=f.initial_observation,
            metadata=f.metadata,
            tenant=f.tenant,
        )
    return traj, {"fingerprint": f.fingerprint, "tokens": f.tokens, "added": f.added}
