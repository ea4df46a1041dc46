"""Which packages the wheel holds, found from the two trees rather than listed by hand: every
package under ``lifemem_ray/`` (what runs without Ray), and every package under ``actors/``
(the Ray layer), installed as ``lifemem_ray.actors``. Everything else is in pyproject.toml."""

from setuptools import find_packages, setup

RAY_LAYER = "lifemem_ray.actors"

setup(
    packages=[
        *find_packages(include=["lifemem_ray", "lifemem_ray.*"]),
        RAY_LAYER,
        *(f"{RAY_LAYER}.{name}" for name in find_packages("actors")),
    ],
    package_dir={RAY_LAYER: "actors"},
)
