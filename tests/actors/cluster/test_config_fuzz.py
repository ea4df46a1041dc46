"""Generated out-of-range values of every bounded deployment setting are refused, naming the
setting (the records and batches: tests/engine/test_fuzz.py)."""

from __future__ import annotations

import random

import pytest
from test_fuzz import BOUNDS, SEED

from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.core.errors import ConfigError


def test_generated_out_of_range_config_values_are_refused_naming_the_setting():
    rng = random.Random(SEED)
    keys = sorted(BOUNDS)
    for _ in range(200):
        key = rng.choice(keys)
        low, high = BOUNDS[key]
        section, name = key.split(".")
        kind = type(getattr(getattr(DeploymentConfig(), section), name))
        bad = rng.choice(
            [high * 10 + 1, low - 1, -1e30, 1e30]
            + ([float("nan"), float("inf"), -float("inf")] if kind is float else [])
        )
        bad = int(bad) if kind is int and abs(bad) < 1e18 else bad
        if low <= bad <= high:
            continue
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            DeploymentConfig().replace({key: bad})
