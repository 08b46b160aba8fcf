"""GET /v1/models and GET /health."""

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from msaserve.platform.errors import APIError, error_response
from msaserve.platform.openai_types import ErrorResponse, ModelCard, ModelList

_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse} for code in (401, 429, 503)}


def build_router(ctx: Any) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def models(request: Request) -> ModelList:
        ctx.authorize(request)
        info = await ctx.model_info()
        return ModelList(data=[ModelCard(id=ctx.model_name, max_model_len=info.max_model_len)])

    @router.get("/health", responses={503: {"model": ErrorResponse}})
    async def health(request: Request) -> Any:
        """200 when the model is loaded and serving; 503 (with Retry-After) while it warms up."""
        try:
            info = await ctx.require_ready()
        except APIError as e:
            return error_response(e, getattr(request.state, "request_id", None))
        return JSONResponse({"status": "ok", "model": info.name, "max_model_len": info.max_model_len})

    return router
