"""A verl agent loop with a shared lifelong memory: recall before the generation, submit the
finished trajectory after it, inside one ``run()``.

verl (PyPI ``verl``, checked with 0.9.1) runs each rollout row through an agent loop, an
``AgentLoopBase`` subclass that its ``AgentLoopWorker`` Ray actors instantiate once per row.
:class:`MemoryAgentLoop` is verl's ``SingleTurnAgentLoop`` (the same tokenization, the same
``server_manager.generate`` call, the same output) with the memory around it:

1. the task (the last user message's text, or the row field ``task_field`` names) is recalled
   from a running lifemem-ray deployment through :class:`AsyncMemoryClient` (awaited: one
   row's memory call never stalls the other rows of the worker);
2. the fenced memory context (skills and earlier runs as data, never as instructions) goes
   into the system message (``context_in: system``, the default; merged into the row's own
   system message when it has one) or before the first user message's text (``context_in: user``);
3. the reward is verl's ``default_compute_score`` when the row has ``reward_model.ground_truth``
   (``reward_score`` is set, so verl's reward workers do not score the row again); otherwise
   ``reward_score`` stays None for verl's reward workers and the stored outcome is unknown;
4. the episode (task, the original prompt as the first observation, the decoded response as
   its one action, success = reward > 0) is submitted in the background: the row returns
   without waiting for the acknowledgement.

A memory that fails (no deployment in the namespace, a killed actor, a timeout) degrades that
row to "no memory"; it is counted and logged and never raises into the rollout (the rules of
:mod:`lifemem_ray.episodes.episode_memory`). What the row hands over is made valid by the episode
data rule (:mod:`lifemem_ray.episodes.episode_data`: a NaN reward, a NUL, a lone surrogate, a 50 MB
response or task) and counted; a row that cannot be stored is counted with its reason. Each
output carries ``extra_fields["lifemem"]``: the row's recall (hits, context characters,
seconds, failed), what the rule changed in its trajectory (``made_valid``: kind -> values) or
why it was not stored (``not_stored``), and the worker's running counts (``MemoryCounts``,
with ``made_valid`` and ``not_stored`` by kind and reason, plus ``unscored`` and
``unrecorded``); verl puts it in the batch's ``non_tensor_batch["lifemem"]``.

This module imports verl: import it only where verl is installed (the rest of lifemem-ray
never imports it). Registering: verl's ``@register`` registry is per process, so the name
``lifemem_memory`` registered here exists only in processes that imported this module. The
route that reaches every ``AgentLoopWorker`` actor is verl's agent-loop YAML, which also
carries this loop's options (every key but ``name`` and ``_target_`` is a constructor
argument)::

    # agent_loops.yaml
    - name: lifemem_memory
      _target_: lifemem_ray.actors.integrations.verl_loop.MemoryAgentLoop
      memory_namespace: lifemem   # the Ray namespace of `lifemem-ray serve`
      memory_address: null        # only used when the worker has no Ray connection yet
      memory_config: null         # the deployment's TOML config (client timeouts, features)
      k: 4                        # trajectories recalled per row
      env: gsm8k                  # the memory's environment name (default: the row's data_source)
      context_in: system          # system | user
      task_field: null            # e.g. extra_info.question (default: the last user message)
      tenant: default
      as_of: null                 # a memory version ("v1:...") the recalls are pinned to

and, in the trainer's overrides::

    actor_rollout_ref.rollout.agent.agent_loop_config_path=/path/to/agent_loops.yaml
    actor_rollout_ref.rollout.agent.default_agent_loop=lifemem_memory   # or a per-row agent_name column

``actor_rollout_ref.model.external_lib=lifemem_ray.actors.integrations.verl_loop`` also makes
every worker import this module (and so register the name), with the defaults above.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from dataclasses import dataclass
from typing import Any, ClassVar
from uuid import uuid4

from verl.experimental.agent_loop import agent_loop as verl_agent_loop
from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, register
from verl.utils.profiler import simple_timer
from verl.utils.reward_score import default_compute_score
from verl.utils.rollout_trace import rollout_trace_op

from lifemem_ray.actors.client.awaiting import AsyncMemoryClient
from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.actors.integrations.adapter_options import EPISODE_OPTIONS, MemoryAdapterOptions
from lifemem_ray.core.errors import InvalidArgumentError
from lifemem_ray.core.tenancy import DEFAULT_TENANT
from lifemem_ray.core.validation import validated
from lifemem_ray.episodes.chat_context import CONTEXT_PLACES, last_message, message_text, with_context
from lifemem_ray.episodes.episode_data import StorableEpisode, storable_reward
from lifemem_ray.episodes.episode_memory import AsyncEpisodeMemory, EpisodeRecord
from lifemem_ray.lab.agent_prompts import DEFAULT_MEMORY_TOKENS

__all__ = ["AGENT_NAME", "MemoryAgentLoop", "MemoryLoopOptions"]

log = logging.getLogger(__name__)

AGENT_NAME = "lifemem_memory"  # the name rows (agent_name) and default_agent_loop use


# The loop's options that are the adapters' memory options (MemoryAdapterOptions, under verl's names).
ADAPTER_FIELDS = ("memory_namespace", "memory_address", "memory_config", "reconnect_after_s", *EPISODE_OPTIONS)


@dataclass(frozen=True)
class MemoryLoopOptions:
    """What the agent-loop YAML can set (besides ``name`` and ``_target_``); one worker shares
    one memory connection per distinct value of :meth:`memory_key`."""

    memory_namespace: str = "lifemem"
    memory_address: str | None = None
    memory_config: str | None = None
    k: int = 4
    env: str | None = None
    context_in: str = "system"
    task_field: str | None = None
    tenant: str = DEFAULT_TENANT
    token_budget: int = DEFAULT_MEMORY_TOKENS
    same_env: bool = True
    ack_timeout_s: float = 120.0
    max_pending: int = 256
    compute_reward: bool = True
    reconnect_after_s: float = 30.0
    as_of: str | None = None  # recalls pinned to this memory version (recorded in each stored trajectory)

    def __post_init__(self) -> None:
        if self.context_in not in CONTEXT_PLACES:
            raise InvalidArgumentError(
                f"verl agent loop {AGENT_NAME}: context_in must be one of {CONTEXT_PLACES}, got {self.context_in!r}"
            )
        given = {name: getattr(self, name) for name in ADAPTER_FIELDS}
        validated(MemoryAdapterOptions, given, where=f"verl agent loop {AGENT_NAME}")

    def memory_key(self) -> tuple[Any, ...]:
        """The options that make a distinct memory connection."""
        return (
            self.memory_namespace,
            self.memory_address,
            self.memory_config,
            self.k,
            self.tenant,
            self.token_budget,
            self.same_env,
            self.ack_timeout_s,
            self.max_pending,
            self.as_of,
        )


@dataclass
class _WorkerMemory:
    """One memory connection of a worker process, on one event loop, shared by its rows."""

    client: AsyncMemoryClient
    episodes: AsyncEpisodeMemory
    unscored: int = 0  # rows with a ground truth that default_compute_score could not score

    def counts(self) -> dict[str, Any]:
        """The episode memory's counts, ``unscored``, and ``unrecorded``: finished rows that did
        not become a trajectory (the sum of ``not_stored``)."""
        counts = self.episodes.counts.as_dict()
        return {**counts, "unscored": self.unscored, "unrecorded": sum(counts["not_stored"].values())}


class MemoryAgentLoop(AgentLoopBase):
    """verl's single-turn agent loop with recall before and submit after (module docstring).

    verl builds one instance per row; the memory connection lives in the class, one per event
    loop and set of memory options, made on the first row that needs it."""

    _shared: ClassVar[weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[Any, ...], _WorkerMemory]]] = (
        weakref.WeakKeyDictionary()
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        option_names = MemoryLoopOptions.__dataclass_fields__.keys()
        options = {name: kwargs.pop(name) for name in list(kwargs) if name in option_names}
        super().__init__(*args, **kwargs)
        self.options = MemoryLoopOptions(**options)
        self.prompt_length = self.rollout_config.prompt_length
        self.response_length = self.rollout_config.response_length

    # -- the shared memory of this worker ---------------------------------------------------
    def worker_memory(self) -> _WorkerMemory:
        """This event loop's connection for these options (made now if it is the first)."""
        per_loop = self._shared.setdefault(asyncio.get_running_loop(), {})
        key = self.options.memory_key()
        if key not in per_loop:
            o = self.options
            config = DeploymentConfig.load(o.memory_config)
            client = AsyncMemoryClient(
                o.memory_namespace, config, address=o.memory_address, reconnect_after_s=o.reconnect_after_s
            )
            episodes = AsyncEpisodeMemory(
                client,
                k=o.k,
                token_budget=o.token_budget,
                tenant=o.tenant,
                ack_timeout_s=o.ack_timeout_s,
                max_pending=o.max_pending,
                same_env=o.same_env,
                as_of=o.as_of,
            )
            per_loop[key] = _WorkerMemory(client, episodes)
        return per_loop[key]

    @classmethod
    async def settle_all(cls, timeout_s: float | None = None) -> list[dict[str, Any]]:
        """Await every submission of this event loop's connections (at most ``timeout_s``
        each); their counts. For a process about to close its event loop (``asyncio.run``
        cancels unfinished submissions); verl's worker actors keep theirs running."""
        out = []
        for memory in cls._shared.get(asyncio.get_running_loop(), {}).values():
            await memory.episodes.settle(timeout_s)
            out.append(memory.counts())
        return out

    # -- one row ------------------------------------------------------------------------------
    @rollout_trace_op
    async def run(self, sampling_params: dict[str, Any], priority: int = 0, **kwargs: Any) -> AgentLoopOutput:
        """One row: recall, generate as ``SingleTurnAgentLoop``, score, submit in the background."""
        started = time.monotonic()
        messages = [dict(m) for m in kwargs["raw_prompt"]]
        task = self.task_of(messages, kwargs)
        env = self.env_of(kwargs)
        memory = self.worker_memory()
        context, found = ("", None)
        pinned = memory.episodes.as_of  # the version this row's recall reads
        if task:
            context, found = await memory.episodes.recall(task, env)
        recall_s = time.monotonic() - started
        output = await self.generate(
            with_context(messages, context, self.options.context_in), sampling_params, priority
        )
        tokenizer: Any = self.tokenizer  # verl annotates it as AutoTokenizer, a factory without decode
        response = tokenizer.decode(output.response_ids, skip_special_tokens=True)
        output.reward_score = self.reward_of(memory, response, kwargs)
        submit_started = time.monotonic()
        stored: StorableEpisode | None = None
        if task:
            read = memory.episodes.episode_metadata(pinned, found)
            stored = await self.submit(memory, task, env, messages, response, output.reward_score, kwargs, read)
        output.extra_fields["lifemem"] = {
            "task_chars": len(task),
            "hits": len(found.trajectories) if found is not None else 0,
            "context_chars": len(context),
            "recall_failed": bool(task) and found is None,
            "made_valid": dict(stored.made_valid) if stored is not None else {},
            "not_stored": stored.not_stored if stored is not None else "",
            "recall_s": recall_s,
            "submit_s": time.monotonic() - submit_started,
            "episode_s": time.monotonic() - started,
            "counts": memory.counts(),
        }
        return output

    def task_of(self, messages: list[dict[str, Any]], row: dict[str, Any]) -> str:
        """The text the memory is asked about: the row field ``task_field`` names (dotted:
        ``extra_info.question``), else the last user message's text; "" when there is none."""
        if self.options.task_field:
            value: Any = row
            for part in self.options.task_field.split("."):
                value = value.get(part) if isinstance(value, dict) else None
            return str(value).strip() if value is not None else ""
        return message_text(last_message(messages, "user")).strip()

    def env_of(self, row: dict[str, Any]) -> str:
        """The memory's environment name: the configured one, else the row's data_source."""
        return self.options.env or str(row.get("data_source") or "verl").strip() or "verl"

    async def generate(
        self, messages: list[dict[str, Any]], sampling_params: dict[str, Any], priority: int
    ) -> AgentLoopOutput:
        """verl 0.9.1's ``SingleTurnAgentLoop.run`` from the messages on (kept in step with it)."""
        priority = int(priority)  # may arrive as np.int64 from non_tensor_batch
        multi_modal_data = await self.process_multi_modal_info(messages)
        # Typed Any: verl's own annotations (list[Image] = None) do not admit the None it passes.
        images: Any = multi_modal_data.get("images")
        videos: Any = multi_modal_data.get("videos")
        audios: Any = multi_modal_data.get("audios")
        mm_processor_kwargs = self._get_mm_processor_kwargs(audios)
        self._assert_mm_supported(bool(multi_modal_data))
        mm_inputs: dict[str, Any] = {}
        prompt_ids = await self.ct_build_initial_tokens(
            messages, images=images, videos=videos, audios=audios, mm_inputs_out=mm_inputs
        )
        mm_processor_output = self.build_sglang_video_payload(videos, mm_inputs)
        metrics: Any = {}  # verl's simple_timer fills a dict; AgentLoopOutput validates it into its metrics model
        with simple_timer("generate_sequences", metrics):
            deterministic = getattr(self.rollout_config, "full_determinism", False)
            output = await self.server_manager.generate(
                request_id=f"det-{priority}" if deterministic else uuid4().hex,
                prompt_ids=prompt_ids,
                sampling_params=sampling_params,
                image_data=images,
                audio_data=audios,
                video_data=videos,
                mm_processor_output=mm_processor_output,
                mm_processor_kwargs=mm_processor_kwargs,
                priority=priority,
            )
        if metrics.get("num_preempted") is None:
            metrics["num_preempted"] = output.num_preempted if output.num_preempted is not None else -1
        merged, response_mask, response_logprobs = await self.ct_merge_assistant_token(
            prompt_ids,
            output.token_ids,
            [],
            [] if output.log_probs else None,
            assistant_logprobs=output.log_probs if output.log_probs else None,
        )
        response_ids = merged.token_ids[-len(response_mask) :] if response_mask else []
        prompt_ids = merged.token_ids[: len(merged.token_ids) - len(response_mask)]
        limit = self.response_length
        result = AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=response_ids[:limit],
            response_mask=response_mask[:limit],
            response_logprobs=response_logprobs[:limit] if response_logprobs else None,
            routed_experts=(
                output.routed_experts[: len(prompt_ids) + limit] if output.routed_experts is not None else None
            ),
            multi_modal_data=multi_modal_data,
            mm_processor_kwargs=mm_processor_kwargs,
            mm_processor_output=mm_processor_output,
            num_turns=2,
            metrics=metrics,
            extra_fields=output.extra_fields,
        )
        result.extra_fields.update({"turn_scores": [], "tool_rewards": []})  # the schema of verl's tool loop
        return result

    def reward_of(self, memory: _WorkerMemory, response: str, row: dict[str, Any]) -> float | None:
        """``default_compute_score`` of the response when the row has a ground truth (and
        ``compute_reward`` is on); None otherwise, and when verl has no scorer for the row's
        data_source or its score is not a number (counted as ``unscored``): verl's reward
        workers then score it. A score that is NaN or infinite is verl's, as it is; the memory
        stores no reward for it (``made_valid["reward"]``)."""
        ground_truth = (row.get("reward_model") or {}).get("ground_truth")
        if not self.options.compute_reward or ground_truth is None:
            return None
        try:
            score = default_compute_score(
                str(row.get("data_source") or ""), response, ground_truth, row.get("extra_info")
            )
        except NotImplementedError as exc:
            memory.unscored += 1
            log.debug("lifemem verl loop: no default scorer (%s); the reward is left to verl", exc)
            return None
        try:
            return float(score["score"] if isinstance(score, dict) else score)
        except (KeyError, TypeError, ValueError, OverflowError) as exc:  # a score that is not a number
            memory.unscored += 1
            log.warning("lifemem verl loop: the score %r is not a number (%s); the reward is left to verl", score, exc)
            return None

    async def submit(
        self,
        memory: _WorkerMemory,
        task: str,
        env: str,
        messages: list[dict[str, Any]],
        response: str,
        reward: float | None,
        row: dict[str, Any],
        read: dict[str, Any],
    ) -> StorableEpisode:
        """The row as a one-step trajectory, made valid by the episode data rule and handed to
        the memory in the background (or counted with the reason it is not stored); ``read``:
        what its recall read (:meth:`AsyncEpisodeMemory.episode_metadata`). Never raises.

        Returns:
            What the rule made of the row (its trajectory None when it is not stored).
        """
        record = EpisodeRecord(env, task, render_messages(messages))
        record.step(response, "")
        metadata = {"source": "verl", "agent_loop": AGENT_NAME, "data_source": str(row.get("data_source") or "")}
        metadata.update(read)  # the memory version the row's recall read, when pinned
        number, _ = storable_reward(reward)  # NaN, inf: no reward, so no success either
        success = None if number is None else number > 0
        result = memory.episodes.storable(record, success, reward, metadata=metadata)
        if result.trajectory is not None:
            await memory.episodes.submit(result.trajectory)
        return result


def render_messages(messages: list[dict[str, Any]]) -> str:
    """The conversation as the stored first observation: one ``role: text`` block each."""
    return "\n\n".join(f"{m.get('role', 'user')}: {message_text(m)}" for m in messages)


def _register_unless_configured() -> None:
    """``@register(AGENT_NAME)``, unless this process already has the name from an agent-loop
    YAML: verl's worker loads the YAML (with this loop's options) first and imports this module
    on the first row, and a plain ``@register`` would then replace the configured entry with a
    bare one, so every later row of the worker would run with the default options."""
    registry = getattr(verl_agent_loop, "_agent_loop_registry", None)
    if registry is None or AGENT_NAME not in registry:
        register(AGENT_NAME)(MemoryAgentLoop)


_register_unless_configured()
