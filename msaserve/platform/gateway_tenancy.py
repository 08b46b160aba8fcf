"""The request's tenant-scoped identifiers, read where the routes build engine requests."""

from fastapi import Request

from msaserve.platform.errors import APIError

MAX_SESSION_ID_CHARS = 256


def session_of(request: Request) -> str | None:
    """The `X-Session-Id` header scoped to the caller's tenant (set by `GatewayContext.authorize`)."""
    session_id = request.headers.get("x-session-id") or None
    if session_id is None:
        return None
    check_session_id(session_id, "X-Session-Id")
    return request.state.tenant.scope(session_id)


def check_session_id(session_id: str, param: str) -> None:
    if len(session_id) > MAX_SESSION_ID_CHARS or not session_id.isprintable():
        raise APIError(
            400,
            f"{param}={session_id[:40] + ('...' if len(session_id) > 40 else '')!r} is invalid: allowed "
            f"up to {MAX_SESSION_ID_CHARS} printable characters",
            param=param,
            code="invalid_value",
        )
