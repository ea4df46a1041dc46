"""Adapters that plug the memory into RL rollout stacks (verl's agent loops, SkyRL's text
environments): each connects to a running deployment and uses the episode-memory rules of
:mod:`lifemem_ray.episodes.episode_memory` (recall before, submit after, failures degrade)."""
