"""Mind2Web's offline step-level protocol (:mod:`.env`) over the released trajectories, read
and scored by :mod:`.records`."""

from lifemem_ray.lab.envs.mind2web.env import Mind2WebEnv

__all__ = ["Mind2WebEnv"]
