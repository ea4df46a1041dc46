"""Embedding backends on the CPU, measured before one is chosen (issue 26, item 1c).

Every variant encodes the same task texts (the ``task`` field of the released trainset,
``../shared/data/lifemem-trainset/*.jsonl``, unique texts taken round-robin over its files;
generated task texts when that folder is absent) at batch 1 (one text per call) and batch 32
(64 texts per call, ``batch_size`` 32: length-sorted model calls of at most 32 texts), and is
compared with torch fp32, the reference, in the same run:

* torch fp32: :class:`~lifemem_ray.engine.embedding.torch_backend.MiniLMEmbedder`, and the same
  called with the ONNX backend's model calls (at most 512 padded tokens each), to tell the
  runtime's gain from the batching's;
* ONNX Runtime fp32, the backend (:class:`~lifemem_ray.engine.embedding.onnx_backend.OnnxMiniLMEmbedder`):
  dynamo export fused by onnxscript's ``ort_fusions``, at most 512 padded tokens a model call;
* the same without that cap (whole batches of 32 a call);
* the unfused export at each ONNX Runtime graph optimisation level;
* the export fused by ``onnxruntime.transformers.optimizer`` instead;
* dynamic int8 (per-channel weights) of the fused graph;
* OpenVINO fp32 and at its default precision (bf16 where the CPU has AMX), when installed.

Figures: texts/s (each 64-text chunk's best time of ``--repeats`` interleaved passes, the
machine being shared), the ratio to torch, the minimum and mean cosine to torch's vectors, and
the share of the machine's fp32 peak reached. That share is an estimate twice over: useful FLOPs per text are counted from the
model's shape and each text's tokens (2 x matrix weights per token plus attention's two
token-by-token products; padding and the embedding lookup not counted), and the peak is cores x
clock x vector lanes x 2 (FMA) x an assumed 2 FMA units per core, read from /proc/cpuinfo.
A variant qualifies with a minimum cosine of at least 0.99; the issue's targets are 2x torch at
batch 1 and 1.4x at batch 32.

Prints JSON on stdout and a readable table on stderr. No timing is asserted here.

Usage: python benchmarks/embedding_backends.py [--texts 512] [--repeats 3] [--threads 0] [--no-openvino]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from lifemem_ray.engine.embedding import MiniLMEmbedder, default_model_path
from lifemem_ray.engine.embedding.onnx_backend import (
    TOKENS_PER_CALL,
    OnnxMiniLMEmbedder,
    export_model,
    fused_for_ort,
    load_tokenizer,
    mean_pooled_unit,
    model_calls,
    padded_inputs,
)
from lifemem_ray.engine.memory_config import EmbeddingConfig

SHARED = Path(os.environ.get("LIFEMEM_SHARED_DIR", Path(__file__).resolve().parents[2] / "shared"))
TRAINSET = SHARED / "data" / "lifemem-trainset"
MIN_COSINE = 0.99
TARGETS = {"batch_1": 2.0, "batch_32": 1.4}
BATCHES = (1, 32)
ASSUMED_FMA_UNITS = 2
TORCH = "torch fp32 (reference)"
BACKEND = "onnx fp32 fused (the backend)"
SHIPPED = (TORCH, BACKEND)  # what embedding.backend can be: the variants "auto" chooses between


def task_texts(count: int, trainset: Path) -> tuple[list[str], str]:
    """Up to ``count`` unique task texts, round-robin over the trainset's files (its order kept)."""
    files = sorted(trainset.glob("*.jsonl"))
    if not files:
        print(f"{trainset}: no trainset here; using {count} generated task texts instead", file=sys.stderr)
        from lifemem_ray.lab.synthetic import generate

        return [t.task for t in generate(count, seed=5)], "generated (lifemem_ray.lab.synthetic)"
    per_file: list[list[str]] = []
    seen: set[str] = set()
    for path in files:
        tasks = []
        for line in path.read_text(encoding="utf-8").splitlines():
            task = json.loads(line).get("task")
            if isinstance(task, str) and task not in seen:
                seen.add(task)
                tasks.append(task)
        per_file.append(tasks)
    texts = [tasks[i] for i in range(max(map(len, per_file))) for tasks in per_file if i < len(tasks)]
    return texts[:count], f"{trainset} (task field, unique, round-robin over {len(files)} files)"


def machine_peak() -> dict[str, Any]:
    """The fp32 peak of the CPUs this process may use, from /proc/cpuinfo (an estimate)."""
    info = Path("/proc/cpuinfo").read_text()
    flags: set[str] = set()
    mhz = 0.0
    for line in info.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags" and not flags:
            flags = set(value.split())
        elif key.strip() == "cpu MHz":
            mhz = max(mhz, float(value))
    cores = len(os.sched_getaffinity(0))
    bits = 512 if "avx512f" in flags else 256 if "avx2" in flags else 128
    fma = "fma" in flags or "avx512f" in flags
    per_cycle = (bits // 32) * (2 if fma else 1) * ASSUMED_FMA_UNITS
    return {
        "cores": cores,
        "mhz": mhz,
        "vector_bits": bits,
        "fma": fma,
        "fma_units_assumed": ASSUMED_FMA_UNITS,
        "peak_gflops_estimate": round(cores * mhz / 1000 * per_cycle, 1),
    }


def useful_flops(tokens: Sequence[int]) -> float:
    """FLOPs the model's matrix products need for texts of these token counts (no padding)."""
    config = json.loads((default_model_path() / "config.json").read_text())
    d, ff, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    weights = layers * (4 * d * d + 2 * d * ff)
    return float(sum(2 * weights * n + 4 * layers * d * n * n for n in tokens))


class OpenVinoEmbedder:
    """The same tokenizing and pooling as the ONNX backend, the graph compiled by OpenVINO."""

    def __init__(self, model_bytes: bytes, config: EmbeddingConfig, precision: str | None) -> None:
        import openvino

        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "model.onnx"
            path.write_bytes(model_bytes)
            properties: dict[str, Any] = {"NUM_STREAMS": "1"}
            if precision:
                properties["INFERENCE_PRECISION_HINT"] = precision
            if config.threads:
                properties["INFERENCE_NUM_THREADS"] = config.threads
            core = openvino.Core()
            self._compiled = core.compile_model(core.read_model(str(path)), "CPU", properties)
        self._inputs = {port.get_any_name() for port in self._compiled.inputs}
        self._tokenizer = load_tokenizer(default_model_path(), config.max_tokens)
        self.batch_size = config.batch_size

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        out = np.empty((len(texts), 384), dtype=np.float32)
        token_ids = [encoding.ids for encoding in self._tokenizer.encode_batch(list(texts))]
        lengths = np.array([len(ids) for ids in token_ids])
        for idx in model_calls(lengths, self.batch_size, TOKENS_PER_CALL):
            feeds = padded_inputs([token_ids[i] for i in idx])
            hidden = self._compiled({k: v for k, v in feeds.items() if k in self._inputs})[0]
            out[idx] = mean_pooled_unit(np.asarray(hidden), feeds["attention_mask"])
        return out


class TokenCappedTorch:
    """The torch reference called the ONNX backend's way (calls of at most 512 padded tokens):
    how much of the backend's gain is the batching and how much the runtime."""

    def __init__(self, config: EmbeddingConfig) -> None:
        self._torch = MiniLMEmbedder(config)
        self._max_rows = config.batch_size
        self._max_tokens = config.max_tokens

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        out = np.empty((len(texts), 384), dtype=np.float32)
        lengths = np.minimum(self._torch.count_tokens(texts), self._max_tokens)
        for idx in model_calls(lengths, self._max_rows, TOKENS_PER_CALL):
            out[idx] = self._torch.embed([texts[i] for i in idx])
        return out


def ort_optimizer_fused(plain: bytes) -> bytes:
    from onnxruntime.transformers import optimizer

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plain.onnx"
        path.write_bytes(plain)
        model = optimizer.optimize_model(str(path), model_type="bert", num_heads=12, hidden_size=384, opt_level=0)
        return bytes(model.model.SerializeToString())


def int8_dynamic(fused: bytes) -> bytes:
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "int8.onnx"
        quantize_dynamic(onnx.load_from_string(fused), path, per_channel=True, weight_type=QuantType.QInt8)
        return path.read_bytes()


def variants(args: argparse.Namespace) -> dict[str, Callable[[EmbeddingConfig], Any]]:
    """Name -> a function making that variant's embedder for a config; exports made once here."""
    model_dir = default_model_path()
    t = time.perf_counter()
    plain = export_model(model_dir)
    fused = fused_for_ort(plain)
    print(f"exported and fused in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    found: dict[str, Callable[[EmbeddingConfig], Any]] = {
        TORCH: MiniLMEmbedder,
        "torch fp32, 512-token calls": TokenCappedTorch,
        BACKEND: OnnxMiniLMEmbedder,
        "onnx fp32 fused, no token cap": lambda c: OnnxMiniLMEmbedder(c, tokens_per_call=1 << 30),
    }
    for level in ("disable", "basic", "extended", "all"):
        found[f"onnx fp32 unfused, level {level}"] = partial(OnnxMiniLMEmbedder, model_bytes=plain, graph_level=level)
    optimized = ort_optimizer_fused(plain)
    found["onnx fp32 ort-transformers fused"] = lambda c: OnnxMiniLMEmbedder(c, model_bytes=optimized)
    quantized = int8_dynamic(fused)
    found["onnx int8 dynamic (per-channel)"] = lambda c: OnnxMiniLMEmbedder(c, model_bytes=quantized)
    if args.openvino:
        try:
            import openvino  # noqa: F401
        except ImportError:
            print("openvino is not installed: its variants are skipped", file=sys.stderr)
        else:
            found["openvino fp32"] = lambda c: OpenVinoEmbedder(plain, c, "f32")
            found["openvino default precision"] = lambda c: OpenVinoEmbedder(plain, c, None)
    return found


def timed(embedder: Any, texts: list[str], batch: int) -> tuple[float, np.ndarray]:
    """Seconds and vectors: one call per text at batch 1, one call for all ``texts`` otherwise
    (the embedder's ``batch_size`` then sets the model calls)."""
    start = time.perf_counter()
    if batch == 1:
        vectors = np.vstack([embedder.embed([text]) for text in texts])
    else:
        vectors = embedder.embed(texts)
    return time.perf_counter() - start, vectors


def measure(args: argparse.Namespace, texts: list[str]) -> dict[str, dict[str, Any]]:
    """Texts/s and cosines to torch of each variant. The texts go in chunks of 64; every pass
    runs each chunk through every variant (their order rotating) and each chunk's best time of
    the passes counts, so a burst of load from other work hits all variants alike."""
    config = EmbeddingConfig(batch_size=32, device="cpu", threads=args.threads, onnx_dir=args.onnx_dir)
    embedders = {name: make(config) for name, make in variants(args).items()}
    for embedder in embedders.values():  # warm-up: first calls allocate and pick kernels
        embedder.embed(texts[:32])
        embedder.embed(texts[:1])
    chunks = [texts[i : i + 64] for i in range(0, len(texts), 64)]
    names = list(embedders)
    best: dict[tuple[str, int, int], float] = {}
    vectors: dict[tuple[str, int, int], np.ndarray] = {}
    for repeat in range(args.repeats):
        for c, chunk in enumerate(chunks):
            shift = (c + repeat) % len(names)
            for name in names[shift:] + names[:shift]:
                for batch in BATCHES:
                    seconds, vectors[name, batch, c] = timed(embedders[name], chunk, batch)
                    best[name, batch, c] = min(best.get((name, batch, c), np.inf), seconds)
        print(f"pass {repeat + 1} of {args.repeats} done", file=sys.stderr)
    reference = np.vstack([vectors[TORCH, 32, c] for c in range(len(chunks))])
    results = {}
    for name in names:
        cosines = np.concatenate(
            [(np.vstack([vectors[name, b, c] for c in range(len(chunks))]) * reference).sum(axis=1) for b in BATCHES]
        )
        per_s = {b: len(texts) / sum(best[name, b, c] for c in range(len(chunks))) for b in BATCHES}
        results[name] = {
            **{f"batch_{b}": {"texts_per_s": round(per_s[b], 1)} for b in BATCHES},
            "min_cosine": round(float(cosines.min()), 7),
            "mean_cosine": round(float(cosines.mean()), 7),
        }
    return results


def scored(results: dict[str, dict[str, Any]], flops_per_text: float, peak: dict[str, Any]) -> dict[str, Any]:
    """Ratios to torch, shares of the peak, who qualifies and meets the targets, and the choice."""
    for result in results.values():
        for b in BATCHES:
            row = result[f"batch_{b}"]
            row["ratio_to_torch"] = round(row["texts_per_s"] / results[TORCH][f"batch_{b}"]["texts_per_s"], 2)
            gflops = row["texts_per_s"] * flops_per_text / 1e9
            row["share_of_peak"] = round(gflops / peak["peak_gflops_estimate"], 3)
        result["qualifies"] = result["min_cosine"] >= MIN_COSINE
        result["meets_targets"] = result["qualifies"] and all(
            result[key]["ratio_to_torch"] >= target for key, target in TARGETS.items()
        )

    def rank(name: str) -> tuple[bool, float]:  # both targets met first, then the geometric mean of the ratios
        r = results[name]
        return r["meets_targets"], (r["batch_1"]["ratio_to_torch"] * r["batch_32"]["ratio_to_torch"]) ** 0.5

    qualified = [n for n in results if results[n]["qualifies"]]
    return {
        "fastest_qualifying": max(qualified, key=rank, default=None),
        "auto_choice": max([n for n in qualified if n in SHIPPED], key=rank, default=None),
    }


def print_table(report: dict[str, Any]) -> None:
    peak, texts = report["machine"], report["texts"]
    print(
        f"\n{texts['count']} texts, {texts['mean_tokens']} tokens mean; estimated fp32 peak "
        f"{peak['peak_gflops_estimate']} GFLOP/s ({peak['cores']} cores, {peak['mhz']:.0f} MHz, "
        f"{peak['vector_bits']}-bit FMA x {ASSUMED_FMA_UNITS} assumed)",
        file=sys.stderr,
    )
    print(
        f"{'variant':<36}{'b1 /s':>9}{'x torch':>9}{'peak':>7}{'b32 /s':>9}{'x torch':>9}{'peak':>7}"
        f"{'min cos':>11}{'mean cos':>11}",
        file=sys.stderr,
    )
    for name, r in report["variants"].items():
        cells = "".join(
            f"{r[k]['texts_per_s']:>9}{r[k]['ratio_to_torch']:>9}{r[k]['share_of_peak']:>7.1%}"
            for k in ("batch_1", "batch_32")
        )
        mark = " *" if r["meets_targets"] else "" if r["qualifies"] else " (cos < 0.99)"
        print(f"{name:<36}{cells}{r['min_cosine']:>11.7f}{r['mean_cosine']:>11.7f}{mark}", file=sys.stderr)
    print(
        "* meets both targets. peak: share of the fp32 peak (int8 and bf16 kernels can pass it).\n"
        f"fastest qualifying: {report['fastest_qualifying']}; auto's choice: {report['auto_choice']}",
        file=sys.stderr,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads; 0: each runtime's default")
    parser.add_argument("--onnx-dir", default="", help="where the backend keeps its export (default: its own)")
    parser.add_argument("--trainset", type=Path, default=TRAINSET)
    parser.add_argument("--no-openvino", dest="openvino", action="store_false")
    args = parser.parse_args()

    texts, source = task_texts(args.texts, args.trainset)
    max_tokens = EmbeddingConfig().max_tokens
    uncut = load_tokenizer(default_model_path(), None).encode_batch(texts)
    tokens = [min(len(e.ids), max_tokens) for e in uncut]
    flops_per_text = useful_flops(tokens) / len(texts)
    peak = machine_peak()
    results = measure(args, texts)
    report = {
        "texts": {"count": len(texts), "source": source, "mean_tokens": round(float(np.mean(tokens)), 1)},
        "machine": peak,
        "useful_gflop_per_text_estimate": round(flops_per_text / 1e9, 4),
        "targets": {**TARGETS, "min_cosine": MIN_COSINE},
        "repeats": args.repeats,
        **scored(results, flops_per_text, peak),
        "variants": results,
    }
    print(json.dumps(report, indent=2))
    print_table(report)


if __name__ == "__main__":
    main()
