"""Shared fixtures. Heavy things (the embedding model, Ray) start once per session."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from lifemem_ray.config import MemoryConfig
from lifemem_ray.synthetic import generate, label_vectors

ROOT = Path(__file__).resolve().parents[1]


def shared_dir() -> Path:
    """The shared material beside the checkout (or where LIFEMEM_SHARED_DIR points)."""
    return Path(os.environ.get("LIFEMEM_SHARED_DIR", ROOT.parent / "shared"))


@pytest.fixture(scope="session")
def trainset_dir() -> Path:
    path = shared_dir() / "data" / "lifemem-trainset"
    if not path.is_dir():
        pytest.skip(f"shared trajectory data not found at {path}")
    return path


@pytest.fixture(scope="session")
def embedder():
    from lifemem_ray.embedding import MiniLMEmbedder

    return MiniLMEmbedder()


@pytest.fixture
def config() -> MemoryConfig:
    return MemoryConfig()


@pytest.fixture(scope="session")
def synthetic():
    """600 labelled synthetic trajectories with direct vectors (no embedding model needed)."""
    trajs = list(generate(600, seed=1, length_scale=0.2))
    vecs = label_vectors([t.metadata["workflow"] for t in trajs], list(range(len(trajs))))
    return trajs, vecs


def purity(memory) -> float:
    """Share of trajectories whose cluster's majority workflow label is their own."""
    from collections import Counter

    total = agree = 0
    for cluster in memory.clusters():
        labels = Counter(memory.get(i).metadata["workflow"] for i in memory.members(cluster.id))
        agree += labels.most_common(1)[0][1]
        total += sum(labels.values())
    return agree / total if total else 0.0


def unit(x) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)
