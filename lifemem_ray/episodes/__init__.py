"""The memory around someone else's episode loop: what an RL stack's adapter, or any agent
loop, needs to recall before an episode and store it after, without Ray.

* :class:`EpisodeMemory` (threads) and :class:`AsyncEpisodeMemory` (one event loop): recall,
  record, submit off the step's path with bounded backpressure; a failing memory degrades the
  episode and is counted, never raised into it.
* :class:`EpisodeOptions`: the options every adapter takes, checked in one place.
* :class:`MemoryWrapper`: a gymnasium (or lab) environment whose episodes use the memory.
* :mod:`.chat_context`: where the recalled context goes in a chat; :mod:`.episode_data`: what
  an episode's raw data becomes before it is stored.

Used by the SkyRL and verl adapters (:mod:`lifemem_ray.actors.integrations`) over a deployment's
client, and over an in-process :class:`~lifemem_ray.engine.memory.Memory` as well.
"""

from __future__ import annotations

from lifemem_ray.episodes.episode_memory import AsyncEpisodeMemory, EpisodeMemory, EpisodeRecord, MemoryCounts
from lifemem_ray.episodes.episode_options import EpisodeOptions
from lifemem_ray.episodes.memory_wrapper import MemoryWrapper

__all__ = ["AsyncEpisodeMemory", "EpisodeMemory", "EpisodeOptions", "EpisodeRecord", "MemoryCounts", "MemoryWrapper"]
