"""The multi-node definitions in cluster_configs/ load and validate."""

from __future__ import annotations

from pathlib import Path

import yaml

from lifemem_ray import __version__

CONFIGS = Path(__file__).resolve().parents[2] / "cluster_configs"
WHEEL = f"lifemem_ray-{__version__}-py3-none-any.whl"  # what `python -m build --wheel` names it


def test_cluster_configs_install_the_released_package_never_a_checkout():
    """Nodes install the wheel or the package by version (this version), as a user does: an
    editable checkout or a git URL installs whatever the checkout holds, and the wheel is what
    tests/docs_and_packaging/test_wheel.py proves."""
    aws = yaml.safe_load((CONFIGS / "aws.yaml").read_text())
    for section in ("setup_commands", "worker_setup_commands"):
        installs = [c for c in aws[section] if "pip install" in c and "lifemem" in c]
        assert len(installs) == 1, f"{section}: one install of lifemem-ray, found {installs}"
        target = installs[0].split()[-1]
        if target.endswith(".whl"):
            folder, name = target.rsplit("/", 1)
            assert name == WHEEL, f"{section} installs {target}, not this version's wheel {WHEEL}"
            assert folder in aws["file_mounts"], (
                f"{section}: the wheel's folder {folder} reaches the node by file_mounts"
            )
        else:
            wanted = f"lifemem-ray=={__version__}"
            assert target.strip("\"'") == wanted, f"{section} installs {target}, not {wanted}"
    kuberay = yaml.safe_load((CONFIGS / "kuberay-raycluster.yaml").read_text())
    groups = [kuberay["spec"]["headGroupSpec"], *kuberay["spec"]["workerGroupSpecs"]]
    images = {c["image"] for g in groups for c in g["template"]["spec"]["containers"]}
    assert images and all(i.split(":")[1].split("-")[0] == __version__ for i in images), images
    assert f"pip install lifemem-ray=={__version__}" in (CONFIGS / "kuberay-raycluster.yaml").read_text()
    for name in ("aws.yaml", "kuberay-raycluster.yaml"):
        text = (CONFIGS / name).read_text()
        assert "git+" not in text and "--editable" not in text and " -e " not in text, f"{name} installs a checkout"
