"""Request counters at the gateway, for every answer including the ones no route handler produced.

A FastAPI `@app.middleware("http")` never sees an unhandled exception's 500 (Starlette's outermost
ServerErrorMiddleware renders it after the exception passed through), so internal errors went
uncounted. This pure ASGI middleware watches the status the app sends and the exception that
escapes: every request on /v1/ counts in `msaserve_requests`, every 5xx on any route in
`msaserve_server_errors` with its cause (the APIError code the handler left in the request state,
or the exception's type name). A request whose client left (Serve cancels its handler) counts under
the status already sent, or 499 when none was.
"""

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from msaserve.platform.metrics import PlatformMetrics

KNOWN_ROUTES = ("/v1/chat/completions", "/v1/completions", "/health", "/ready", "/metrics")
COLLECTIONS = ("/v1/models", "/v1/responses", "/v1/sessions")
"""Routes with ids below them, each counted as one label: /v1/responses/{id}[/...] → /v1/responses."""


def route_label(path: str) -> str:
    """A bounded label: the route, with an id below a collection dropped; other paths 'other'."""
    for collection in COLLECTIONS:
        if path == collection or path.startswith(collection + "/"):
            return collection
    return path if path in KNOWN_ROUTES else "other"


CLIENT_CLOSED_REQUEST = 499
"""The status label of a request whose client left before any response was sent (nginx's code)."""


class RequestMetricsMiddleware:
    def __init__(self, app: ASGIApp, metrics: PlatformMetrics, model: str) -> None:
        self.app, self.metrics, self.model = app, metrics, model

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0

        async def watched_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        except asyncio.CancelledError:
            # The client left and Serve cancelled the handler (a stream closed mid-way): counted under
            # the status already sent, or 499 before any, rather than not at all.
            self._record(scope, status or CLIENT_CLOSED_REQUEST, "client_disconnected")
            raise
        except Exception as e:
            self._record(scope, status if status >= 500 else 500, type(e).__name__)
            raise
        state = scope.get("state") or {}
        self._record(scope, status, state.get("error_code") or "unknown")

    def _record(self, scope: Scope, status: int, cause: str) -> None:
        path, route = scope.get("path", ""), route_label(scope.get("path", ""))
        if path.startswith("/v1/"):
            self.metrics.inc("requests", model=self.model, route=route, status=str(status))
        if status >= 500:
            self.metrics.inc("server_errors", model=self.model, route=route, status=str(status), cause=cause)
