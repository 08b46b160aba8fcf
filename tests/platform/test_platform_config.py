"""ServeConfig: defaults, YAML round trip, and errors that name the field and the allowed range."""

import pytest

from msaserve.engine.config import EngineConfig
from msaserve.platform.config import ConfigError, ServeConfig


def test_defaults_serve_smollm2_on_cpu_loopback() -> None:
    config = ServeConfig()
    assert config.model.spec == "smollm2"
    assert config.model.device == "cpu"
    assert config.http.host == "127.0.0.1"
    assert config.http.cors_origins == []
    assert config.model.resolved_name() == "msaserve/smollm2"


def test_yaml_round_trip(tmp_path) -> None:
    config = ServeConfig.from_dict({"model": {"spec": "tiny"}, "engine": {"max_num_seqs": 4}})
    path = tmp_path / "serve.yaml"
    path.write_text(config.to_yaml())
    assert ServeConfig.from_yaml(path) == config


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"engine": {"max_num_seqs": 0}}, "engine.max_num_seqs: Input should be greater than or equal to 1"),
        ({"http": {"port": 70000}}, "http.port: Input should be less than or equal to 65535"),
        ({"router": {"policy": "random"}}, "router.policy: Input should be 'round_robin', 'pow2'"),
        ({"model": {"device": "tpu"}}, "model.device: Input should be 'cpu' or 'cuda'"),
        ({"http": {"prot": 1}}, "http.prot: Extra inputs are not permitted"),
        ({"engine": {"num_pages": 64, "kv_cache_memory_bytes": 1 << 30}}, "not both"),
        ({"engine": {"sparse_residency_sessions": 2, "tensor_parallel_size": 2}},
         "sparse_residency_sessions=2 is invalid with 2 ranks per replica"),
        ({"engine": {"sparse_residency_budget": 0}},
         "engine.sparse_residency_budget: Input should be greater than 0"),
        (
            {"preprocess": {"min_pixels": 10_000, "max_pixels": 5_000}},
            "preprocess.min_pixels=10000 must be ≤",
        ),
        ({"kvcache": {"disk_bytes": 100}}, "kvcache.disk_bytes > 0 needs kvcache.disk_path"),
        (
            {"deployments": {"model": {"autoscaling": {"min_replicas": 3, "max_replicas": 2}}}},
            "min_replicas=3 must be ≤ max_replicas=2",
        ),
    ],
)
def test_errors_name_field_and_range(data: dict, expected: str) -> None:
    with pytest.raises(ConfigError, match="invalid ServeConfig") as info:
        ServeConfig.from_dict(data)
    assert expected in str(info.value)


def test_yaml_error_names_the_file(tmp_path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("engine:\n  max_waiting: -1\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: invalid ServeConfig: engine\.max_waiting"):
        ServeConfig.from_yaml(path)


def test_a_yaml_alias_bomb_is_quoted_in_a_bounded_message(tmp_path) -> None:
    """Eight levels of anchors, nine aliases each: the last stands for 9.6 million strings; the error quoted
    every level whole (87 MB from `msaserve deploy-config`)."""
    lines = ['a: &a ["lol", "lol"]']
    for prev, name in zip("abcdefg", "bcdefgh", strict=True):
        lines.append(f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]")
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=r"bomb\.yaml: invalid ServeConfig: a: Extra inputs") as info:
        ServeConfig.from_yaml(path)
    assert len(str(info.value)) < 4000 and "h: Extra inputs are not permitted" in str(info.value)


def test_autoscaling_replaces_num_replicas() -> None:
    config = ServeConfig.from_dict(
        {
            "deployments": {
                "model": {"num_replicas": None, "autoscaling": {"min_replicas": 1, "max_replicas": 4}}
            }
        }
    )
    options = config.deployments.model.to_serve_options()
    assert "num_replicas" not in options
    assert options["autoscaling_config"]["max_replicas"] == 4


def test_api_keys_from_env_and_file(tmp_path, monkeypatch) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text("# comment\nkey-file\n")
    monkeypatch.setenv("MSASERVE_TEST_KEYS", "key-env1, key-env2")
    auth = ServeConfig.from_dict(
        {
            "auth": {
                "api_keys": ["key-list"],
                "api_keys_env": "MSASERVE_TEST_KEYS",
                "api_keys_file": str(keys_file),
            }
        }
    ).auth
    assert auth.resolve_keys() == ["key-list", "key-env1", "key-env2", "key-file"]


def test_engine_config_follows_serve_config() -> None:
    from msaserve.platform.model_deployment import engine_config_from

    config = ServeConfig.from_dict(
        {"model": {"spec": "tiny"}, "engine": {"max_num_seqs": 3, "kv_cache_memory_bytes": 1 << 24}}
    )
    engine = engine_config_from(config)
    assert (engine.model, engine.device, engine.dtype) == ("tiny", "cpu", "float32")
    assert engine.max_num_seqs == 3 and engine.cpu_kv_cache_bytes == 1 << 24
    gpu = engine_config_from(ServeConfig.from_dict({"model": {"device": "cuda"}}))
    assert gpu.dtype == "bfloat16"


def test_router_policy_selects_the_request_router() -> None:
    from msaserve.platform.app import ROUTER_CLASS, router_config

    assert ServeConfig().router.policy == "kv_aware"  # the default, through msaserve.router
    pow2 = router_config(ServeConfig.from_dict({"router": {"policy": "pow2"}}).router)
    assert pow2.request_router_class == ROUTER_CLASS  # the same code path for every policy
    kv_aware = router_config(
        ServeConfig.from_dict({"router": {"policy": "kv_aware", "stats_period_s": 2}}).router
    )
    assert kv_aware.request_router_class == ROUTER_CLASS
    assert kv_aware.request_routing_stats_period_s == 2.0


def test_app_builder_takes_serve_config_args_as_ray_serve_calls_it() -> None:
    from ray.serve import Application
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    from msaserve.platform.app import app_builder

    app = call_user_app_builder_with_args_if_necessary(app_builder, {"model": {"spec": "tiny"}})
    assert isinstance(app, Application)
    with pytest.raises(ConfigError, match=r"engine\.max_num_seqs"):
        call_user_app_builder_with_args_if_necessary(app_builder, {"engine": {"max_num_seqs": 0}})


def test_config_reference_is_current() -> None:
    """docs/configuration.md is generated from ServeConfig; regenerate it after changing a config
    section with `msaserve deploy-config --write-config-reference docs/configuration.md`."""
    from pathlib import Path

    from msaserve.platform.config_reference import render_reference

    reference = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
    assert reference.read_text() == render_reference()


def test_each_default_has_one_value() -> None:
    """The engine, KV cache service and preprocess defaults are the user-facing sections' defaults
    (one value, one place): a default ServeConfig builds exactly the parts' default configs."""
    from msaserve.kvcache.config import ServiceConfig
    from msaserve.platform.model_deployment import engine_config_from
    from msaserve.preprocess.config import PreprocessConfig

    config = ServeConfig()
    engine = engine_config_from(config)
    defaults = EngineConfig(model=engine.model, dtype=engine.dtype)
    assert engine == defaults
    assert ServiceConfig.from_settings(config.kvcache) == ServiceConfig()
    assert PreprocessConfig(**config.preprocess.model_dump()) == PreprocessConfig()


def test_every_named_spec_is_one_the_loader_knows() -> None:
    """The platform's list of named models is the loader's: a preset added to one but not the
    other would be served under a path-derived name or never found."""
    from msaserve.models.presets import preset_names
    from msaserve.platform.app import TEXT_ONLY_PRESETS, preprocess_app
    from msaserve.platform.config import NAMED_SPECS

    assert set(NAMED_SPECS) == {"smollm2", *preset_names()}
    config = ServeConfig.from_dict({"model": {"spec": "m3-mini", "device": "cuda"}})
    assert config.model.resolved_name() == "msaserve/m3-mini"
    assert "m3-mini" in TEXT_ONLY_PRESETS and preprocess_app(config) is None


def test_an_unreadable_or_malformed_file_is_a_config_error_naming_it(tmp_path) -> None:
    """Both were tracebacks from `msaserve serve --config` (a YAMLError, a FileNotFoundError)."""
    missing = tmp_path / "missing.yaml"
    with pytest.raises(ConfigError, match=r"missing\.yaml: cannot read the config file: No such file"):
        ServeConfig.from_yaml(missing)
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match=r"broken\.yaml: not valid YAML: (?s:.*)line 2, column 1"):
        ServeConfig.from_yaml(broken)
