"""The Gateway deployment: FastAPI ingress in front of the model deployment.

It authenticates, validates, turns OpenAI requests into `ModelRequest`s, streams the model
deployment's chunks back (SSE) and records request metrics. Routes live in the `api_*` modules;
each gets the `GatewayContext` (config, handles, auth, metrics) explicitly.
"""

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from msaserve.platform import api_chat, api_completions, api_health, api_models, api_responses, api_sessions
from msaserve.platform.auth import Authenticator
from msaserve.platform.config import ServeConfig
from msaserve.platform.errors import APIError, error_response, install_error_handlers
from msaserve.platform.http_limits import ConnectionGuard, HttpLimits
from msaserve.platform.metrics import PlatformMetrics, get_metrics
from msaserve.platform.model_messages import ModelInfo
from msaserve.platform.ray_defaults import bind_replica_grpc_to_loopback
from msaserve.platform.request_metrics import RequestMetricsMiddleware
from msaserve.platform.tenants import make_tenant
from msaserve.platform.text_checks import reject_lone_surrogates

# A child of Serve's logger, so every line lands in the replica log with Serve's request id.
logger = logging.getLogger("ray.serve.msaserve.gateway")

WARMUP_RETRY_AFTER_S = 5.0


@dataclass
class GatewayContext:
    """What the routes need; passed explicitly (no globals) so the wiring is visible in one place."""

    config: ServeConfig
    model: DeploymentHandle
    preprocess: DeploymentHandle | None = None
    metrics: PlatformMetrics = field(default_factory=get_metrics)
    auth: Authenticator = field(init=False)
    _info: ModelInfo | None = None

    def __post_init__(self) -> None:
        self.auth = Authenticator(self.config.auth)

    @property
    def model_name(self) -> str:
        return self.config.model.resolved_name()

    async def model_info(self) -> ModelInfo:
        """The model deployment's state; cached once it is ready (it never becomes unready)."""
        if self._info is not None:
            return self._info
        try:
            info: ModelInfo = await asyncio.wait_for(self.model.info.remote(), timeout=10.0)
        except TimeoutError:
            return ModelInfo(name=self.model_name, ready=False)
        if info.ready:
            self._info = info
        return info

    async def require_ready(self) -> ModelInfo:
        info = await self.model_info()
        if info.error:
            raise APIError(
                503, f"model {self.model_name!r} failed to load: {info.error}", code="model_failed"
            )
        if not info.ready:
            raise APIError(
                503,
                f"model {self.model_name!r} is warming up; retry shortly",
                code="warming_up",
                retry_after_s=WARMUP_RETRY_AFTER_S,
            )
        return info

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(
                404,
                f"model {name!r} does not exist; this server serves {self.model_name!r} (see /v1/models)",
                param="model",
                code="model_not_found",
            )

    def authorize(self, request: Request) -> str:
        """The caller's key (401 if wrong, 429 over its rate); its tenant goes to request.state."""
        key = self.auth.authenticate(request.headers.get("authorization"))
        self.auth.limits.check_rate(key)
        request.state.tenant = make_tenant(
            key, self.auth.is_admin(key), self.config.auth.share_prefix_cache
        )
        return key

    async def admit(self, body: Any, request: Request) -> tuple[str, ModelInfo]:
        """The checks every generation route makes before it starts (key, text, model, readiness) and
        the key's concurrency slot, taken last: the caller releases it once the reply has ended."""
        key = self.authorize(request)
        reject_lone_surrogates(body.model_dump(exclude_none=True))
        self.check_model(body.model)
        info = await self.require_ready()
        self.auth.limits.acquire(key)
        return key, info


def request_id_of(request: Request) -> str:
    """Serve's request id (its proxy puts it in x-request-id and echoes it as X-Request-ID)."""
    rid = request.headers.get("x-request-id")
    if not rid:
        rid = serve.context._get_serve_request_context().request_id
    request.state.request_id = rid
    return rid


class BodyLimitMiddleware:
    """413 for bodies over http.max_body_bytes, by Content-Length or by counting a chunked body."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._reject(scope, receive, send, headers, int(declared))
            return
        received, exceeded = 0, False

        async def counting_receive() -> Message:
            nonlocal received, exceeded
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_body_bytes:
                exceeded = True
                raise APIError(413, self._message(received), param=None, code="body_too_large")
            return message

        async def guarded_send(message: Message) -> None:
            # FastAPI turns an error raised while reading the body into its own 400 ("error parsing
            # the body"): once the limit was crossed, answer the 413 instead of what the app sends.
            if not exceeded:
                await send(message)
            elif message["type"] == "http.response.start":
                await self._reject(scope, receive, send, headers, received)

        await self.app(scope, counting_receive, guarded_send)

    def _message(self, size: int) -> str:
        return f"request body of {size} bytes exceeds http.max_body_bytes={self.max_body_bytes}"

    async def _reject(self, scope: Scope, receive: Receive, send: Send, headers: dict, size: int) -> None:
        rid = headers.get(b"x-request-id", b"").decode() or None
        response = error_response(APIError(413, self._message(size), code="body_too_large"), rid)
        await response(scope, receive, send)


def create_api(ctx: GatewayContext) -> FastAPI:
    app = FastAPI(
        title="msaserve",
        version="0.1.0",
        description="OpenAI-compatible API of msaserve (see docs/api.md).",
    )
    install_error_handlers(app)

    @app.middleware("http")
    async def _access_log(request: Request, call_next: Any) -> Any:
        rid = request_id_of(request)
        start = time.perf_counter()
        response = await call_next(request)
        elapsed = time.perf_counter() - start
        route = request.url.path
        logger.info("[%s] %s %s → %d in %.3fs", rid, request.method, route, response.status_code, elapsed)
        return response

    if ctx.config.http.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=ctx.config.http.cors_origins,
            allow_methods=["*"],
            allow_headers=["*"],
        )
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=ctx.config.http.max_body_bytes)
    app.add_middleware(ConnectionGuard, limits=HttpLimits.from_config(ctx.config.http, in_proxy=False))
    app.add_middleware(RequestMetricsMiddleware, metrics=ctx.metrics, model=ctx.model_name)  # outermost
    for module in (api_health, api_models, api_chat, api_completions, api_responses, api_sessions):
        app.include_router(module.build_router(ctx))
    return app


class Gateway:
    """Serve deployment class; `app.py` wraps it with `serve.deployment(serve.ingress()(...))`."""

    def __init__(
        self, config: dict, model: DeploymentHandle, preprocess: DeploymentHandle | None = None
    ) -> None:
        logging.getLogger("ray.serve.msaserve").setLevel(logging.INFO)
        bind_replica_grpc_to_loopback()
        self.ctx = GatewayContext(ServeConfig.from_dict(config), model, preprocess)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return create_api(self.ctx)
