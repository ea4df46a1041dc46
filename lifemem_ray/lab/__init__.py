"""Experiments: environments, agents, episodes, the lifelong protocol, datasets and synthetic data."""
