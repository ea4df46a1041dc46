"""The stored formats, in one place: the only module that knows how a trajectory record, a
trajectory's brief, its vectors and a cluster record are laid out in bytes.

Everything else reads named fields: :class:`StoredFields` (a trajectory record),
:class:`Brief` (what maintenance reads of a member without decoding its record),
:class:`~lifemem_ray.engine.clustering.clusters.ClusterRecord`. The layouts are those every store since
schema 1 holds; an encoder here writes exactly the bytes the earlier writers did, and a
decoder accepts records written before a field existed (``nsu`` of a cluster record).

========================  ==============================================================
record                    msgpack layout
========================  ==============================================================
trajectory record         map: id, env, task, io (initial observation), steps
                          ([thought, action, observation] each), out ([success, reward]),
                          meta, fp (fingerprint), wf (action tokens), t (time added),
                          tenant (only when not the default tenant)
brief                     array: [action tokens, success, scope, task head, id key]
vectors                   raw: u32 scope code (big-endian) + f32 text vector + f16 workflow vector
cluster record            map: id, n, ts / ws (f64 sums as bytes), envs, flows, ok, ko,
                          d, db, dn (description, by, count), s, sb, sn (skill, by, count),
                          v, born, parent, c, u (created, updated), split_into, nsu
========================  ==============================================================
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

import msgpack
import numpy as np

from lifemem_ray.engine.clustering.clusters import ClusterRecord
from lifemem_ray.core.model import Outcome, Step, Trajectory
from lifemem_ray.core.tenancy import DEFAULT_TENANT, id_key

__all__ = [
    "Brief", "StoredFields", "decode_brief", "decode_cluster", "decode_trajectory", "decode_vectors", "encode_brief", "encode_cluster",
    "encode_trajectory", "encode_vectors", "fields_to_trajectory", "pack", "pack_u64", "record_fields", "record_fingerprint",
    "record_id", "unpack", "unpack_u64",
]

_U64 = struct.Struct(">Q")
_U32 = struct.Struct(">I")


def pack_u64(value: int) -> bytes:
    return _U64.pack(value)


def unpack_u64(data: bytes) -> int:
    return _U64.unpack(data)[0]


def pack_u32(value: int) -> bytes:
    return _U32.pack(value)


def unpack_u32(data: bytes) -> int:
    return _U32.unpack(data)[0]


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

    __slots__ = ("id", "env", "task", "initial_observation", "steps", "success", "reward", "metadata", "fingerprint", "tokens", "added",
                 "tenant")

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


# -- briefs -------------------------------------------------------------------------------
class Brief(NamedTuple):
    """What maintenance reads of a member without decoding its record."""

    tokens: list[str]
    success: bool | None
    env: str
    task: str  # the task text's head (first 300 characters)
    id: str


def encode_brief(brief: Brief) -> bytes:
    return pack(list(brief))


def decode_brief(data: bytes) -> Brief:
    return Brief(*unpack(data))


# -- vectors ------------------------------------------------------------------------------
def encode_vectors(env_code: int, vector: np.ndarray, workflow_vector: np.ndarray) -> bytes:
    return (
        _U32.pack(env_code)
        + np.ascontiguousarray(vector, dtype=np.float32).tobytes()
        + np.ascontiguousarray(workflow_vector, dtype=np.float16).tobytes()
    )


def decode_vectors(data: bytes, dim: int, workflow_dim: int) -> tuple[int, np.ndarray, np.ndarray]:
    """(env code, text vector (read-only view), workflow vector (float32 copy))."""
    code = _U32.unpack_from(data, 0)[0]
    vec = np.frombuffer(data, dtype=np.float32, count=dim, offset=4)
    wvec = np.frombuffer(data, dtype=np.float16, count=workflow_dim, offset=4 + 4 * dim).astype(np.float32)
    return code, vec, wvec


# -- cluster records ----------------------------------------------------------------------
def encode_cluster(r: ClusterRecord) -> bytes:
    return pack({
        "id": r.id,
        "n": r.count,
        "ts": r.tsum.astype(np.float64).tobytes(),
        "ws": r.wsum.astype(np.float64).tobytes(),
        "envs": r.envs,
        "flows": r.flows,
        "ok": r.successes,
        "ko": r.failures,
        "d": r.description,
        "db": r.description_by,
        "dn": r.description_n,
        "s": r.skill,
        "sb": r.skill_by,
        "sn": r.skill_n,
        "v": r.version,
        "born": r.born,
        "parent": r.parent,
        "c": r.created,
        "u": r.updated,
        "split_into": r.split_into,
        "nsu": r.no_split_until,
    })


def decode_cluster(data: bytes) -> ClusterRecord:
    d = unpack(data)
    return ClusterRecord(
        id=d["id"],
        count=d["n"],
        tsum=np.frombuffer(d["ts"], dtype=np.float64).copy(),
        wsum=np.frombuffer(d["ws"], dtype=np.float64).copy(),
        envs=dict(d["envs"]),
        flows=dict(d["flows"]),
        successes=d["ok"],
        failures=d["ko"],
        description=d["d"],
        description_by=d["db"],
        description_n=d["dn"],
        skill=d["s"],
        skill_by=d["sb"],
        skill_n=d["sn"],
        version=d["v"],
        born=d["born"],
        parent=d["parent"],
        created=d["c"],
        updated=d["u"],
        split_into=d["split_into"],
        no_split_until=d.get("nsu", 0),  # absent in records written before refused splits were remembered
    )
