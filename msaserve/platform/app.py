"""The Ray Serve application: Gateway (FastAPI ingress) → Model (engine replicas), plus Preprocess.

    build_app(ServeConfig) -> serve.Application        # Python, `msaserve serve`, tests
    app_builder(args: dict) -> serve.Application       # serveConfigV2: import_path
                                                       #   msaserve.platform.app:app_builder
The hook points for the other parts are the three small functions below: `router_config` (the
request router on the model deployment), `preprocess_app` (the media pipeline) and the KV cache
settings the engine reads from its config.
"""

from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from msaserve.platform.config import RouterConfig, ServeConfig
from msaserve.platform.gateway import Gateway
from msaserve.platform.model_deployment import ModelDeployment
from msaserve.platform.model_placement import model_deployment_options
from msaserve.platform.preprocess_deployment import PreprocessDeployment

ROUTER_CLASS = "msaserve.router.serve_router.MSARequestRouter"
"""The Ray Serve RequestRouter that implements the non-default policies (msaserve.router)."""

TEXT_ONLY_PRESETS = ("smollm2", "m3-proxy", "m3-mini")
"""Models without a vision tower (`tiny` has one): no Preprocess deployment, media parts get 400."""

APP_NAME = "msaserve"


def router_config(router: RouterConfig) -> RequestRouterConfig:
    """Every policy, pow2 included, runs in msaserve.router's request router, so that policy
    comparisons share one code path (it learns the engine's page size from routing stats)."""
    from msaserve.router.serve_router import request_router_config

    return request_router_config(router.model_dump())


def preprocess_app(config: ServeConfig) -> Application | None:
    """The Preprocess deployment, for models that may take media (not the text-only presets)."""
    if config.model.spec in TEXT_ONLY_PRESETS:
        return None
    deployment = serve.deployment(PreprocessDeployment, name="Preprocess")
    options = config.deployments.preprocess.to_serve_options()
    return deployment.options(**options).bind(config.preprocess.model_dump(), config.model.spec)


def build_app(config: ServeConfig) -> Application:
    as_dict = config.model_dump(mode="json")
    model_options = model_deployment_options(config)  # with the rank bundles of a multi-GPU replica
    model_options["request_router_config"] = router_config(config.router)
    # The engine loads in the background; the gateway answers 503 until it is ready.
    model = serve.deployment(ModelDeployment, name="Model").options(**model_options).bind(as_dict)
    gateway_cls = serve.ingress()(Gateway)
    gateway = serve.deployment(gateway_cls, name="Gateway").options(
        **config.deployments.gateway.to_serve_options()
    )
    return gateway.bind(as_dict, model, preprocess_app(config))


def app_builder(args: dict[str, Any]) -> Application:
    """Ray Serve application builder: `args` is a ServeConfig as a dict (serveConfigV2 `args`)."""
    return build_app(ServeConfig.from_dict(dict(args)))
