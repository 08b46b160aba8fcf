"""The preprocess hook: image/video content parts → media items, on the Preprocess deployment.

The gateway never decodes media itself (DESIGN §4): it sends the parts to the CPU Preprocess
deployment (`preprocess_deployment.py`, wrapping `msaserve.preprocess.Preprocessor`) and puts the
returned items into `GenerateRequest.media`. A deployment serving a text-only model has no
Preprocess deployment, and media parts get a 400 that says so.
"""

from typing import Any

from msaserve.platform.errors import APIError
from msaserve.platform.model_messages import ModelError
from msaserve.platform.openai_types import ContentPart


async def preprocess(ctx: Any, parts: list[ContentPart]) -> list[object]:
    if not parts:
        return []
    if ctx.preprocess is None:
        raise APIError(
            400,
            f"{parts[0].type} content parts need a vision model; {ctx.model_name!r} accepts text only",
            param="messages",
            code="unsupported_content",
        )
    result = await ctx.preprocess.process.remote([p.model_dump(exclude_none=True) for p in parts])
    if isinstance(result, ModelError):
        raise APIError(result.status, result.message, param=result.param, code=result.code)
    items, seconds = result
    ctx.metrics.observe("preprocess_latency_seconds", seconds, kind="request")
    return items
