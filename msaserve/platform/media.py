"""The preprocess hook: image/video content parts → media items, on the Preprocess deployment.

The gateway never decodes media itself (docs/design.md §4): it sends the parts to the CPU Preprocess
deployment (`preprocess_deployment.py`, wrapping `msaserve.preprocess.Preprocessor`) and puts the
returned items into `GenerateRequest.media`. A deployment serving a text-only model has no
Preprocess deployment (or a model without a vision tower), and media parts get a 400 that says so.

The rendered prompt holds MEDIA_MARKER where each medium was; `encode_prompt` turns each into the
model's image/video token (one per medium: the engine expands it to the medium's patch count), or,
for items whose processor wrote their `placeholder_text` (MiniMax-M3), into that text.
"""

import re
from typing import Any

from ray.exceptions import RayActorError

from msaserve.platform.errors import APIError
from msaserve.platform.model_messages import ModelError
from msaserve.platform.openai_types import ChatMessage, ContentPart

SERVE_A_VISION_MODEL = (
    "To send images or video, serve a checkpoint with one: a directory whose config.json has a "
    "vision_config (e.g. model_type minimax_m3_vl: `msaserve serve --model <dir>`), or the 'tiny' preset."
)
MEDIA_MARKER = "<|msaserve_media|>"
"""Stands for one medium in the rendered prompt text; never sent to the model as text."""


_PIPELINE_PARAM = re.compile(r"content\[(\d+)\]")


def media_locations(messages: list[ChatMessage]) -> list[str]:
    """Where each media part sits in the request (`messages[2].content[1]`), in the order the prompt
    renderer collects them (`chat_prompt._text_of`: messages in order, parts in order)."""
    return [
        f"messages[{i}].content[{j}]"
        for i, message in enumerate(messages)
        if isinstance(message.content, list)
        for j, part in enumerate(message.content)
        if part.type != "text"
    ]


def request_param(param: str | None, parts: list[ContentPart], locations: list[str] | None) -> str | None:
    """The pipeline's `param` (relative to the list of media parts it was sent: `content[0].image_url`,
    `content` for the request as a whole) as the request's field: `messages[2].content[1].image_url.url`
    (every pipeline error about one part is about its URL or the bytes behind it), `messages`."""
    if locations is None or len(locations) != len(parts) or param is None:
        return param
    if param == "content":
        return "messages"
    match = _PIPELINE_PARAM.match(param)
    if match is None or int(match.group(1)) >= len(parts):
        return param
    index = int(match.group(1))
    return f"{locations[index]}.{parts[index].type}.url"


async def preprocess(
    ctx: Any, parts: list[ContentPart], info: Any, locations: list[str] | None = None
) -> list[object]:
    """Media items for `parts`; `locations` (from `media_locations`) lets a 4xx name the request's
    field (`messages[0].content[1].image_url.url`) rather than the part's place among the media."""
    if not parts:
        return []
    if ctx.preprocess is None or info.image_token_id is None:
        raise APIError(
            400,
            f"{parts[0].type} content parts need a vision model: {ctx.model_name!r} has no vision tower "
            f"(it accepts text only). {SERVE_A_VISION_MODEL}",
            param=f"{locations[0]}.type" if locations else "messages",
            code="unsupported_content",
        )
    try:
        result = await ctx.preprocess.process.remote([p.model_dump(exclude_none=True) for p in parts])
    except RayActorError:  # the replica died with this call on it; Serve replaces it
        raise APIError(
            503,
            "the media preprocessing replica stopped while handling this request; retry it",
            code="preprocess_unavailable",
            retry_after_s=1.0,
        ) from None
    if isinstance(result, ModelError):
        param = request_param(result.param, parts, locations)
        message = f"{param}: {result.message}" if param and param != result.param else result.message
        raise APIError(result.status, message, param=param, code=result.code)
    items, seconds = result
    ctx.metrics.observe("preprocess_latency_seconds", seconds, kind="request")
    return items


def encode_prompt(tokenizer: Any, prompt: str, items: list[Any], info: Any) -> tuple[list[int], int]:
    """(token ids with one image/video token per medium, the prompt length once the engine expands
    each to its placeholder count)."""
    if not items:
        return tokenizer.encode(prompt), 0
    pieces = prompt.split(MEDIA_MARKER)
    if len(pieces) != len(items) + 1:
        raise APIError(
            400, f"message text must not contain {MEDIA_MARKER!r} (it marks where media go)",
            param="messages", code="invalid_value",
        )
    if all(getattr(item, "placeholder_text", None) for item in items):
        # The model's processor wrote each medium's placeholder text (MiniMax-M3): the prompt is
        # tokenized whole with it, as transformers' processor does, and needs no expansion.
        rest = zip(items, pieces[1:], strict=True)
        text = pieces[0] + "".join(item.placeholder_text + piece for item, piece in rest)
        ids = tokenizer.encode(text)
        return ids, len(ids)
    ids = tokenizer.encode(pieces[0])
    for item, text in zip(items, pieces[1:], strict=True):
        ids.append(info.image_token_id if item.kind == "image" else info.video_token_id)
        ids += tokenizer.encode(text)
    expanded = len(ids) + sum(item.num_placeholder_tokens - 1 for item in items)
    return ids, expanded
