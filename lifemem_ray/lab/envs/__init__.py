"""Environments for rollouts: a registry of adapters, each importing its package lazily."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from lifemem_ray.core.errors import UnknownNameError
from lifemem_ray.lab.envs.base import Environment, EnvUnavailable, StepResult, Task, TaskError

__all__ = ["ENVIRONMENTS", "EnvUnavailable", "Environment", "StepResult", "Task", "TaskError", "make_env", "register"]

# name -> "module:factory"; a factory takes keyword options and returns an Environment.
ENVIRONMENTS: dict[str, str] = {}


def register(name: str, target: str) -> None:
    """Add an adapter: ``name`` (``family-*`` for a family with variants) -> ``module:factory``."""
    ENVIRONMENTS[name] = target


def make_env(name: str, **options: Any) -> Environment:
    """An environment by name (``twx-coin``, ``alfworld``, ``sql`` ...); EnvUnavailable names what to install.

    ``adapter="<registered name>"`` in the options builds that adapter instead, with the
    other options, under the name asked for (``make_env("twx-coin-doors", adapter="twx-coin",
    includeDoors=1)``: another environment, whose tasks say ``twx-coin-doors``), or the
    fault-injecting ``faulty`` wrapper for an environment's tasks."""
    adapter = options.pop("adapter", None)
    if adapter is not None:
        env = make_env(adapter, **options)
        env.name = name  # the adapters name their tasks and check them by env.name
        return env
    key = name
    if key not in ENVIRONMENTS:
        prefix = name.split("-", 1)[0] + "-*"
        if prefix in ENVIRONMENTS:
            key = prefix
            options.setdefault("variant", name.split("-", 1)[1])
        else:
            raise UnknownNameError(f"unknown environment {name!r}; known: {', '.join(sorted(ENVIRONMENTS))}")
    module, _, factory = ENVIRONMENTS[key].partition(":")
    make: Callable[..., Environment] = getattr(importlib.import_module(module), factory)
    return make(**options)


# The adapters that ship with the package (each imports its environment package lazily).
register(
    "twx-*", "lifemem_ray.lab.envs.twx:TextWorldExpressEnv"
)  # variant: coin, cookingworld, twc, mapreader, sorting, ...
register("alfworld", "lifemem_ray.lab.envs.alfworld:AlfWorldEnv")
register("scienceworld", "lifemem_ray.lab.envs.scienceworld:ScienceWorldEnv")
register("tau2-*", "lifemem_ray.lab.envs.tau2:Tau2Env")  # variant: retail, airline
register("bfcl", "lifemem_ray.lab.envs.bfcl:BfclEnv")
register("sql", "lifemem_ray.lab.envs.sql:SqlEnv")
register("websearch", "lifemem_ray.lab.envs.websearch:WebSearchEnv")
register("miniwob", "lifemem_ray.lab.envs.miniwob:MiniWobEnv")
register("fever", "lifemem_ray.lab.envs.fever:FeverEnv")  # constructed claims over the HotpotQA corpus
register("webshop", "lifemem_ray.lab.envs.webshop:WebShopEnv")  # a generated catalogue, WebShop's actions and reward
register("mind2web", "lifemem_ray.lab.envs.mind2web:Mind2WebEnv")  # the step-level offline protocol
register("faulty", "lifemem_ray.lab.envs.faulty:FaultyEnv")  # fault injection around another environment (tests)
