"""Limits on what one client can hold of the HTTP front end (`http.*` in the ServeConfig).

`ConnectionGuard` is a pure ASGI middleware. `msaserve serve` installs it in Ray Serve's HTTP proxy
(`apply_proxy_limits`: the process where uvicorn holds the connections) and the gateway app
installs it too (so a deployment whose proxy was started without it, e.g. on KubeRay, still has
the body deadline and the caps). It enforces:

- a deadline on the request body (`http.body_read_timeout_s`): a client that sends headers and then
  trickles or stalls the body gets a 408 and the request ends (it held the connection 70 s+);
- requests in flight per client address (`http.max_requests_per_client`, 429; the TCP peer, or the
  X-Forwarded-For client of a peer in `http.trusted_proxies`: client_address.py) and in all
  (`http.max_requests`, 503), counted until the response ends, so streams count;
- and, in the proxy, a deadline on the headers (`header_timeout.install`), and no client override of
  Serve's request timeout or disconnect handling (`CLIENT_OVERRIDE_HEADERS` are dropped).

- the body's size (`http.max_body_bytes`, 413), counted as a streamed (chunked) body arrives, so
  the proxy refuses it without reading it all (the gateway's BodyLimitMiddleware also checks a
  declared Content-Length before reading anything).
"""

import asyncio
import json
import os
import time
import uuid
from dataclasses import asdict, dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from msaserve.engine.types import quoted
from msaserve.platform import header_timeout
from msaserve.platform.client_address import FORWARDED_ALLOW_IPS_ENV, ClientAddress
from msaserve.platform.errors import APIError, error_response


@dataclass(frozen=True)
class HttpLimits:
    header_timeout_s: float | None
    body_read_timeout_s: float
    max_requests: int
    max_requests_per_client: int
    max_body_bytes: int
    trusted_proxies: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, http, in_proxy: bool) -> "HttpLimits":  # http: config.HttpConfig
        return cls(
            header_timeout_s=http.header_timeout_s if in_proxy else None,
            body_read_timeout_s=http.body_read_timeout_s,
            max_requests=http.max_requests,
            max_requests_per_client=http.max_requests_per_client,
            max_body_bytes=http.max_body_bytes,
            trusted_proxies=tuple(http.trusted_proxies),
        )


CLIENT_OVERRIDE_HEADERS = (b"x-request-timeout-seconds", b"x-request-disconnect-disabled")
"""Headers with which Ray Serve 2.60's proxy lets a request raise or switch off (`<= 0`) the
operator's `request_timeout_s`, or keep running after its client left: a client could hold a
replica slot as long as it likes. Removed before the proxy reads them."""


MAX_REQUEST_ID_CHARS = 256


def bad_request_id(headers: list[tuple[bytes, bytes]]) -> APIError | None:
    """A 400 for a client's X-Request-ID of more than 256 characters or any but printable ASCII (an
    empty one is no id: the server makes one). Serve takes the header as the request's id, which goes
    into the response's id (`chatcmpl-<id>`), every log line and every error message: a
    5,000-character id went there whole."""
    value = next((v for n, v in headers if n == b"x-request-id"), None)
    if not value or (len(value) <= MAX_REQUEST_ID_CHARS and all(0x21 <= b <= 0x7E for b in value)):
        return None
    shown = quoted(value.decode("latin-1"), limit=60)
    return APIError(400, f"X-Request-ID={shown} is invalid: allowed 1 to {MAX_REQUEST_ID_CHARS} printable "
                    "ASCII characters (no spaces), or no header for an id of the server's",
                    param="X-Request-ID", code="invalid_value")


class _BodyRefused(Exception):
    """Raised into the app from `receive` when the body broke a limit."""


class ConnectionGuard:
    def __init__(self, app: ASGIApp, limits: HttpLimits) -> None:
        self.app, self.limits = app, limits
        self.in_flight = 0
        self.per_client: dict[str, int] = {}
        self.client_address = ClientAddress.from_entries(limits.trusted_proxies)
        if limits.header_timeout_s is not None:
            header_timeout.install(limits.header_timeout_s)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        peer = (scope.get("client") or ("unknown", 0))[0]
        client = self.client_address.of(peer, scope.get("headers") or [])
        refusal = self._refusal(client)
        if refusal is not None:
            await self._refuse(refusal, scope, receive, send, close=False)
            return
        headers = scope.get("headers") or []
        bad_id = bad_request_id(headers)
        if bad_id is not None:  # answered under an id of ours: the client's is what is wrong
            await self._refuse(bad_id, scope, receive, send, close=False, request_id=uuid.uuid4().hex)
            return
        if any(name in CLIENT_OVERRIDE_HEADERS for name, _ in headers):
            scope = {**scope, "headers": [(n, v) for n, v in headers if n not in CLIENT_OVERRIDE_HEADERS]}
        self.in_flight += 1
        self.per_client[client] = self.per_client.get(client, 0) + 1
        try:
            await self._guarded(scope, receive, send)
        finally:
            self.in_flight -= 1
            self.per_client[client] -= 1
            if not self.per_client[client]:
                del self.per_client[client]

    def _refusal(self, client: str) -> APIError | None:
        limits = self.limits
        if self.per_client.get(client, 0) >= limits.max_requests_per_client:
            return APIError(429, f"{limits.max_requests_per_client} requests are in flight from this client "
                            "(http.max_requests_per_client)", code="too_many_requests_per_client",
                            retry_after_s=1.0)
        if self.in_flight >= limits.max_requests:
            return APIError(503, f"the server holds its limit of {limits.max_requests} requests in flight "
                            "(http.max_requests)", code="server_busy", retry_after_s=1.0)
        return None

    async def _guarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        limits = self.limits
        deadline = time.monotonic() + limits.body_read_timeout_s
        body_done, received, started = False, 0, False
        refusal: APIError | None = None  # set once the body broke a limit

        async def guarded_receive() -> Message:
            nonlocal body_done, received, refusal
            if body_done:  # after the body: only the disconnect message, however long it takes
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                refusal = APIError(408, "the request body did not arrive within http.body_read_timeout_s="
                                   f"{limits.body_read_timeout_s:g}s", code="request_timeout")
                raise _BodyRefused from None
            received += len(message.get("body", b""))
            if received > limits.max_body_bytes:
                refusal = APIError(413, f"request body of more than {limits.max_body_bytes} bytes: allowed "
                                   f"http.max_body_bytes={limits.max_body_bytes}", code="body_too_large")
                raise _BodyRefused
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        async def guarded_send(message: Message) -> None:
            # An app that reads the body may turn the error raised in receive into its own answer
            # (FastAPI: 400 "error parsing the body"); once a limit was broken, the client gets
            # the 408/413 instead, and the connection is closed (the rest of the body is unread).
            nonlocal started
            if refusal is None:
                started = started or message["type"] == "http.response.start"
                await send(message)
            elif message["type"] == "http.response.start" and not started:
                started = True
                await self._refuse(refusal, scope, receive, send)

        try:
            await self.app(scope, guarded_receive, guarded_send)
        except Exception:  # the app may wrap _BodyRefused in its own error
            if refusal is None or started:
                raise
        if refusal is not None and not started:
            await self._refuse(refusal, scope, receive, send)

    @staticmethod
    async def _refuse(
        error: APIError, scope: Scope, receive: Receive, send: Send, close: bool = True,
        request_id: str | None = None,
    ) -> None:
        """The error answer, with a request id as every other answer has (in the proxy this runs
        outside Serve's request-id middleware): the client's X-Request-ID, or a new one."""
        headers = dict(scope.get("headers") or [])
        request_id = request_id or headers.get(b"x-request-id", b"").decode("latin-1") or uuid.uuid4().hex
        response = error_response(error, request_id)
        response.headers["x-request-id"] = request_id
        if close:  # the rest of the body is unread: the connection cannot carry another request
            response.headers["connection"] = "close"
        await response(scope, receive, send)


PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
"""Ray Serve 2.60's one way to put ASGI middleware into its HTTP proxy: `serve.start` refuses
`http_options.middlewares` ("has been removed"), but the proxy still calls the function this
variable names, at start, and wraps its app in the Starlette middlewares it returns."""
LIMITS_ENV = "MSASERVE_PROXY_HTTP_LIMITS"
"""The proxy's HttpLimits as JSON (the callback takes no arguments; the proxy inherits the env)."""


def apply_proxy_limits(http) -> dict[str, str]:  # http: config.HttpConfig
    """Before `ray.init` (the proxy inherits the environment of the Ray it starts in): the
    ConnectionGuard, with the header deadline, in Serve's HTTP proxy, and uvicorn's trusted
    forwarders (FORWARDED_ALLOW_IPS, 127.0.0.1 by default) set to `http.trusted_proxies`."""
    limits = HttpLimits.from_config(http, in_proxy=True)
    os.environ[LIMITS_ENV] = json.dumps(asdict(limits))
    os.environ[PROXY_CALLBACK_ENV] = "msaserve.platform.http_limits:proxy_middlewares"
    os.environ[FORWARDED_ALLOW_IPS_ENV] = ",".join(limits.trusted_proxies)
    return {name: os.environ[name] for name in (LIMITS_ENV, PROXY_CALLBACK_ENV, FORWARDED_ALLOW_IPS_ENV)}


def proxy_limits_from_env() -> HttpLimits:
    """The proxy's limits from LIMITS_ENV: any subset of the `http` section as JSON (what
    `apply_proxy_limits` writes, or the Helm chart's `serve.http`), ServeConfig's defaults for the
    rest, so a cluster's proxy gets the same guard as a local one."""
    from msaserve.platform.config import HttpConfig

    fields = json.loads(os.environ.get(LIMITS_ENV) or "{}")
    return HttpLimits.from_config(HttpConfig.model_validate(fields), in_proxy=True)


def proxy_middlewares() -> list:
    """Called by Serve inside the proxy process (PROXY_CALLBACK_ENV), before it configures uvicorn:
    uvicorn then trusts X-Forwarded-For from `http.trusted_proxies` only (none by default)."""
    from starlette.middleware import Middleware

    limits = proxy_limits_from_env()
    os.environ[FORWARDED_ALLOW_IPS_ENV] = ",".join(limits.trusted_proxies)
    return [Middleware(ConnectionGuard, limits=limits)]


def proxy_http_options(http) -> dict:  # http: config.HttpConfig
    """`serve.start(http_options=...)` for a local start: the proxy's address and Serve's request and
    keep-alive timeouts (the guard comes through `apply_proxy_limits`, before `ray.init`)."""
    return {
        "host": http.host,
        "port": http.port,
        "request_timeout_s": http.request_timeout_s,
        "keep_alive_timeout_s": http.keep_alive_timeout_s,
    }
