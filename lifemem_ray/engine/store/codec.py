"""The store's formats, in one place: how a trajectory's brief, its vectors and a cluster record
are laid out in bytes (a trajectory's record itself is :mod:`lifemem_ray.core.records`, which
every layer shares; its names are available here too, for the store's readers).

Everything else reads named fields: :class:`StoredFields` (a trajectory record),
:class:`Brief` (what maintenance reads of a member without decoding its record),
:class:`~lifemem_ray.engine.clustering.clusters.ClusterRecord`. The layouts are those every store since
schema 1 holds; an encoder here writes exactly the bytes the earlier writers did, and a
decoder accepts records written before a field existed (``nsu`` of a cluster record).

========================  ==============================================================
record                    msgpack layout
========================  ==============================================================
trajectory record         see :mod:`lifemem_ray.core.records`
brief                     array: [action tokens, success, scope, task head, id key]
vectors                   raw: u32 scope code (big-endian) + f32 text vector + f16 workflow vector
cluster record            map: id, n, ts / ws (f64 sums as bytes), envs, flows, ok, ko,
                          d, db, dn (description, by, count), s, sb, sn (skill, by, count),
                          v, born, parent, c, u (created, updated), split_into, nsu
========================  ==============================================================
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import numpy as np

from lifemem_ray.core.records import (
    StoredFields,
    decode_trajectory,
    encode_trajectory,
    fields_to_trajectory,
    pack,
    record_fields,
    record_fingerprint,
    record_id,
    unpack,
)
from lifemem_ray.engine.clustering.clusters import ClusterRecord

__all__ = [
    "Brief",
    "StoredFields",
    "decode_brief",
    "decode_cluster",
    "decode_trajectory",
    "decode_vectors",
    "encode_brief",
    "encode_cluster",
    "encode_trajectory",
    "encode_vectors",
    "fields_to_trajectory",
    "pack",
    "pack_u64",
    "record_fields",
    "record_fingerprint",
    "record_id",
    "unpack",
    "unpack_u64",
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
    return pack(
        {
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
        }
    )


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
