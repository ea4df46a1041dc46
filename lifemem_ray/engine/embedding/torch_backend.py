"""The reference backend: all-MiniLM-L6-v2 in torch, loaded offline from its PyPI package.

Mean pooling over the last hidden state, masked by attention, then L2
normalisation: the same recipe sentence-transformers applies for this model, so
the vectors match it (tested). Nothing is ever fetched from a model hub.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from lifemem_ray.core.errors import EmbeddingError
from lifemem_ray.engine.embedding.base import MODEL_NAME, checked_texts, default_model_path
from lifemem_ray.engine.memory_config import EmbeddingConfig

__all__ = ["MiniLMEmbedder"]


class MiniLMEmbedder:
    """Batched, thread-safe text encoder; CPU or CUDA."""

    def __init__(self, config: EmbeddingConfig | None = None) -> None:
        self.config = config or EmbeddingConfig()
        self.config.checked()
        path = Path(self.config.model_path) if self.config.model_path else default_model_path()
        if not path.is_dir():
            raise EmbeddingError(f"{path} is not a folder", where="embedding.model_path")
        # Offline for good: a missing file must fail here, never trigger a download.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        import torch
        from transformers import AutoModel, AutoTokenizer

        self._torch = torch
        if self.config.threads:
            torch.set_num_threads(self.config.threads)
        device = self.config.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        elif device == "cuda" and not torch.cuda.is_available():
            raise EmbeddingError("embedding.device = 'cuda' but torch sees no CUDA device")
        self.device = device
        try:
            self._tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            self._model = AutoModel.from_pretrained(str(path), local_files_only=True).to(device).eval()
        except (OSError, ValueError) as exc:
            raise EmbeddingError(f"cannot load the embedding model from {path}: {exc}") from exc
        if device == "cuda":
            self._model = self._model.half()
        self.dim = int(self._model.config.hidden_size)
        self.name = f"{MODEL_NAME}@{self.config.max_tokens}"
        self._lock = threading.Lock()

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Unit vectors (n, dim) float32; texts longer than ``max_tokens`` are cut."""
        texts = checked_texts(texts)
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        if not texts:
            return out
        # Sorting by length keeps padding small inside each batch.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        bs = self.config.batch_size
        torch = self._torch
        with self._lock, torch.inference_mode():
            for start in range(0, len(order), bs):
                idx = order[start : start + bs]
                batch = self._tokenizer(
                    [texts[i] for i in idx],
                    padding=True,
                    truncation=True,
                    max_length=self.config.max_tokens,
                    return_tensors="pt",
                ).to(self.device)
                hidden = self._model(**batch).last_hidden_state.float()
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
                pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
                out[idx] = pooled.cpu().numpy()
        return out

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Model tokens per text (before the ``max_tokens`` cut)."""
        return [len(ids) for ids in self._tokenizer(list(texts), add_special_tokens=True)["input_ids"]]
