"""SkyRL text environments with the memory: the project's environments as ``BaseTextEnv``\\ s
(``lifemem-lab``) and a wrapper that adds the memory to any ``BaseTextEnv`` (``lifemem-memory``).

SkyRL's generator builds one environment per trajectory with
``skyrl_gym.make(env_class, env_config=cfg.environment.skyrl_gym[env_class], extras=row_extras)``,
calls ``init(prompt)``, then ``step(model_output)`` until ``done``, then ``get_metrics()`` and
``close()`` (through an executor when ``generator.max_env_workers > 0``, else on its event loop).

* :class:`LabTextEnv` runs one of :func:`lifemem_ray.lab.envs.make_env`'s environments: the
  ``env_config`` names it, the row's extras choose the task (``task_id`` or ``task_index``).
* :class:`MemoryTextEnv` wraps an inner ``BaseTextEnv`` (any registered skyrl_gym id): at ``init``
  it recalls the memory for the task and puts the fenced context into the chat; it records each
  step; when a step says ``done`` it submits the trajectory in the background (the episode never
  waits on the write); ``close`` waits (bounded) for the acknowledgement. A failure of the memory
  makes that episode run without memory and is counted in ``get_metrics()``; it never raises.

Registration is per process: :func:`register_skyrl_envs` must run in the process that calls
``skyrl_gym.make`` (SkyRL's entrypoint task, not only the driver script), as every skyrl_gym
environment must.

Example::

    import skyrl_gym
    from lifemem_ray.actors.integrations.skyrl_env import register_skyrl_envs

    register_skyrl_envs()
    env = skyrl_gym.make(
        "lifemem-memory",
        env_config={"inner": "lifemem-lab", "inner_config": {"env": "sql"}, "memory": {"namespace": "lifemem"}},
        extras={"task_id": "sql-s0-train-3", "max_turns": 8},
    )
    chat, info = env.init([{"role": "system", "content": "Solve the SQL task."}])
    out = env.step("Action: Operation\\n```sql\\nSELECT 1;\\n```")
    env.get_metrics()  # memory_recalls, memory_acknowledged, memory_recall_s ...
    env.close()
"""

from __future__ import annotations

import threading

import skyrl_gym

from lifemem_ray.actors.integrations.skyrl_env.lab_env import LAB_ENV_ID, LabTextEnv
from lifemem_ray.actors.integrations.skyrl_env.memory_env import MEMORY_ENV_ID, MemoryTextEnv
from lifemem_ray.core.errors import ConfigError

__all__ = ["LAB_ENV_ID", "MEMORY_ENV_ID", "LabTextEnv", "MemoryTextEnv", "register_skyrl_envs"]


_REGISTER_LOCK = threading.Lock()


def register_skyrl_envs() -> list[str]:
    """Register ``lifemem-lab`` (:class:`LabTextEnv`) and ``lifemem-memory``
    (:class:`MemoryTextEnv`) with skyrl_gym; the ids. Idempotent in a process.

    skyrl_gym's registry lives in each process: call this in the process that calls
    ``skyrl_gym.make``, which under SkyRL is the entrypoint task (``skyrl_entrypoint``), not
    only the driver script. An id already registered to something else is a ConfigError."""
    wanted = {LAB_ENV_ID: LabTextEnv, MEMORY_ENV_ID: MemoryTextEnv}
    with _REGISTER_LOCK:
        for env_id, cls in wanted.items():
            target = f"{__name__}:{cls.__name__}"
            spec = skyrl_gym.registry.get(env_id)
            if spec is None:
                skyrl_gym.register(id=env_id, entry_point=target)
            elif spec.entry_point not in (cls, target):
                raise ConfigError(
                    f"skyrl_gym id {env_id!r} is already registered to {spec.entry_point!r} in this process; "
                    "deregister it (skyrl_gym.envs.registration.deregister) or rename that environment"
                )
    return list(wanted)
