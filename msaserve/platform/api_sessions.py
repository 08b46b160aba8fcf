"""GET / DELETE /v1/sessions/{id} and POST /v1/sessions/{id}/move.

A session (header `X-Session-Id`) keeps a conversation's pages on the replica that served it, so a
later turn reuses them. The record lives on that replica; the request router's session affinity
sends the session's calls there (with Ray Serve's `session_id` handle option).
"""

from typing import Any

from fastapi import APIRouter, Request

from msaserve.platform.errors import APIError


def _not_found(session_id: str) -> APIError:
    return APIError(
        404,
        f"session {session_id!r} is not known on any replica reached",
        param="session_id",
        code="session_not_found",
    )


def build_router(ctx: Any) -> APIRouter:
    router = APIRouter()

    def handle(session_id: str) -> Any:
        return ctx.model.options(session_id=session_id)

    @router.get("/v1/sessions/{session_id}")
    async def get_session(session_id: str, request: Request) -> dict:
        ctx.authorize(request)
        await ctx.require_ready()
        info = await handle(session_id).session_info.remote(session_id)
        if info is None:
            raise _not_found(session_id)
        return {"object": "session", **vars(info)}

    @router.delete("/v1/sessions/{session_id}")
    async def delete_session(session_id: str, request: Request) -> dict:
        ctx.authorize(request)
        await ctx.require_ready()
        if not await handle(session_id).delete_session.remote(session_id):
            raise _not_found(session_id)
        return {"id": session_id, "object": "session", "deleted": True}

    @router.post("/v1/sessions/{session_id}/move")
    async def move_session(session_id: str, request: Request) -> dict:
        ctx.authorize(request)
        if not ctx.config.kvcache.enabled:
            raise APIError(
                501,
                "moving a session needs the KV cache service (set kvcache.enabled: true); "
                "without it a session's pages live only on the replica that served it",
                param="session_id",
                code="kvcache_disabled",
            )
        raise APIError(
            409,
            "explicit session moves are not available yet: the router moves a session by itself when "
            "its replica is overloaded, draining or dead",
            param="session_id",
            code="move_unsupported",
        )

    return router
