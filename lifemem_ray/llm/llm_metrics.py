"""What the LLM layer records: calls, tokens, fallbacks and refused texts, per operation.

Declared as :class:`~lifemem_ray.core.metrics.MetricSpec` and recorded through the
:class:`~lifemem_ray.core.metrics.Recorder` the client was given (a null sink unless a Ray
deployment injects its own).

>>> LLMMetrics().count_call("summarise")
Traceback (most recent call last):
...
lifemem_ray.core.errors.MetricTagError: metric lifemem_llm_calls_total: tag operation='summarise' is not one of act, assign, describe, distil, partition, split
"""

from __future__ import annotations

from lifemem_ray.core.metrics import MetricSpec, MetricsSink, Recorder, Tag
from lifemem_ray.llm.prompts import MEMORY_OPERATIONS, OPERATIONS

__all__ = ["LLM_CALLS", "LLM_FALLBACKS", "LLM_REFUSALS", "LLM_TOKENS", "SPECS", "LLMMetrics"]

TOKEN_KINDS = ("completion", "prompt")

LLM_CALLS = MetricSpec(
    "lifemem_llm_calls_total",
    "counter",
    "LLM calls (one prompt each, however many attempts) by operation",
    (Tag("operation", OPERATIONS),),
)
LLM_TOKENS = MetricSpec(
    "lifemem_llm_tokens_total",
    "counter",
    "LLM tokens by operation and kind (prompt, completion; estimated as characters / 4 where the server "
    "reports no usage)",
    (Tag("operation", OPERATIONS), Tag("kind", TOKEN_KINDS)),
)
LLM_FALLBACKS = MetricSpec(
    "lifemem_llm_fallbacks_total",
    "counter",
    "Decisions the offline policy made because the LLM's answer failed or was refused: items for "
    "assign, one per call for partition, split, describe and distil",
    (Tag("operation", MEMORY_OPERATIONS),),
)
LLM_REFUSALS = MetricSpec(
    "lifemem_llm_refusals_total",
    "counter",
    "Generated texts (cluster descriptions, skills) refused by the provenance rule: a token that is not "
    "plain prose and occurs in none of the trajectories the text was generated from, or an instruction "
    "aimed at the operator (the offline text stands in)",
    (Tag("operation", MEMORY_OPERATIONS),),
)
SPECS = (LLM_CALLS, LLM_TOKENS, LLM_FALLBACKS, LLM_REFUSALS)


class LLMMetrics:
    """The LLM layer's records, through ``sink`` (none: dropped)."""

    def __init__(self, sink: MetricsSink | None = None) -> None:
        self.recorder = Recorder(sink)

    def count_call(self, operation: str) -> None:
        """One logical LLM call of ``operation`` (a prompt; retries are the same call)."""
        self.recorder.record(LLM_CALLS, 1, operation)

    def count_tokens(self, operation: str, prompt: int, completion: int) -> None:
        """Tokens of one LLM answer (as ``LLMClient.usage`` counts them)."""
        self.recorder.record(LLM_TOKENS, prompt, operation, "prompt")
        self.recorder.record(LLM_TOKENS, completion, operation, "completion")

    def count_fallbacks(self, operation: str, n: int = 1) -> None:
        """``n`` decisions of ``operation`` the offline policy made in place of a failed or refused answer."""
        self.recorder.record(LLM_FALLBACKS, n, operation)

    def count_refusals(self, operation: str, n: int = 1) -> None:
        """``n`` generated texts of ``operation`` refused by the provenance rule (:mod:`lifemem_ray.llm.provenance`)."""
        self.recorder.record(LLM_REFUSALS, n, operation)
