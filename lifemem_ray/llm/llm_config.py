"""The LLM layer's settings: the ``[llm]`` table (who decides, and how the client talks to it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from lifemem_ray.core.errors import ConfigError
from lifemem_ray.core.settings import Section, in_range, positive

__all__ = ["LLMConfig"]


@dataclass
class LLMConfig(Section):
    """Who decides: ``offline`` (no network) or ``openai`` (any OpenAI-compatible server)."""

    NAME = "llm"
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {
        "backend": ("offline", "openai"),
        "response_format": ("json_object", "json_schema", "none"),
    }
    BOUNDS: ClassVar[dict[str, tuple[float, float]]] = {
        "temperature": (0.0, 2.0),
        "timeout_s": (0.1, 3_600.0),
        "max_retries": (0, 20),
        "concurrency": (1, 1_024),
        "items_per_call": (1, 100),
        "max_item_chars": (100, 100_000),
        "max_answer_tokens": (16, 32_768),
        "min_cluster_size": (1, 1_000_000),
        "prompt_char_budget": (1_000, 1_000_000),
        "backoff_base_s": (0.0, 60.0),
        "backoff_max_s": (0.0, 600.0),
        "retry_after_max_s": (0.0, 3_600.0),
    }

    backend: str = "offline"  # offline | openai
    base_url: str = ""  # e.g. http://127.0.0.1:8000/v1; empty: OPENAI_BASE_URL or api.openai.com
    api_key: str = ""  # empty: OPENAI_API_KEY, else a placeholder for local servers
    model: str = "gpt-5-mini"  # assignment and descriptions (paper: a light model)
    strong_model: str = ""  # splits and skills (paper: GPT-4.1); empty: same as model
    temperature: float = 0.3
    timeout_s: float = 60.0
    max_retries: int = 4
    concurrency: int = 8
    items_per_call: int = 5  # trajectories decided in one assignment call
    max_item_chars: int = 2500  # a trajectory is cut to this many characters in prompts
    max_answer_tokens: int = 512
    response_format: str = "json_object"  # json_object | json_schema | none
    skip_confident: bool = True  # let the offline policy decide unambiguous joins
    min_cluster_size: int = 3  # smaller clusters keep offline descriptions and skills (no calls)
    prompt_char_budget: int = 16000  # trajectory text in one multi-trajectory prompt (partition, split, distil)
    backoff_base_s: float = 0.5  # retries wait base * 2^attempt (jittered), at most backoff_max_s
    backoff_max_s: float = 20.0
    retry_after_max_s: float = 30.0  # a server's Retry-After is honoured up to this

    def validate(self) -> None:
        positive(
            self,
            "timeout_s",
            "concurrency",
            "items_per_call",
            "max_item_chars",
            "max_answer_tokens",
            "min_cluster_size",
        )
        if self.max_retries < 0:
            raise ConfigError("must be >= 0", where="llm.max_retries")
        in_range(self, "temperature", 0.0, 2.0)
        if self.backend == "openai" and not self.model:
            raise ConfigError("required when llm.backend = 'openai'", where="llm.model")
