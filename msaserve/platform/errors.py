"""Errors as values at the API (CONTRIBUTING.md §7): every failure becomes an OpenAI-shaped body.

`{"error": {"message", "type", "param", "code"}}` with the right status; 429/503 carry Retry-After;
every body's message ends with the request id so a user's report can be found in the logs.
"""

import json
import logging
import math
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from msaserve.engine.types import ContextTooLong, EngineError, InvalidParameter, QueueFull, quoted

logger = logging.getLogger("msaserve.gateway")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
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
        400, f"{param}={quoted(value)} is invalid: allowed {allowed}", param=param, code="invalid_value"
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


class ErrorJSONResponse(JSONResponse):
    """ASCII JSON: an error may quote what the client sent (a field name, a value), and a lone
    surrogate in it would make Starlette's UTF-8 rendering fail, turning a 4xx into a 500."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


MAX_RETRY_AFTER_S = 3600


def error_response(error: APIError, request_id: str | None) -> JSONResponse:
    """The error body; the X-Request-ID header itself is added by Serve's proxy to every response."""
    message = error.message if not request_id else f"{error.message} (request id {request_id})"
    body = {"error": {"message": message, "type": error.type, "param": error.param, "code": error.code}}
    headers = {}
    if error.retry_after_s is not None:
        headers["Retry-After"] = str(min(MAX_RETRY_AFTER_S, max(1, math.ceil(error.retry_after_s))))
    return ErrorJSONResponse(body, status_code=error.status, headers=headers)


def _request_id(request: Request) -> str | None:
    return getattr(request.state, "request_id", None)


_UNION_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "json-or-python"}


def _is_union_tag(part: object) -> bool:
    """pydantic names the member of a union an error came from in the location ('str',
    'list[ContentPart]', 'NamedToolChoice'): a type, not a parameter, so not part of the name."""
    return isinstance(part, str) and ("[" in part or part[:1].isupper() or part in _UNION_TAGS)


def param_path(loc: tuple | list) -> str:
    """`messages[0].content[1].type` from pydantic's ('body', 'messages', 0, 'content', ...); a query
    or path parameter by its name alone (`limit`, not `query.limit`)."""
    out = ""
    for part in loc:
        if (part in ("body", "query", "path") and not out) or _is_union_tag(part):
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "body"


def _most_specific(errors: list[dict]) -> dict:
    """Of a union's alternatives, the error of the member the input came closest to matching (the
    deepest location; a wrong literal before a wrong type): for a content part of unknown type that
    is 'type is not one of ...', not 'content should be a string'."""
    def field_of(error: dict) -> object:
        return next((part for part in error.get("loc", ()) if part != "body"), None)

    same_field = [e for e in errors if field_of(e) == field_of(errors[0])]
    return max(same_field, key=lambda e: (len(e.get("loc", ())), e.get("type") == "literal_error"))


def _shown(value: object, limit: int = 100) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _validation_to_api_error(exc: RequestValidationError) -> APIError:
    """pydantic's most specific error, named by the parameter's path (OpenAI's `messages[0].role`)."""
    err = _most_specific(list(exc.errors()))
    param = param_path(err.get("loc", ()))
    msg = err.get("msg", "invalid")
    if err.get("type") == "literal_error":
        expected = (err.get("ctx") or {}).get("expected", "one of the documented values")
        return APIError(
            400, f"{param}={_shown(err.get('input'))} is not supported: allowed {expected}", param=param,
            code="invalid_value",
        )
    if err.get("type") == "extra_forbidden":
        return APIError(
            400, f"{param} is not a supported parameter", param=param, code="unsupported_parameter"
        )
    if err.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {msg}", param=None, code="invalid_json")
    value = err.get("input")
    shown = "" if isinstance(value, dict | list) or value is None else f" (got {_shown(value)})"
    return APIError(400, f"{param}: {msg}{shown}", param=param, code="invalid_value")


def _body_error(exc: RequestValidationError, content_type: str | None) -> APIError | None:
    """The body as a whole is not a JSON object: say which way (no body, not sent as JSON, JSON of
    another type), not pydantic's "body: Field required" or "valid dictionary" with the raw bytes."""
    errors = list(exc.errors())
    if not errors or tuple(errors[0].get("loc", ())) != ("body",):
        return None
    kind, value = errors[0].get("type"), errors[0].get("input")
    media_type = (content_type or "").split(";")[0].strip().lower()
    if kind == "missing":
        message = "the request body is empty: allowed a JSON object"
    elif isinstance(value, bytes | str) and media_type != "application/json":
        shown = repr(media_type) if media_type else "none"
        message = (f"the request body was not read as JSON: its Content-Type is {shown}; allowed a JSON "
                   "object sent with Content-Type: application/json")
    else:
        message = f"the request body is {_json_kind(value)}: allowed a JSON object"
    return APIError(400, message, param="body", code="invalid_value")


def _json_kind(value: object) -> str:
    if value is None:
        return "null"
    names = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array"}
    return names.get(type(value), "not a JSON object")


FASTAPI_BODY_PARSE_ERROR = "There was an error parsing the body"
"""FastAPI's 400 when json.loads itself fails on the body (not a JSON syntax error, which it reports
as json_invalid): nesting deeper than the parser's recursion limit, an integer of more than 4,300
digits."""
UNPARSABLE_BODY = APIError(
    400,
    "the request body could not be parsed: allowed JSON nested at most a few hundred levels deep, with "
    "integers of at most 4300 digits",
    code="invalid_json",
)


def unparsable_body(body: bytes) -> APIError:
    """Why json.loads refused a body FastAPI read: bytes that are not UTF-8 (named by offset), or
    the parser's own limits."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as e:
        return APIError(
            400, f"the request body is not valid UTF-8: byte 0x{body[e.start]:02x} at offset {e.start} "
            f"({e.reason}); allowed JSON encoded as UTF-8", code="invalid_json",
        )
    return UNPARSABLE_BODY


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        request.state.error_code = exc.code or exc.type  # the cause the request metrics record
        return error_response(exc, _request_id(request))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        error = _body_error(exc, request.headers.get("content-type")) or _validation_to_api_error(exc)
        return error_response(error, _request_id(request))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and exc.detail == FASTAPI_BODY_PARSE_ERROR:
            return error_response(unparsable_body(await request.body()), _request_id(request))
        if exc.status_code in (404, 405) and exc.detail == HTTPStatus(exc.status_code).phrase:
            return _no_route(request, exc.status_code)
        response = error_response(APIError(exc.status_code, str(exc.detail)), _request_id(request))
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("[%s] internal error", _request_id(request))
        return error_response(APIError(500, f"internal error: {type(exc).__name__}"), _request_id(request))


_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def _no_route(request: Request, status: int) -> JSONResponse:
    """Starlette's bare "Not Found" / "Method Not Allowed" for a request no route takes, said with the
    method, the path and what the path allows. The `Allow` header (RFC 9110 requires it on a 405)
    lists the methods of every route of this path; Starlette's lists the first route's only (GET of
    `/v1/responses/{id}`, not its DELETE)."""
    path, method = request.scope.get("path", ""), request.method
    routes = request.app.router.routes  # FastAPI ≥ 0.160 nests an included router's: ask each by method
    allowed = [m for m in _METHODS
               if any(route.matches({**request.scope, "method": m})[0] == Match.FULL for route in routes)]
    if status == 405 and allowed:
        error = APIError(405, f"method {method} is not allowed on {quoted(path)}: allowed "
                         f"{', '.join(allowed)}", code="method_not_allowed")
        response = error_response(error, _request_id(request))
        response.headers["Allow"] = ", ".join(allowed)
        return response
    error = APIError(404, f"no route {method} {quoted(path)}: the API's routes are listed in /docs and "
                     "/openapi.json (the OpenAI routes under /v1/)", code="route_not_found")
    return error_response(error, _request_id(request))
