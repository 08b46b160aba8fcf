"""GET /health (liveness), GET /ready (a model replica answers) and GET /metrics (Prometheus).

/health and /ready take HEAD too: load balancers and uptime checks often probe with it, and a 405
would read as down."""

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from msaserve.platform.errors import APIError, error_response
from msaserve.platform.metrics_export import PROMETHEUS_CONTENT_TYPE, MetricsExport
from msaserve.platform.openai_types import ErrorResponse
from msaserve.platform.readiness import ReadinessProbe


def build_router(ctx: Any) -> APIRouter:
    router = APIRouter()
    http = ctx.config.http
    probe = ReadinessProbe(http.ready_probe_timeout_s, http.ready_cache_s)
    export = MetricsExport()

    @router.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> dict:
        """Liveness: 200 while the gateway answers. Whether a model can answer is `/ready`."""
        return {"status": "ok"}

    @router.api_route("/ready", methods=["GET", "HEAD"], responses={503: {"model": ErrorResponse}})
    async def ready(request: Request) -> Any:
        """200 when a model replica answered a 1-token probe within http.ready_probe_timeout_s
        (a success is reused for http.ready_cache_s); 503 with Retry-After otherwise."""
        try:
            result = await probe.check(ctx)
        except APIError as e:
            request.state.error_code = e.code
            return error_response(e, getattr(request.state, "request_id", None))
        return JSONResponse({"status": "ready", "model": ctx.model_name,
                             "probe_latency_s": round(result.latency_s, 4)})

    @router.get("/metrics", response_class=Response, responses={401: {"model": ErrorResponse},
                                                                 503: {"model": ErrorResponse}})
    async def metrics(request: Request) -> Response:
        """Prometheus text of this node's Ray metrics (msaserve_*, Serve's, Ray's); needs an API
        key unless http.metrics_open."""
        if not http.metrics_open:
            ctx.authorize(request)
        return Response(await export.text(), media_type=PROMETHEUS_CONTENT_TYPE)

    return router
