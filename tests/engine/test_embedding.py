"""The embedding model, offline, against sentence-transformers' own encoding."""

from __future__ import annotations

import numpy as np
import pytest

from lifemem_ray.engine.embedding import EmbeddingError, MiniLMEmbedder, default_model_path
from lifemem_ray.engine.memory_config import EmbeddingConfig

TEXTS = [
    "put a clean mug in the coffee machine",
    "i need a high speed usb flash drive that is 32 gb, and price lower than 50.00 dollars",
    "What city did the characters from Gargoyles the Movie wake up in?",
    "SELECT SUM(quantity) FROM transactions WHERE zone = 'north';",
    "a" * 3000,  # far past 256 tokens: cut, not an error
    "",
]


def test_matches_sentence_transformers(embedder):
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(str(default_model_path()), device="cpu")
    expected = model.encode(TEXTS, normalize_embeddings=True, batch_size=4)
    got = embedder.embed(TEXTS)
    assert got.shape == (len(TEXTS), 384) and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, atol=2e-5)


def test_unit_vectors_batch_independent(embedder):
    one_by_one = np.vstack([embedder.embed([t]) for t in TEXTS])
    together = embedder.embed(TEXTS)
    np.testing.assert_allclose(one_by_one, together, atol=2e-5)
    np.testing.assert_allclose(np.linalg.norm(together, axis=1), 1.0, atol=1e-5)
    assert embedder.embed([]).shape == (0, 384)
    # Truncation: 256 tokens at most.
    assert embedder.count_tokens(["word " * 400])[0] > 256
    a = embedder.embed(["word " * 400])
    b = embedder.embed(["word " * 300])
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_similarity_is_meaningful(embedder):
    v = embedder.embed(
        ["heat the apple in the microwave", "warm an apple using the microwave", "list all customers by region"]
    )
    assert v[0] @ v[1] > v[0] @ v[2] + 0.3


def test_bad_inputs(embedder, tmp_path):
    with pytest.raises(TypeError, match="not one string"):
        embedder.embed("hello")
    with pytest.raises(TypeError, match=r"texts\[1\]"):
        embedder.embed(["ok", 3])
    with pytest.raises(EmbeddingError, match="not a folder"):
        MiniLMEmbedder(EmbeddingConfig(model_path=str(tmp_path / "missing")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(EmbeddingError, match="cannot load"):
        MiniLMEmbedder(EmbeddingConfig(model_path=str(tmp_path / "empty")))
