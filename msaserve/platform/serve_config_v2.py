"""Render a `ServeConfig` as KubeRay's `serveConfigV2` and as the Helm chart's `serve:` values.

The chart (`helm/msaserve/templates/_serveconfig.tpl`) builds the same document from `.Values.serve`;
tests/helm renders both and compares them. `cluster_problems` applies the chart's cross-field checks
(`templates/_validate.tpl`) to a ServeConfig, so `msaserve deploy-config` refuses what `helm install`
would refuse, with the same wording. The chart's `values.schema.json` embeds ServeConfig's JSON
schema under `serve`; `sync_values_schema` rewrites that part when ServeConfig changes.
"""

import json
from pathlib import Path
from typing import Any

import yaml

from msaserve.platform.config import ServeConfig

APP_NAME = "msaserve"
IMPORT_PATH = "msaserve.platform.app:app_builder"
# The chart puts the API-key Secret into this environment variable of every Ray container.
API_KEYS_ENV = "MSASERVE_API_KEYS"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
# Deployments (msaserve/platform/app.py) that hold a request for its whole life: when one of their
# replicas is stopped (node drain, scale-down, upgrade) Serve waits up to request_timeout_s for its
# running requests instead of its default 20 s.
DRAINED_DEPLOYMENTS = ("Gateway", "Model")
# ServeConfig's definitions live under this prefix in values.schema.json's $defs, apart from the
# chart's own.
SCHEMA_DEF_PREFIX = "ServeConfig."


def serve_args(config: ServeConfig) -> dict[str, Any]:
    """The application's `args`: the fields the user set (defaults re-apply when the app parses them)."""
    return config.model_dump(mode="json", exclude_unset=True)


def render_serve_config_v2(config: ServeConfig) -> dict[str, Any]:
    """The serveConfigV2 document (a dict; KubeRay takes it as a YAML string)."""
    return {
        "http_options": {
            "host": config.http.host,
            "port": config.http.port,
            "request_timeout_s": config.http.request_timeout_s,
        },
        "applications": [
            {
                "name": APP_NAME,
                "route_prefix": "/",
                "import_path": IMPORT_PATH,
                "args": serve_args(config),
                "deployments": [
                    {"name": name, "graceful_shutdown_timeout_s": config.http.request_timeout_s}
                    for name in DRAINED_DEPLOYMENTS
                ],
            }
        ],
    }


def serve_config_v2_yaml(config: ServeConfig) -> str:
    return yaml.safe_dump(render_serve_config_v2(config), sort_keys=False)


def values_snippet_yaml(config: ServeConfig) -> str:
    """A values file for `helm install -f`: the chart's `serve:` block."""
    return yaml.safe_dump({"serve": serve_args(config)}, sort_keys=False)


def _quoted(value: str | None) -> str:
    """A value quoted as Helm's %q quotes it, so both tools print the same message."""
    return json.dumps(value or "")


def cluster_problems(config: ServeConfig, *, api_keys_enabled: bool = True) -> list[str]:
    """Why this config would not work behind the chart (empty when it would); mirrors _validate.tpl."""
    problems = []
    if config.http.host in LOOPBACK_HOSTS:
        problems.append(
            f"serve.http.host is {_quoted(config.http.host)}: the Serve proxy would only listen inside its "
            "pod and KubeRay's API Service would get no traffic; set serve.http.host: 0.0.0.0"
        )
    if api_keys_enabled and config.auth.api_keys_env != API_KEYS_ENV:
        problems.append(
            "apiKeys.enabled is true but serve.auth.api_keys_env is "
            f"{_quoted(config.auth.api_keys_env)}: the chart's API-key Secret reaches the gateway as "
            f"{API_KEYS_ENV} and would be ignored (the API would be open); "
            f"set serve.auth.api_keys_env: {API_KEYS_ENV}"
        )
    num_gpus = config.deployments.model.ray_actor_options.num_gpus
    ranks = config.engine.tensor_parallel_size * config.engine.expert_parallel_size
    if ranks > 1 and num_gpus > 0:
        problems.append(
            f"serve.engine.tensor_parallel_size x expert_parallel_size = {ranks}: each model replica "
            f"reserves its {ranks} GPUs in a placement group (one bundle per rank) and the replica itself "
            "holds none; set serve.deployments.model.ray_actor_options.num_gpus: 0"
        )
    if config.model.device == "cuda" and num_gpus == 0 and ranks == 1:
        problems.append(
            "serve.model.device is cuda but serve.deployments.model.ray_actor_options.num_gpus is 0: "
            "Ray would give the replica no GPU; set num_gpus > 0 or serve.model.device: cpu"
        )
    return problems


def serve_values_schema() -> dict[str, Any]:
    """ServeConfig's JSON schema with its $defs renamed `ServeConfig.<Name>` (for values.schema.json)."""
    schema = ServeConfig.model_json_schema(ref_template="#/$defs/" + SCHEMA_DEF_PREFIX + "{model}")
    defs = {SCHEMA_DEF_PREFIX + name: body for name, body in schema.pop("$defs", {}).items()}
    return {"serve": schema, "$defs": defs}


def sync_values_schema(path: str | Path) -> bool:
    """Rewrite the `serve` part of the chart's values.schema.json from ServeConfig; True if it changed."""
    path = Path(path)
    old_text = path.read_text()
    chart_schema = json.loads(old_text)
    generated = serve_values_schema()
    chart_schema["properties"]["serve"] = generated["serve"]
    kept = {k: v for k, v in chart_schema.get("$defs", {}).items() if not k.startswith(SCHEMA_DEF_PREFIX)}
    chart_schema["$defs"] = {**kept, **generated["$defs"]}
    new_text = json.dumps(chart_schema, indent=2, ensure_ascii=False) + "\n"
    if new_text != old_text:
        path.write_text(new_text)
    return new_text != old_text
