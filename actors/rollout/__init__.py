"""Rollout workers and the lifelong experiment runner on Ray."""
