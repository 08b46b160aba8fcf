"""serveConfigV2: the chart and `msaserve deploy-config` render the same document from a ServeConfig.

The chart embeds `.Values.serve` as the application's args; here the rendered serveConfigV2 is parsed
back into `ServeConfig`, compared with `render_serve_config_v2`, and the values schema's `serve` part
is checked against ServeConfig's own JSON schema.
"""

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from helm_chart import CHART, VALUES_FILES, load_values

from msaserve.platform.cli import main
from msaserve.platform.config import ConfigError, ServeConfig
from msaserve.platform.serve_config_v2 import (
    IMPORT_PATH,
    cluster_problems,
    render_serve_config_v2,
    serve_values_schema,
)


def _serve_config_v2(docs: list[dict[str, Any]]) -> dict[str, Any]:
    [rayservice] = [d for d in docs if d["kind"] == "RayService"]
    return yaml.safe_load(rayservice["spec"]["serveConfigV2"])


def _chart_default_serve() -> dict[str, Any]:
    return yaml.safe_load((CHART / "values.yaml").read_text())["serve"]


def _merged_serve(values_name: str) -> dict[str, Any]:
    """The chart's default `serve:` with the values file's on top (Helm merges maps key by key)."""

    def merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
        out = dict(base)
        for key, value in top.items():
            out[key] = (
                merge(base[key], value)
                if isinstance(value, dict) and isinstance(base.get(key), dict)
                else value
            )
        return out

    return merge(_chart_default_serve(), load_values(values_name).get("serve", {}))


@pytest.mark.parametrize("values_name", list(VALUES_FILES))
def test_rendered_serve_config_parses_into_serve_config(rendered, values_name: str) -> None:
    document = _serve_config_v2(rendered[values_name])
    [app] = document["applications"]
    assert app["import_path"] == IMPORT_PATH
    config = ServeConfig.from_dict(app["args"])
    assert cluster_problems(config, api_keys_enabled=values_name != "minimal") == []
    # The chart's document equals the one deploy-config renders from the same ServeConfig.
    assert document == render_serve_config_v2(ServeConfig.from_dict(_merged_serve(values_name)))


def test_large_integers_survive_the_chart_exactly(rendered) -> None:
    [app] = _serve_config_v2(rendered["gpu"])["applications"]
    assert app["args"]["kvcache"]["disk_bytes"] == 1_500_000_000_000
    assert isinstance(app["args"]["kvcache"]["disk_bytes"], int)


def test_values_schema_serve_part_matches_serve_config() -> None:
    """values.schema.json embeds ServeConfig's schema; regenerate it after changing config.py with
    `msaserve deploy-config --write-values-schema helm/msaserve/values.schema.json`."""
    chart_schema = json.loads((CHART / "values.schema.json").read_text())
    generated = serve_values_schema()
    fix = (
        "ServeConfig changed: run "
        "`msaserve deploy-config --write-values-schema helm/msaserve/values.schema.json`"
    )
    assert chart_schema["properties"]["serve"] == generated["serve"], fix
    stale = [name for name, body in generated["$defs"].items() if chart_schema["$defs"].get(name) != body]
    gone = [
        name
        for name in chart_schema["$defs"]
        if name.startswith("ServeConfig.") and name not in generated["$defs"]
    ]
    assert stale == [] and gone == [], f"{fix} (stale: {stale}, removed: {gone})"


def test_deploy_config_emits_serve_config_v2(tmp_path: Path, capsys) -> None:
    config_file = tmp_path / "serve.yaml"
    config_file.write_text(yaml.safe_dump(load_values("gpu")["serve"]))
    assert main(["deploy-config", str(config_file)]) == 0
    document = yaml.safe_load(capsys.readouterr().out)
    assert document == render_serve_config_v2(ServeConfig.from_yaml(config_file))
    assert document["http_options"] == {"host": "0.0.0.0", "port": 8000, "request_timeout_s": 600.0}


def test_deploy_config_values_snippet_renders_in_the_chart(tmp_path: Path, capsys, render) -> None:
    config_file = tmp_path / "serve.yaml"
    config_file.write_text(yaml.safe_dump(load_values("all-features")["serve"]))
    assert main(["deploy-config", str(config_file), "--values", "-o", str(tmp_path / "values.yaml")]) == 0
    snippet = yaml.safe_load((tmp_path / "values.yaml").read_text())
    assert set(snippet) == {"serve"}
    # Rendered with the chart's other values from all-features (model download, etc.).
    values = {**load_values("all-features"), **snippet}
    [app] = _serve_config_v2(render(values))["applications"]
    assert ServeConfig.from_dict(app["args"]) == ServeConfig.from_yaml(config_file)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"engine": {"max_num_seqs": 0}}, "engine.max_num_seqs"),
        ({"modle": {"spec": "tiny"}}, "modle"),
        ({"http": {"host": "0.0.0.0"}, "auth": {"api_keys_env": "MSASERVE_API_KEYS"}}, None),
        ({"auth": {"api_keys_env": "MSASERVE_API_KEYS"}}, "set serve.http.host: 0.0.0.0"),
        ({"http": {"host": "0.0.0.0"}}, "set serve.auth.api_keys_env: MSASERVE_API_KEYS"),
        (
            {
                "http": {"host": "0.0.0.0"},
                "auth": {"api_keys_env": "MSASERVE_API_KEYS"},
                "model": {"device": "cuda"},
            },
            "set num_gpus > 0 or serve.model.device: cpu",
        ),
    ],
)
def test_deploy_config_refuses_with_the_field_named(
    tmp_path: Path, capsys, config: dict, message: str | None
) -> None:
    config_file = tmp_path / "serve.yaml"
    config_file.write_text(yaml.safe_dump(config))
    code = main(["deploy-config", str(config_file)])
    captured = capsys.readouterr()
    if message is None:
        assert code == 0 and "applications" in captured.out
    else:
        assert code == 2 and captured.out == ""
        assert message in captured.err and str(config_file) in captured.err


def test_cluster_problems_match_the_chart_wording(chart) -> None:
    """deploy-config and helm refuse a loopback host with the same sentence."""
    import helm_python

    config = ServeConfig.from_dict({"auth": {"api_keys_env": "MSASERVE_API_KEYS"}})
    [problem] = cluster_problems(config)
    with pytest.raises(helm_python.HelmRenderError) as refused:
        chart.render(
            values={"serve": {"http": {"host": "127.0.0.1"}}}, name="d", namespace="n", is_install=True
        )
    assert problem in str(refused.value)


def test_deploy_config_write_values_schema_round_trips(tmp_path: Path, capsys) -> None:
    schema_file = tmp_path / "values.schema.json"
    stale = json.loads((CHART / "values.schema.json").read_text())
    stale["properties"]["serve"] = {"type": "object"}
    stale["$defs"] = {k: v for k, v in stale["$defs"].items() if not k.startswith("ServeConfig.")}
    schema_file.write_text(json.dumps(stale))
    assert main(["deploy-config", "--write-values-schema", str(schema_file)]) == 0
    assert "updated" in capsys.readouterr().out
    assert schema_file.read_text() == (CHART / "values.schema.json").read_text()


def test_config_error_type_is_what_deploy_config_catches() -> None:
    with pytest.raises(ConfigError):
        ServeConfig.from_dict({"http": {"port": 0}})


@pytest.mark.parametrize("values_name", list(VALUES_FILES))
def test_import_path_builds_the_serve_application_from_rendered_args(rendered, values_name: str) -> None:
    """What KubeRay's Serve controller does first: import `import_path` and call it with `args`.
    (Binding the deployment graph needs no running Ray.)"""
    import importlib

    from ray.serve import Application

    from msaserve.platform.app import APP_NAME

    [app] = _serve_config_v2(rendered[values_name])["applications"]
    assert app["name"] == APP_NAME
    module, _, attribute = app["import_path"].partition(":")
    builder = getattr(importlib.import_module(module), attribute)
    assert isinstance(builder(app["args"]), Application)
