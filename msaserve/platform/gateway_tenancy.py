"""The request's tenant-scoped identifiers, read where the routes build engine requests."""

from fastapi import Request

from msaserve.platform.errors import APIError

MAX_SESSION_ID_CHARS = 256


def session_of(request: Request) -> str | None:
    """The `X-Session-Id` header scoped to the caller's tenant (set by `GatewayContext.authorize`)."""
    session_id = request.headers.get("x-session-id") or None
    if session_id is None:
        return None
    # The ASGI server decodes header values as Latin-1: the id's UTF-8 bytes are read back as UTF-8,
    # as a path's percent-encoded bytes are, so `X-Session-Id: café` is /v1/sessions/caf%C3%A9 (it
    # was stored as 'cafÃ©', which no session route could name).
    try:
        session_id = session_id.encode("latin-1").decode("utf-8")
    except UnicodeError:
        raise APIError(
            400,
            f"X-Session-Id={session_id[:40]!r} is invalid: allowed UTF-8 text",
            param="X-Session-Id",
            code="invalid_value",
        ) from None
    check_session_id(session_id, "X-Session-Id")
    return request.state.tenant.scope(session_id)


def check_session_id(session_id: str, param: str) -> None:
    # U+FFFD: what a path's percent-encoded bytes that are not UTF-8 decode to (/v1/sessions/%ff and
    # /v1/sessions/%fe named one session), so no id may hold it.
    if len(session_id) > MAX_SESSION_ID_CHARS or not session_id.isprintable() or "\ufffd" in session_id:
        raise APIError(
            400,
            f"{param}={session_id[:40] + ('...' if len(session_id) > 40 else '')!r} is invalid: allowed "
            f"up to {MAX_SESSION_ID_CHARS} printable characters of UTF-8 text (no U+FFFD)",
            param=param,
            code="invalid_value",
        )
