"""Configuration: the paper's defaults, and every source named in its errors."""

from __future__ import annotations

import pytest

from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.core.errors import ConfigError
from lifemem_ray.engine.memory_config import MemoryConfig

BOUNDS = DeploymentConfig.bounds()


def test_defaults_are_the_papers():
    c = DeploymentConfig()
    assert c.evolution.init_size == 5
    assert c.evolution.top_k == 4
    assert c.evolution.split_min_size == 50
    assert c.evolution.split_mrl_threshold == 0.95
    assert c.llm.temperature == 0.3
    assert c.llm.backend == "offline"
    assert c.embedding.max_tokens == 256


def test_sources_in_order(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[evolution]\ntop_k = 8\nsplit_min_size = 30\n[llm]\nmodel = "m1"\n')
    env = {"LIFEMEM_EVOLUTION_TOP_K": "6", "LIFEMEM_LLM_BASE_URL": "http://127.0.0.1:9/v1", "OTHER": "x"}
    c = DeploymentConfig.load(path, environ=env, overrides={"evolution.top_k": "5"})
    assert c.evolution.top_k == 5  # override > env > file
    assert c.evolution.split_min_size == 30  # file
    assert c.llm.base_url == "http://127.0.0.1:9/v1"  # env
    assert c.llm.model == "m1"
    # A run file may keep memory settings under [memory.*] beside its own tables.
    run = tmp_path / "run.toml"
    run.write_text('[experiment]\nname = "x"\n[memory.retrieval]\nk = 2\n')
    assert DeploymentConfig.load(run, environ={}).retrieval.k == 2


@pytest.mark.parametrize(
    "text, message",
    [
        ("[evolution]\ntop_k = 'four'\n", r"c.toml: evolution.top_k: expected an integer"),
        ("[evolution]\nsplit_mrl_threshold = 1.5\n", r"evolution.split_mrl_threshold: must be within"),
        ("[evolutoin]\ntop_k = 4\n", r"unknown section \[evolutoin\]"),
        ("[evolution]\ntopk = 4\n", r"unknown setting 'evolution.topk'"),
        ("[llm]\nbackend = 'gpt'\n", r"llm.backend: must be one of offline, openai"),
        ("[evolution\n", r"not valid TOML"),
    ],
)
def test_file_errors_name_file_and_key(tmp_path, text, message):
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        DeploymentConfig.load(path, environ={})


def test_env_and_override_errors_name_their_source():
    with pytest.raises(ConfigError, match=r"LIFEMEM_EVOLUTION_TOP_K: evolution\.top_k: expected an integer"):
        DeploymentConfig.load(environ={"LIFEMEM_EVOLUTION_TOP_K": "x"})
    with pytest.raises(ConfigError, match=r"evolution\.background_maintenance: expected true or false"):
        DeploymentConfig.load(environ={}, overrides={"evolution.background_maintenance": "maybe"})
    with pytest.raises(ConfigError, match="unknown setting 'nope'"):
        DeploymentConfig().replace({"nope": 1})
    with pytest.raises(ConfigError, match="config file not found"):
        DeploymentConfig.load("/nonexistent/c.toml", environ={})


def test_replace_copies_and_hides_the_key():
    base = DeploymentConfig()
    other = base.replace({"llm.api_key": "secret", "retrieval.k": 2})
    assert base.retrieval.k == 4 and other.retrieval.k == 2
    assert other.to_dict()["llm"]["api_key"] == "***"


def test_every_number_in_the_config_has_a_hard_bound():
    import dataclasses

    config = DeploymentConfig()
    numbers = [
        f"{s.name}.{f.name}"
        for s in dataclasses.fields(config)
        for f in dataclasses.fields(getattr(config, s.name))
        if type(getattr(getattr(config, s.name), f.name)) in (int, float)
    ]
    assert sorted(numbers) == sorted(BOUNDS)
    for dotted, (low, high) in BOUNDS.items():
        section, key = dotted.split(".")
        kind = type(getattr(getattr(config, section), key))
        assert low <= getattr(getattr(config, section), key) <= high, dotted  # the defaults are inside
        linked = (
            {"cluster.search_chunk": 65_536, "cluster.retrieve_chunk": 65_536} if "chunk" in dotted else {}
        )  # one a multiple of the other
        if dotted in ("http.add_timeout_s", "cluster.add_resends"):  # an add answered 202 must outlive its attempts
            linked = {"http.operations_ttl_s": BOUNDS["http.operations_ttl_s"][1]}
        if dotted == "http.max_ongoing_per_tenant":  # a tenant's share is at most every slot
            linked = {"http.max_ongoing_requests": BOUNDS["http.max_ongoing_requests"][1]}
        DeploymentConfig().replace({dotted: kind(high), **linked})  # the bounds themselves are accepted
        for bad in [high + 1] if kind is int else [high * 2 + 1, float("inf"), float("nan")]:
            with pytest.raises(ConfigError, match=dotted.replace(".", r"\.")):
                DeploymentConfig().replace({dotted: bad})


def test_a_tenants_share_cannot_exceed_the_replicas_slots():
    with pytest.raises(
        ConfigError, match=r"http\.max_ongoing_per_tenant: 33 is above http\.max_ongoing_requests \(32\)"
    ):
        DeploymentConfig().replace({"http.max_ongoing_per_tenant": 33})
    assert DeploymentConfig().replace({"http.max_ongoing_per_tenant": 32}).http.max_ongoing_per_tenant == 32


def test_range_and_encoding_errors_name_the_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[llm]\ntimeout_s = inf\n")
    with pytest.raises(ConfigError, match=f"{path}: llm.timeout_s: must be within"):
        DeploymentConfig.load(path)
    path.write_text("[retrieval]\nk = 100000000\n")
    with pytest.raises(ConfigError, match=f"{path}: retrieval.k"):
        DeploymentConfig.load(path)
    path.write_bytes(b"[llm]\nmodel = '\xff\xfe'\n")
    with pytest.raises(ConfigError, match=f"{path}: not UTF-8"):
        DeploymentConfig.load(path)
    with pytest.raises(ConfigError, match="LIFEMEM_EMBEDDING_MAX_TOKENS"):
        DeploymentConfig.load(environ={"LIFEMEM_EMBEDDING_MAX_TOKENS": "100000"})


def test_operations_must_outlive_the_adds_they_answer():
    config = DeploymentConfig()
    assert config.add_operation_deadline_s() == 300.0 * 11 + 60.0 <= config.http.operations_ttl_s
    with pytest.raises(
        ConfigError,
        match=r"http\.operations_ttl_s: 600 s would forget an add answered 202 before it can finish \(3360 s",
    ):
        DeploymentConfig().replace({"http.operations_ttl_s": 600})
    DeploymentConfig().replace(
        {"http.operations_ttl_s": 600, "http.add_timeout_s": 30, "cluster.add_resends": 2}
    )  # 150 s: fine


def test_each_layer_owns_its_settings():
    """The engine's config holds the engine's tables and the LLM's; the Ray deployment adds
    [cluster] and [http]; a run file holding those loads into the engine's config too (its
    tables passed over), while a misspelt table is still refused."""
    from lifemem_ray.llm.llm_config import LLMConfig
    from lifemem_ray.service.http_config import HttpConfig

    assert MemoryConfig.sections() == ["evolution", "policy", "retrieval", "index", "embedding", "llm", "store"]
    assert DeploymentConfig.sections() == [*MemoryConfig.sections(), "cluster", "http"]
    assert type(MemoryConfig().llm) is LLMConfig and type(DeploymentConfig().http) is HttpConfig
    assert not any(key.startswith(("cluster.", "http.")) for key in MemoryConfig.bounds())


def test_a_shared_run_file_loads_in_every_layer(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[evolution]\ntop_k = 6\n[cluster]\nshards = 3\n[http]\nport = 9000\n[experiment]\nseeds = 2\n")
    assert MemoryConfig.load(path, environ={}).evolution.top_k == 6
    deployment = DeploymentConfig.load(path, environ={})
    assert (deployment.evolution.top_k, deployment.cluster.shards, deployment.http.port) == (6, 3, 9000)
    from lifemem_ray.lab.experiment_config import ExperimentConfig

    assert ExperimentConfig.load(path, environ={}).seeds == 2
    path.write_text("[evolutoin]\ntop_k = 6\n")
    with pytest.raises(ConfigError, match=r"unknown section \[evolutoin\]"):
        MemoryConfig.load(path, environ={})
