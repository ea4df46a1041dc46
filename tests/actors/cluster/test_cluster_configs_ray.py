"""The cluster definitions against Ray itself: the launcher config passes Ray's own validation, the
KubeRay manifest names the Ray version the project runs (the rest:
tests/docs_and_packaging/test_cluster_configs.py)."""

from __future__ import annotations

import jsonschema
import pytest
import yaml
from support.common import ROOT

CONFIGS = ROOT / "cluster_configs"

# The parts of KubeRay's RayCluster CRD (ray.io/v1) this manifest uses. Ray ships no copy of
# the CRD, so this is written from the CRD's field list; `kubectl apply --dry-run=server`
# against a cluster with the operator checks the rest.
_CONTAINER = {
    "type": "object",
    "required": ["name", "image"],
    "properties": {
        "name": {"type": "string"},
        "image": {"type": "string", "minLength": 1},
        "resources": {
            "type": "object",
            "properties": {"requests": {"type": "object"}, "limits": {"type": "object"}},
            "additionalProperties": False,
        },
        "volumeMounts": {"type": "array", "items": {"type": "object", "required": ["name", "mountPath"]}},
        "ports": {"type": "array", "items": {"type": "object", "required": ["containerPort"]}},
        "env": {"type": "array"},
    },
}
_POD = {
    "type": "object",
    "required": ["spec"],
    "properties": {
        "spec": {
            "type": "object",
            "required": ["containers"],
            "properties": {"containers": {"type": "array", "minItems": 1, "items": _CONTAINER}},
        }
    },
}
RAYCLUSTER_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "ray.io/v1"},
        "kind": {"const": "RayCluster"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["headGroupSpec", "workerGroupSpecs"],
            "properties": {
                "rayVersion": {"type": "string"},
                "enableInTreeAutoscaling": {"type": "boolean"},
                "authOptions": {"type": "object", "properties": {"mode": {"enum": ["disabled", "token"]}}},
                "headGroupSpec": {
                    "type": "object",
                    "required": ["rayStartParams", "template"],
                    "properties": {
                        "rayStartParams": {"type": "object", "additionalProperties": {"type": "string"}},
                        "template": _POD,
                    },
                },
                "workerGroupSpecs": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": [
                            "groupName",
                            "replicas",
                            "minReplicas",
                            "maxReplicas",
                            "rayStartParams",
                            "template",
                        ],
                        "properties": {
                            "groupName": {"type": "string"},
                            "replicas": {"type": "integer", "minimum": 0},
                            "minReplicas": {"type": "integer", "minimum": 0},
                            "maxReplicas": {"type": "integer", "minimum": 0},
                            "rayStartParams": {"type": "object", "additionalProperties": {"type": "string"}},
                            "template": _POD,
                        },
                    },
                },
            },
        },
    },
}


def test_cluster_launcher_config_passes_rays_own_validation():
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = yaml.safe_load((CONFIGS / "aws.yaml").read_text())
    config = prepare_config(raw)
    validate_config(config)  # Ray's schema (ray-schema.json); raises on any error
    types = config["available_node_types"]
    assert {"head", "shard", "gpu"} <= set(types)
    assert types["shard"]["resources"].get("lifemem_shard") == 1 and types["shard"]["min_workers"] >= 2
    assert "g5" in types["gpu"]["node_config"]["InstanceType"]
    assert any("RAY_AUTH_MODE=token" in c for c in config["head_start_ray_commands"])
    assert any("faiss-gpu" in c for c in config["worker_setup_commands"])
    # And the validator does reject a broken one.
    raw["available_node_types"]["shard"]["min_workers"] = "two"
    with pytest.raises(Exception, match="integer"):
        validate_config(prepare_config(raw))


def test_kuberay_manifest_is_a_valid_raycluster():
    import ray

    manifest = yaml.safe_load((CONFIGS / "kuberay-raycluster.yaml").read_text())
    jsonschema.validate(manifest, RAYCLUSTER_SCHEMA)
    spec = manifest["spec"]
    assert spec["rayVersion"] == ray.__version__, "the manifest names the Ray version the project runs"
    assert spec["authOptions"]["mode"] == "token"
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    for group in groups.values():
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        assert "lifemem_shard" in group["rayStartParams"]["resources"]
        mounts = group["template"]["spec"]["containers"][0]["volumeMounts"]
        assert any(m["mountPath"] == "/data" for m in mounts), "shard stores live on a persistent volume"
    gpu = groups["gpu"]["template"]["spec"]["containers"][0]["resources"]
    assert gpu["limits"]["nvidia.com/gpu"] == "1"
    # A broken manifest is caught.
    manifest["spec"]["workerGroupSpecs"][0]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(manifest, RAYCLUSTER_SCHEMA)
