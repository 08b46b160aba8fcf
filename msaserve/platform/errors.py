"""Errors as values at the API (CONTRIBUTING.md §7): every failure becomes an OpenAI-shaped body.

`{"error": {"message", "type", "param", "code"}}` with the right status; 429/503 carry Retry-After;
every body's message ends with the request id so a user's report can be found in the logs.
"""

import logging
import math
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from msaserve.engine.types import ContextTooLong, EngineError, InvalidParameter, QueueFull

logger = logging.getLogger("msaserve.gateway")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    501: "not_implemented_error",
    503: "service_unavailable",
}


@dataclass
class APIError(Exception):
    """Raised anywhere in the gateway; the handler turns it into the OpenAI error body."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    retry_after_s: float | None = None

    def __str__(self) -> str:
        return f"{self.status}: {self.message}"

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")


def bad_parameter(param: str, value: object, allowed: str) -> APIError:
    return APIError(
        400, f"{param}={value!r} is invalid: allowed {allowed}", param=param, code="invalid_value"
    )


def from_engine_error(e: EngineError) -> APIError:
    """Map the engine's typed errors (msaserve.engine.types) to API errors."""
    if isinstance(e, InvalidParameter):
        return APIError(400, str(e), param=e.param, code="invalid_value")
    if isinstance(e, ContextTooLong):
        return APIError(400, str(e), param="messages", code="context_length_exceeded")
    if isinstance(e, QueueFull):
        return APIError(429, str(e), code="queue_full", retry_after_s=e.retry_after_s)
    return APIError(e.status, str(e))


def error_response(error: APIError, request_id: str | None) -> JSONResponse:
    """The error body; the X-Request-ID header itself is added by Serve's proxy to every response."""
    message = error.message if not request_id else f"{error.message} (request id {request_id})"
    body = {"error": {"message": message, "type": error.type, "param": error.param, "code": error.code}}
    headers = {}
    if error.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after_s)))
    return JSONResponse(body, status_code=error.status, headers=headers)


def _request_id(request: Request) -> str | None:
    return getattr(request.state, "request_id", None)


def _validation_to_api_error(exc: RequestValidationError) -> APIError:
    """pydantic's first error, named by the parameter's dotted path (body. prefix dropped)."""
    err = exc.errors()[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    param = ".".join(loc) or "body"
    msg = err.get("msg", "invalid")
    if err.get("type") == "extra_forbidden":
        return APIError(
            400, f"{param} is not a supported parameter", param=param, code="unsupported_parameter"
        )
    if err.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {msg}", param=None, code="invalid_json")
    value = err.get("input")
    shown = "" if isinstance(value, dict | list) or value is None else f" (got {value!r})"
    return APIError(400, f"{param}: {msg}{shown}", param=param, code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, _request_id(request))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(_validation_to_api_error(exc), _request_id(request))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(exc.status_code, str(exc.detail)), _request_id(request))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("[%s] internal error", _request_id(request))
        return error_response(APIError(500, f"internal error: {type(exc).__name__}"), _request_id(request))
