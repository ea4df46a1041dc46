"""Every test in this folder is marked ``ray`` (the root conftest, by folder) and may use the Ray
fixtures below; a run without Ray (``-m "not ray"``) does not collect this folder."""

from support.ray_fixtures import config, deployment, ray_local, ray_metrics_url

__all__ = ["config", "deployment", "ray_local", "ray_metrics_url"]
