"""actors.http_service.StateLog: an unhealthy deployment polled on /healthz warns once per
change (and a reminder per interval), not once per poll."""

from __future__ import annotations

import doctest
import logging

from lifemem_ray.actors.frontdoor import front_service as http_service
from lifemem_ray.actors.frontdoor.front_service import StateLog


def test_a_bad_state_warns_on_change_and_per_interval_not_per_call(caplog):
    now = [100.0]
    states = StateLog(logging.getLogger("lifemem-test-health"), repeat_s=60, clock=lambda: now[0])
    with caplog.at_level(logging.DEBUG, logger="lifemem-test-health"):
        warned = [states.bad("shard-1", "down: %s", "shard-1") for _ in range(50)]
        assert warned == [True] + [False] * 49
        assert states.bad("shard-1,shard-2", "down: %s", "shard-1,shard-2")  # another state: warned at once
        now[0] += 59.0
        assert not states.bad("shard-1,shard-2", "down")
        now[0] += 1.0
        assert states.bad("shard-1,shard-2", "down")  # the reminder
        assert states.good("recovered") and not states.good("recovered")  # one line when it ends
        assert states.bad("shard-1,shard-2", "down")  # bad again after good: warned at once
    levels = [r.levelno for r in caplog.records]
    assert levels.count(logging.WARNING) == 4 and levels.count(logging.INFO) == 1 and levels.count(logging.DEBUG) == 50


def test_http_service_docstring_examples_hold():
    assert doctest.testmod(http_service).failed == 0
