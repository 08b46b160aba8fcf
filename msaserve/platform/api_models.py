"""GET /v1/models and GET /v1/models/{model} (the `openai` client's `models.list()` / `models.retrieve()`)."""

from typing import Any

from fastapi import APIRouter, Request

from msaserve.platform.openai_types import ErrorResponse, ModelCard, ModelList

_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse} for code in (401, 429, 503)}
_RETRIEVE_ERRORS: dict[int | str, dict[str, Any]] = {**_ERRORS, 404: {"model": ErrorResponse}}


def build_router(ctx: Any) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def models(request: Request) -> ModelList:
        ctx.authorize(request)
        info = await ctx.model_info()
        return ModelList(data=[ModelCard(id=ctx.model_name, max_model_len=info.max_model_len)])

    @router.get("/v1/models/{model:path}", response_model=ModelCard, responses=_RETRIEVE_ERRORS)
    async def model(model: str, request: Request) -> ModelCard:
        # `:path`: served names hold slashes (msaserve/smollm2), which clients send unescaped
        ctx.authorize(request)
        ctx.check_model(model)
        info = await ctx.model_info()
        return ModelCard(id=ctx.model_name, max_model_len=info.max_model_len)

    return router
