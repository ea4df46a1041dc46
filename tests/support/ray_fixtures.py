"""The Ray session and deployment fixtures, offered only to the folders whose tests need Ray
(``tests/actors/conftest.py`` and ``tests/cli/conftest.py`` import them). Ray and the Ray layer are
imported inside the fixtures, so importing this module starts nothing."""

from __future__ import annotations

import os

import pytest

from support.common import SMALL_ACTORS


@pytest.fixture
def config():
    """The default deployment settings."""
    from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig

    return DeploymentConfig()


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray instance for the whole session (token authentication stays on)."""
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        from lifemem_ray.actors.cluster.ray_address import private_ray

        # A Ray of the session's own: never RAY_ADDRESS or a cluster Ray's address file names.
        private_ray(num_cpus=4, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def ray_metrics_url(ray_local) -> str:
    """The Prometheus endpoint of this session's Ray node (its metrics agent picks a free port,
    read back from ``ray.nodes()``; token authentication does not cover it)."""
    node_id = ray_local.get_runtime_context().get_node_id()
    node = next(n for n in ray_local.nodes() if n["NodeID"] == node_id)
    return f"http://127.0.0.1:{node['MetricsExportPort']}/metrics"


@pytest.fixture
def deployment(ray_local, tmp_path):
    """A factory for sharded deployments, each in its own namespace; all stopped afterwards."""
    from lifemem_ray.actors.cluster import deployment as dep
    from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig

    started: list[str] = []

    def start(shards: int = 2, store=None, **overrides):
        namespace = f"t{len(started)}-{os.getpid()}-{tmp_path.name[-12:]}"
        config = DeploymentConfig().replace(
            {"cluster.namespace": namespace, "cluster.batch_wait_ms": 5, **SMALL_ACTORS, **overrides}
        )
        info = dep.deploy(store or tmp_path / f"store-{namespace}", config, shards=shards)
        started.append(namespace)
        from lifemem_ray.actors.client.blocking import MemoryClient

        return MemoryClient(namespace, config), info

    yield start
    for namespace in started:
        dep.stop(namespace)
