"""The embedding service: its cache, its dynamic batching across concurrent callers, the choice
of backend, and a deployment whose embedder actors serve a repeated text from their cache.

Fake backends count and record the model calls; nothing here depends on timings (a batch that
must gather several callers waits far longer than the test needs: it goes once full)."""

from __future__ import annotations

import threading
import zlib

import numpy as np
import pytest

from lifemem_ray.core.errors import EmbeddingError, InvalidArgumentError
from lifemem_ray.engine.embedding import (
    DynamicBatcher,
    EmbeddingCache,
    EmbeddingService,
    MiniLMEmbedder,
    choose_backend,
    open_embedder,
)
from lifemem_ray.engine.embedding import service as service_module
from lifemem_ray.engine.memory_config import EmbeddingConfig, MemoryConfig

DIM = 4
LONG_WAIT_MS = 60_000.0  # a batch that must gather callers goes when full, never on this timer


def fake_vector(text: str) -> np.ndarray:
    """A unit vector that depends only on the text."""
    rng = np.random.default_rng(zlib.crc32(text.encode()))
    v = rng.standard_normal(DIM).astype(np.float32)
    return v / np.linalg.norm(v)


class FakeBackend:
    """Records every model call's texts; raises on the calls numbered in ``fail_calls``."""

    def __init__(self, name: str = "fake-model", fail_calls: tuple[int, ...] = ()) -> None:
        self.name = name
        self.dim = DIM
        self.calls: list[list[str]] = []
        self.fail_calls = fail_calls
        self._lock = threading.Lock()

    def embed(self, texts):
        with self._lock:
            self.calls.append(list(texts))
            number = len(self.calls)
        if number in self.fail_calls:
            raise EmbeddingError(f"model call {number} failed")
        return np.vstack([fake_vector(t) for t in texts]) if texts else np.empty((0, DIM), np.float32)

    @property
    def batch_sizes(self) -> list[int]:
        return [len(c) for c in self.calls]


def run_together(callers: int, work) -> list:
    """``work(i)`` in ``callers`` threads released at once; their results (or exceptions) by i."""
    barrier = threading.Barrier(callers)
    out: list = [None] * callers

    def one(i: int) -> None:
        barrier.wait()
        try:
            out[i] = work(i)
        except Exception as exc:  # the test looks at what each caller got
            out[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    return out


# -- the cache -------------------------------------------------------------------------------------


def test_the_cache_keeps_the_most_recent_entries_and_counts_evictions():
    cache = EmbeddingCache(2)
    for text in ("a", "b"):
        cache.put("m", text, fake_vector(text))
    assert cache.get("m", "a") is not None  # "a" is now the most recent
    cache.put("m", "c", fake_vector("c"))  # evicts "b", the least recently used
    assert cache.get("m", "b") is None and len(cache) == 2
    np.testing.assert_array_equal(cache.get("m", "c"), fake_vector("c"))
    stats = cache.stats()
    assert (stats["entries"], stats["capacity"], stats["evictions"]) == (2, 2, 1)
    assert (stats["hits"], stats["misses"]) == (2, 1) and stats["hit_rate"] == pytest.approx(2 / 3)


def test_the_cache_is_keyed_by_model_name_and_holds_read_only_copies():
    cache = EmbeddingCache(10)
    vector = fake_vector("x")
    cache.put("model-a", "x", vector)
    vector[:] = 0.0  # the caller's array changing later does not reach the cache
    assert cache.get("model-b", "x") is None
    kept = cache.get("model-a", "x")
    np.testing.assert_array_equal(kept, fake_vector("x"))
    assert kept.dtype == np.float32 and not kept.flags.writeable


def test_a_cache_of_no_entries_keeps_nothing_and_a_negative_bound_is_an_error():
    cache = EmbeddingCache(0)
    cache.put("m", "a", fake_vector("a"))
    assert cache.get("m", "a") is None and len(cache) == 0
    with pytest.raises(InvalidArgumentError, match="max_entries"):
        EmbeddingCache(-1)


# -- the service: cache and deduplication --------------------------------------------------------------


def test_a_repeated_text_is_served_from_the_cache_without_a_second_model_call():
    backend = FakeBackend()
    service = EmbeddingService(backend, cache_entries=100, batch_wait_ms=0)
    first = service.embed(["put a mug in the sink", "buy a usb drive"])
    again = service.embed(["buy a usb drive"])
    assert backend.calls == [["put a mug in the sink", "buy a usb drive"]]
    np.testing.assert_array_equal(again[0], first[1])
    assert again.dtype == np.float32 and again.flags.writeable  # the caller's own array
    stats = service.stats()
    assert (stats["hits"], stats["misses"], stats["batches"], stats["texts"]) == (1, 2, 1, 3)
    assert stats["hit_rate"] == pytest.approx(1 / 3) and stats["model"] == "fake-model"
    assert (service.name, service.dim) == ("fake-model", DIM)
    service.close()


def test_the_same_text_twice_in_one_call_costs_one_model_row():
    backend = FakeBackend()
    service = EmbeddingService(backend, cache_entries=0, batch_wait_ms=0)  # without a cache too
    out = service.embed(["a", "b", "a", "a"])
    assert backend.calls == [["a", "b"]]
    np.testing.assert_array_equal(out[0], out[2])
    np.testing.assert_array_equal(out, np.vstack([fake_vector(t) for t in "abaa"]))
    assert service.embed([]).shape == (0, DIM)
    service.close()


def test_the_service_bound_evicts_the_least_recently_used_text():
    backend = FakeBackend()
    service = EmbeddingService(backend, cache_entries=2, batch_wait_ms=0)
    service.embed(["a"])
    service.embed(["b"])
    service.embed(["c"])  # "a" goes
    service.embed(["c", "b"])
    service.embed(["a"])
    assert backend.calls == [["a"], ["b"], ["c"], ["a"]]
    stats = service.stats()
    assert stats["entries"] == 2 and stats["evictions"] == 2 and stats["hits"] == 2
    service.close()


# -- dynamic batching --------------------------------------------------------------------------------


def test_concurrent_callers_share_one_model_call_and_each_gets_its_own_rows():
    backend = FakeBackend()
    callers = 4
    service = EmbeddingService(backend, cache_entries=100, batch_size=2 * callers, batch_wait_ms=LONG_WAIT_MS)
    texts = [[f"task {i} first", f"task {i} second"] for i in range(callers)]
    got = run_together(callers, lambda i: service.embed(texts[i]))
    assert backend.batch_sizes == [2 * callers]
    for i in range(callers):
        np.testing.assert_array_equal(got[i], np.vstack([fake_vector(t) for t in texts[i]]))
    stats = service.stats()
    assert stats["batches"] == 1 and stats["mean_batch_texts"] == 2 * callers
    service.close()


def test_a_text_callers_wait_for_at_once_is_computed_once():
    """A GRPO group: 8 rollouts of one prompt retrieve at the same moment (all miss the cache)."""
    backend = FakeBackend()
    callers = 8
    service = EmbeddingService(backend, cache_entries=100, batch_size=callers, batch_wait_ms=LONG_WAIT_MS)
    got = run_together(callers, lambda i: service.embed(["the group's prompt"]))
    assert backend.calls == [["the group's prompt"]]
    for row in got:
        np.testing.assert_array_equal(row, fake_vector("the group's prompt")[None, :])
    assert service.stats()["batches"] == 1 and service.stats()["mean_batch_texts"] == 1
    service.close()


def test_a_model_error_reaches_every_caller_of_its_batch_and_the_batcher_goes_on():
    backend = FakeBackend(fail_calls=(1,))
    callers = 3
    batcher = DynamicBatcher(backend.embed, DIM, batch_size=callers, wait_ms=LONG_WAIT_MS)
    got = run_together(callers, lambda i: batcher.submit([f"text {i}"]))
    assert backend.batch_sizes == [callers]
    assert all(isinstance(g, EmbeddingError) and "model call 1 failed" in str(g) for g in got), got
    # The next batch is served: the thread survived the error.
    got = run_together(callers, lambda i: batcher.submit([f"text {i}"]))
    for i in range(callers):
        np.testing.assert_array_equal(got[i], fake_vector(f"text {i}")[None, :])
    assert batcher.stats()["failed_batches"] == 1 and batcher.stats()["batches"] == 1
    batcher.close()


def test_a_request_over_the_batch_size_is_split_and_comes_back_in_order():
    backend = FakeBackend()
    sizes: list[int] = []
    batcher = DynamicBatcher(backend.embed, DIM, batch_size=4, wait_ms=0, observe_batch=sizes.append)
    texts = [f"t{i}" for i in range(10)]
    out = batcher.submit(texts)
    assert backend.batch_sizes == [4, 4, 2] and sizes == [4, 4, 2]
    assert backend.calls[0] == texts[:4]
    np.testing.assert_array_equal(out, np.vstack([fake_vector(t) for t in texts]))
    assert batcher.stats()["mean_batch_texts"] == pytest.approx(10 / 3)
    batcher.close()


def test_close_ends_the_batcher_thread_and_refuses_later_texts():
    batcher = DynamicBatcher(FakeBackend().embed, DIM, batch_size=8, wait_ms=0)
    batcher.submit(["a"])
    thread = batcher._thread
    assert thread is not None and thread.is_alive()
    batcher.close()
    assert not thread.is_alive()
    with pytest.raises(EmbeddingError, match="closed"):
        batcher.submit(["b"])


def test_a_wrong_shaped_model_answer_is_an_error_for_its_callers():
    batcher = DynamicBatcher(lambda texts: np.zeros((len(texts), DIM + 1)), DIM, batch_size=8, wait_ms=0)
    with pytest.raises(EmbeddingError, match="shape"):
        batcher.submit(["a"])
    batcher.close()


# -- choosing the backend ----------------------------------------------------------------------------


def test_open_embedder_uses_torch_when_asked_and_matches_the_reference(embedder):
    service = open_embedder(EmbeddingConfig(backend="torch"))
    try:
        assert isinstance(service.backend, MiniLMEmbedder) and service.stats()["backend"] == "torch"
        assert (service.name, service.dim) == (embedder.name, embedder.dim)
        texts = ["put a clean mug in the coffee machine", "SELECT 1;", "put a clean mug in the coffee machine"]
        np.testing.assert_allclose(service.embed(texts), embedder.embed(texts), atol=2e-5)
    finally:
        service.close()


def test_auto_picks_onnx_on_cpu_only_where_it_is_available(monkeypatch):
    monkeypatch.setattr(service_module, "_cuda_available", lambda: False)
    monkeypatch.setattr(service_module, "_onnx_available", lambda: False)
    assert choose_backend(EmbeddingConfig(backend="auto")) == "torch"
    monkeypatch.setattr(service_module, "_onnx_available", lambda: True)
    assert choose_backend(EmbeddingConfig(backend="auto")) == "onnx"
    assert choose_backend(EmbeddingConfig(backend="auto", device="cuda")) == "torch"
    monkeypatch.setattr(service_module, "_cuda_available", lambda: True)
    assert choose_backend(EmbeddingConfig(backend="auto")) == "torch"
    assert choose_backend(EmbeddingConfig(backend="auto", device="cpu")) == "onnx"
    assert choose_backend(EmbeddingConfig(backend="torch", device="cpu")) == "torch"


def test_the_engine_embeds_through_the_service_and_reports_it_in_stats(tmp_path):
    from lifemem_ray.engine.memory import Memory

    with Memory.open(tmp_path / "m", MemoryConfig().replace({"embedding.backend": "torch"})) as memory:
        assert "embedding" not in memory.stats()  # nothing embedded yet
        memory.retrieve("find a red mug", "shop")
        memory.retrieve("find a red mug", "shop")
        stats = memory.stats()["embedding"]
        assert (stats["hits"], stats["misses"], stats["batches"], stats["backend"]) == (1, 1, 1, "torch")
        assert memory.stats(tenant="default").get("embedding") is None  # not a tenant's figure


# -- routing texts to embedder replicas --------------------------------------------------------------------


# -- a deployment ------------------------------------------------------------------------------------------
