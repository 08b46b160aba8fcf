"""GET / DELETE /v1/sessions/{id} and POST /v1/sessions/{id}/move.

A session (header `X-Session-Id`) keeps a conversation's pages on the replica that served it, so a
later turn reuses them. The record lives on that replica; the request router's session affinity
sends the session's calls there (with Ray Serve's `session_id` handle option).

With the KV cache service (`kvcache.enabled`), every replica persists its sessions there, so a move
only re-homes the session in the router: the next turn runs on the target, which adopts it from
the service (index first, K/V pages as its indexer selects them). A session whose home died moves
the same way on its next turn, by the router's own choice.
"""

import json
from typing import Any

from fastapi import APIRouter, Request

from msaserve.engine.types import quoted
from msaserve.platform.errors import APIError
from msaserve.platform.gateway_tenancy import check_session_id
from msaserve.platform.openai_types import ErrorResponse
from msaserve.platform.tenants import split_scoped

# Documented in the served OpenAPI schema, so that clients (and schemathesis) know every status.
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 409, 429, 501, 503)
}
# A session belongs to the API key that created it: every route scopes the id to the caller's
# tenant (msaserve.platform.tenants), so another key's session is simply not found (404).


def _not_found(session_id: str) -> APIError:
    return APIError(
        404,
        f"session {session_id!r} is not known on any replica reached",
        param="session_id",
        code="session_not_found",
    )


async def _move_target(request: Request) -> str | None:
    """The optional `target_replica` of the move's JSON body (a replica id)."""
    body = await request.body()
    if not body:
        return None
    try:
        data = json.loads(body)
    except ValueError as e:
        raise APIError(400, f"the body is not JSON: {e}", code="invalid_json") from e
    if not isinstance(data, dict):
        raise APIError(400, f"body={quoted(data)} is invalid: allowed a JSON object, "
                       '{"target_replica": "<replica id>"} or {}', param="body", code="invalid_value")
    for field in data:
        if field != "target_replica":  # as every other route: a misspelt field is never ignored
            raise APIError(400, f"{field} is not a supported parameter: allowed target_replica",
                           param=field, code="unsupported_parameter")
    target = data.get("target_replica")
    if target is not None and not isinstance(target, str):
        raise APIError(400, f"target_replica={target!r} is invalid: allowed a replica id (string)",
                       param="target_replica")
    return target


def _router_core(handle: Any) -> Any:
    """The `RouterCore` of the model deployment's request router in this process, or None before
    the handle has routed anything. Ray Serve has no public way to reach a handle's router, so this
    walks its attributes (Serve 2.60: handle._router._asyncio_router.request_router._core)."""
    router = getattr(handle, "_router", None)
    router = getattr(router, "_asyncio_router", router)
    request_router = getattr(router, "_request_router", None)  # not the lazily-creating property
    return getattr(request_router, "_core", None)


def _choose_target(core: Any, session_id: str, client_id: str, target: str | None) -> tuple[str, str]:
    """(home, target): the given target if it is a live replica, else the least-loaded live replica
    other than the session's home. session_id: scoped; client_id: as the client named it."""
    state = core.state
    home = state.sessions.get(session_id)
    if home is None:
        raise _not_found(client_id)
    live = [rid for rid, replica in state.replicas.items() if replica.alive and not replica.draining]
    if target is not None and (target not in live or target == home):
        allowed = sorted(rid for rid in live if rid != home)
        raise APIError(400, f"target_replica={target!r} is invalid: allowed a live replica other than the "
                       f"session's home {home!r}: {allowed}", param="target_replica")
    if target is None:
        others = sorted((state.replicas[rid].load, rid) for rid in live if rid != home)
        if not others:
            raise APIError(409, f"session {client_id!r} cannot move: no other live replica",
                           param="session_id", code="no_other_replica")
        target = others[0][1]
    return home, target


def _session_body(info: Any) -> dict:
    """The replica's record as the client sees it: its own session id, not the scoped one."""
    body = {"object": "session", **vars(info)}
    body["session_id"] = split_scoped(info.session_id)[1]
    return body


async def _known_sessions(ctx: Any) -> set[str]:
    """Scoped ids of the sessions this gateway's router has homed, plus those on the replica reached
    (a session is homed by the router that first routed it: with several gateway replicas, each
    lists its own)."""
    core = _router_core(ctx.model)
    known = set(core.state.sessions) if core is not None else set()
    known.update(await ctx.model.list_sessions.remote())
    return known


def build_router(ctx: Any) -> APIRouter:
    router = APIRouter()

    def handle(scoped_id: str) -> Any:
        return ctx.model.options(session_id=scoped_id)

    def scoped(session_id: str, request: Request) -> str:
        check_session_id(session_id, "session_id")
        return request.state.tenant.scope(session_id)

    @router.get("/v1/sessions", responses=_ERRORS)
    async def list_sessions(request: Request) -> dict:
        """The caller's sessions; an admin key (auth.admin_api_keys) gets every tenant's."""
        ctx.authorize(request)
        await ctx.require_ready()
        tenant = request.state.tenant
        data = []
        for scoped_id in sorted(await _known_sessions(ctx)):
            if tenant.is_admin or tenant.owns(scoped_id):
                owner, session_id = split_scoped(scoped_id)
                data.append({"id": session_id, "object": "session", "tenant": owner})
        return {"object": "list", "data": data}

    @router.get("/v1/sessions/{session_id}", responses=_ERRORS)
    async def get_session(session_id: str, request: Request) -> dict:
        ctx.authorize(request)
        await ctx.require_ready()
        key = scoped(session_id, request)
        info = await handle(key).session_info.remote(key)
        if info is None:
            raise _not_found(session_id)
        return _session_body(info)

    @router.delete("/v1/sessions/{session_id}", responses=_ERRORS)
    async def delete_session(session_id: str, request: Request) -> dict:
        ctx.authorize(request)
        await ctx.require_ready()
        key = scoped(session_id, request)
        if not await handle(key).delete_session.remote(key):
            raise _not_found(session_id)
        return {"id": session_id, "object": "session", "deleted": True}

    @router.post("/v1/sessions/{session_id}/move", responses=_ERRORS)
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
        await ctx.require_ready()
        target = await _move_target(request)
        core = _router_core(ctx.model)  # None until this gateway has routed a request
        if core is None:
            raise _not_found(session_id)
        client_id, session_id = session_id, scoped(session_id, request)
        home, target = _choose_target(core, session_id, client_id, target)
        # The old home makes a running turn current in the service and forgets the session's pages,
        # and the router's view of them goes too, so that the prefix it held does not outweigh the
        # new home's affinity. The record in the service is current after every turn, so the new
        # home adopts the session on its next turn: index first, then the pages its indexer selects.
        dropped = await handle(session_id).release_session.remote(session_id)
        replica = core.state.replicas.get(home)
        if replica is not None:
            replica.cached.difference_update(dropped)
            for page_hash in dropped:
                replica.estimated.pop(page_hash, None)
        core.state.sessions[session_id] = target
        return {"id": client_id, "object": "session.move", "from_replica": home, "to_replica": target,
                "pages_released": len(dropped)}

    return router
