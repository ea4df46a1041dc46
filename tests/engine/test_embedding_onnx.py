"""The ONNX Runtime backend against the torch reference: same vectors, one export reused,
partial files never used, the same input checks. One export for the whole module (~10 s)."""

from __future__ import annotations

import json
import shutil
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnxruntime")

from test_embedding import TEXTS  # the torch backend's fixed texts

from lifemem_ray.core.errors import ArgumentTypeError
from lifemem_ray.engine.embedding import EmbeddingError, default_model_path, onnx_backend
from lifemem_ray.engine.embedding.onnx_backend import OnnxMiniLMEmbedder
from lifemem_ray.engine.memory_config import EmbeddingConfig


@pytest.fixture(scope="module")
def onnx_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("onnx")


@pytest.fixture(scope="module")
def onnx_embedder(onnx_dir) -> OnnxMiniLMEmbedder:
    return OnnxMiniLMEmbedder(EmbeddingConfig(onnx_dir=str(onnx_dir), batch_size=4))


def exported_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.onnx"))


def assert_matches(got: np.ndarray, expected: np.ndarray) -> None:
    assert got.shape == expected.shape and got.dtype == np.float32
    cosines = (got * expected).sum(axis=1)
    assert cosines.min() >= 0.99
    np.testing.assert_allclose(got, expected, atol=1e-4)


def test_matches_torch_on_fixed_texts(onnx_embedder, embedder):
    assert (onnx_embedder.name, onnx_embedder.dim, onnx_embedder.device) == (embedder.name, 384, "cpu")
    assert_matches(onnx_embedder.embed(TEXTS), embedder.embed(TEXTS))
    assert onnx_embedder.count_tokens(TEXTS) == embedder.count_tokens(TEXTS)


def test_matches_torch_on_trainset_tasks(onnx_embedder, embedder, trainset_dir):
    tasks = {json.loads(line)["task"] for f in sorted(trainset_dir.glob("*.jsonl")) for line in f.open()}
    texts = sorted(tasks)[::4]  # about 250 of the ~980 distinct task texts, short and long
    assert len(texts) > 100
    assert_matches(onnx_embedder.embed(texts), embedder.embed(texts))


def test_batches_threads_and_truncation(onnx_embedder):
    one_by_one = np.vstack([onnx_embedder.embed([t]) for t in TEXTS])
    together = onnx_embedder.embed(TEXTS)
    np.testing.assert_allclose(one_by_one, together, atol=2e-5)
    np.testing.assert_allclose(np.linalg.norm(together, axis=1), 1.0, atol=1e-5)
    assert onnx_embedder.embed([]).shape == (0, 384)
    assert onnx_embedder.count_tokens(["word " * 400])[0] > 256
    np.testing.assert_allclose(onnx_embedder.embed(["word " * 400]), onnx_embedder.embed(["word " * 300]), atol=1e-6)
    results: list[np.ndarray] = []
    threads = [threading.Thread(target=lambda: results.append(onnx_embedder.embed(TEXTS))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 4 and all(np.array_equal(r, together) for r in results)


def test_second_open_reuses_the_export(onnx_embedder, onnx_dir, monkeypatch):
    (exported,) = exported_files(onnx_dir)
    mtime = exported.stat().st_mtime_ns

    def no_export(model_dir):
        raise AssertionError("exported again")

    monkeypatch.setattr(onnx_backend, "export_model", no_export)
    again = OnnxMiniLMEmbedder(EmbeddingConfig(onnx_dir=str(onnx_dir)))
    np.testing.assert_array_equal(again.embed(TEXTS), onnx_embedder.embed(TEXTS))
    assert exported_files(onnx_dir) == [exported] and exported.stat().st_mtime_ns == mtime
    assert not list(onnx_dir.glob("*.tmp"))


@pytest.mark.parametrize("damage", ["truncated", "no digest"])
def test_partial_file_is_exported_again(onnx_embedder, onnx_dir, tmp_path, monkeypatch, damage):
    (good,) = exported_files(onnx_dir)
    good_bytes = good.read_bytes()
    copy = tmp_path / good.name
    if damage == "truncated":  # a writer that died half way, and its digest file
        copy.write_bytes(good_bytes[: len(good_bytes) // 2])
        shutil.copy(good.with_name(good.name + ".sha256"), tmp_path)
    else:  # the model written, the process gone before its digest
        copy.write_bytes(good_bytes)
    exports = []

    def export_again(model_dir):  # the real export takes ~10 s; the fusion and check still run
        exports.append(model_dir)
        return good_bytes

    monkeypatch.setattr(onnx_backend, "export_model", export_again)
    embedder = OnnxMiniLMEmbedder(EmbeddingConfig(onnx_dir=str(tmp_path)))
    assert len(exports) == 1
    assert onnx_backend._verified(copy) is not None
    np.testing.assert_allclose(embedder.embed(TEXTS), onnx_embedder.embed(TEXTS), atol=1e-6)


def test_unwritable_onnx_dir(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(EmbeddingError, match=r"embedding.onnx_dir: cannot write .*writable folder"):
        OnnxMiniLMEmbedder(EmbeddingConfig(onnx_dir=str(blocker / "onnx")))


def test_export_failure_is_explained(monkeypatch):
    import torch

    def broken(*args, **kwargs):
        raise RuntimeError("unsupported operator")

    monkeypatch.setattr(torch.onnx, "export", broken)
    with pytest.raises(EmbeddingError, match=r"exporting .* failed \(RuntimeError: unsupported operator\).*backend"):
        onnx_backend.export_model(default_model_path())


def test_missing_onnxruntime(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with pytest.raises(EmbeddingError, match=r"onnxruntime package is not installed.*backend = 'torch'"):
        OnnxMiniLMEmbedder(EmbeddingConfig(onnx_dir=str(tmp_path)))


def test_bad_inputs(onnx_embedder, tmp_path):
    with pytest.raises(ArgumentTypeError, match="not one string"):
        onnx_embedder.embed("hello")
    with pytest.raises(ArgumentTypeError, match=r"texts\[1\]"):
        onnx_embedder.embed(["ok", 3])
    with pytest.raises(EmbeddingError, match="not a folder"):
        OnnxMiniLMEmbedder(EmbeddingConfig(model_path=str(tmp_path / "missing"), onnx_dir=str(tmp_path)))
    (tmp_path / "empty").mkdir()
    with pytest.raises(EmbeddingError, match="cannot load"):
        OnnxMiniLMEmbedder(EmbeddingConfig(model_path=str(tmp_path / "empty"), onnx_dir=str(tmp_path)))
    with pytest.raises(EmbeddingError, match="runs on the CPU"):
        OnnxMiniLMEmbedder(EmbeddingConfig(device="cuda", onnx_dir=str(tmp_path)))
