"""GET /v1/models."""

from typing import Any

from fastapi import APIRouter, Request

from msaserve.platform.openai_types import ErrorResponse, ModelCard, ModelList

_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse} for code in (401, 429, 503)}


def build_router(ctx: Any) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def models(request: Request) -> ModelList:
        ctx.authorize(request)
        info = await ctx.model_info()
        return ModelList(data=[ModelCard(id=ctx.model_name, max_model_len=info.max_model_len)])

    return router
