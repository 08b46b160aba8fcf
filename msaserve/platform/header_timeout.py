"""A deadline for a request's headers in uvicorn, which has none.

uvicorn 0.54 (the server inside Ray Serve 2.60's HTTP proxy) arms a timer only after a response
(`timeout_keep_alive`, in `on_response_complete`); a connection that never completes its headers, or
opens and sends nothing, is held for as long as the client likes (slowloris), and no ASGI middleware
can see it, since the app is only called once the headers are in. Ray Serve exposes no setting for
it. `install(seconds)` arms one more timer on every uvicorn HTTP connection, when it opens and after
each response; if no new request's headers have arrived when it fires (the protocol's current
request cycle is still the one it saw), the connection gets a 408 and is closed.

Installed in the proxy process by `ConnectionGuard` (which Serve constructs there from
`http_options.middlewares`), for both of uvicorn's HTTP protocols (httptools and h11).
"""

import asyncio
from typing import Any

REQUEST_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"
_installed: dict[str, float] = {}


def _protocol_classes() -> list[type]:
    classes = []
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        classes.append(HttpToolsProtocol)
    except ImportError:  # httptools not installed: uvicorn uses h11
        pass
    from uvicorn.protocols.http.h11_impl import H11Protocol

    classes.append(H11Protocol)
    return classes


def _arm(protocol: Any, seconds: float) -> None:
    previous = getattr(protocol, "_msaserve_header_timer", None)
    if previous is not None:
        previous.cancel()
    cycle = protocol.cycle

    def expire() -> None:
        transport = protocol.transport
        if protocol.cycle is cycle and transport is not None and not transport.is_closing():
            transport.write(REQUEST_TIMEOUT)
            transport.close()

    protocol._msaserve_header_timer = asyncio.get_running_loop().call_later(seconds, expire)


def install(seconds: float) -> None:
    """Arm the header deadline on every uvicorn HTTP connection of this process (idempotent; the
    last value wins)."""
    _installed["seconds"] = seconds
    for cls in _protocol_classes():
        if getattr(cls, "_msaserve_header_deadline", False):
            continue
        original_made, original_complete = cls.connection_made, cls.on_response_complete

        def connection_made(self, transport, _original=original_made) -> None:  # type: ignore[no-untyped-def]
            _original(self, transport)
            _arm(self, _installed["seconds"])

        def on_response_complete(self, _original=original_complete) -> None:  # type: ignore[no-untyped-def]
            _original(self)
            _arm(self, _installed["seconds"])

        cls.connection_made = connection_made
        cls.on_response_complete = on_response_complete
        cls._msaserve_header_deadline = True
