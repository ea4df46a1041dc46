"""FEVER in the ReAct style (:mod:`.env`) over claims constructed from the HotpotQA corpus:
the facts a claim sentence holds and how one is changed (:mod:`.facts`), the claims built and
checked against the served corpus (:mod:`.claims`)."""

from lifemem_ray.lab.envs.fever.env import FeverEnv

__all__ = ["FeverEnv"]
