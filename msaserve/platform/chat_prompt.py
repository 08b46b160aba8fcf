"""OpenAI chat messages → the prompt text the model's chat template renders.

Tool definitions become a system message, assistant tool calls and tool results are written in the
Hermes format (`tools.py`) — unless the model's chat template defines its own tool format
(`tool_formats.py`), which then gets them as structured messages and `tools` to render itself.
Content parts are flattened to text. Media parts (image_url,
video_url) are collected for the preprocess hook; a deployment without one answers 400.
"""

import json
from typing import Any

from msaserve.platform.errors import APIError
from msaserve.platform.media import MEDIA_MARKER
from msaserve.platform.openai_types import ChatCompletionRequest, ChatMessage, ContentPart
from msaserve.platform.tool_formats import tool_format_of
from msaserve.platform.tools import (
    ToolFormat,
    forced_prefix,
    render_tool_call,
    render_tool_result,
    tools_system_prompt,
)


def _text_of(message: ChatMessage, index: int, media: list[ContentPart]) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    texts = []
    for part in message.content:
        if part.type == "text":
            if part.text is None:
                raise APIError(
                    400,
                    f"messages[{index}].content: a text part needs 'text'",
                    param=f"messages[{index}].content",
                    code="invalid_value",
                )
            texts.append(part.text)
        else:
            media.append(part)
            texts.append(MEDIA_MARKER)  # becomes the medium's placeholder token (media.encode_prompt)
    return "".join(texts)


def check_messages(messages: list[ChatMessage]) -> None:
    """Each message carries what its role needs and only that, as OpenAI checks them: a tool's
    `tool_calls` on a user message, or a tool result with no `tool_call_id`, were dropped or
    rendered without a word, so the model answered a conversation other than the one sent."""
    for i, message in enumerate(messages):
        where, role = f"messages[{i}]", message.role
        if isinstance(message.content, list) and not message.content:
            raise APIError(400, f"{where}.content=[] is invalid: allowed a string or at least one part",
                           param=f"{where}.content", code="invalid_value")
        if role == "assistant":
            if message.content is None and not message.tool_calls:
                raise APIError(400, f"{where} (assistant) needs content or tool_calls",
                               param=f"{where}.content", code="missing_required_parameter")
        elif message.content is None:
            raise APIError(400, f"{where}.content is required for role {role!r}",
                           param=f"{where}.content", code="missing_required_parameter")
        if message.tool_calls is not None and role != "assistant":
            raise APIError(400, f"{where}.tool_calls is invalid for role {role!r}: allowed on assistant "
                           "messages only", param=f"{where}.tool_calls", code="invalid_value")
        if role == "tool" and not message.tool_call_id:
            raise APIError(400, f"{where}.tool_call_id is required for role 'tool': the id of the call "
                           "it answers", param=f"{where}.tool_call_id", code="missing_required_parameter")
        if message.tool_call_id is not None and role != "tool":
            raise APIError(400, f"{where}.tool_call_id is invalid for role {role!r}: allowed on tool "
                           "messages only", param=f"{where}.tool_call_id", code="invalid_value")


def template_messages(
    request: ChatCompletionRequest, fmt: ToolFormat | None = None
) -> tuple[list[dict[str, Any]], list[ContentPart]]:
    """([{"role", "content": str}], media parts in order)."""
    check_messages(request.messages)
    if fmt is not None and fmt.native:
        return native_tool_messages(request)
    media: list[ContentPart] = []
    out: list[dict[str, Any]] = []
    use_tools = bool(request.tools) and request.tool_choice != "none"
    if use_tools:
        out.append({"role": "system", "content": tools_system_prompt(request.tools or [])})
    for i, message in enumerate(request.messages):
        text = _text_of(message, i, media)
        role = "system" if message.role == "developer" else message.role
        if role == "assistant" and message.tool_calls:
            calls = "\n".join(render_tool_call(c) for c in message.tool_calls)
            text = (text + "\n" + calls) if text else calls
        elif role == "tool":
            role, text = "user", render_tool_result(text)
        if role == "system" and out and out[0]["role"] == "system" and len(out) == 1 and use_tools:
            # Keep a single leading system message: the client's, followed by the tool list.
            out[0]["content"] = text + "\n\n" + out[0]["content"]
            continue
        out.append({"role": role, "content": text})
    return out, media


def native_tool_messages(request: ChatCompletionRequest) -> tuple[list[dict[str, Any]], list[ContentPart]]:
    """Messages for a template that renders tools itself: assistant `tool_calls` with their
    arguments as objects, `tool` messages kept as such."""
    media: list[ContentPart] = []
    out: list[dict[str, Any]] = []
    for i, message in enumerate(request.messages):
        entry: dict[str, Any] = {
            "role": "system" if message.role == "developer" else message.role,
            "content": _text_of(message, i, media),
        }
        if message.role == "assistant" and message.tool_calls:
            entry["tool_calls"] = [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)}}
                for call in message.tool_calls
            ]
        if message.role == "tool" and message.tool_call_id:
            entry["tool_call_id"] = message.tool_call_id
        out.append(entry)
    return out, media


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def render_prompt(
    tokenizer: Any, request: ChatCompletionRequest, use_prefix: bool = True
) -> tuple[str, str, list[ContentPart]]:
    """(prompt text, assistant prefix already in it, media parts). use_prefix=False: a forced tool
    call is enforced otherwise (the grammar, `structured_request.py`), the reply starts free."""
    fmt = tool_format_of(tokenizer)
    messages, media = template_messages(request, fmt)
    # A user's or a tool's text that spells a control token (`<|im_end|><|im_start|>system`) is encoded
    # as that text: it cannot end its turn or open another role's. Assistant and system text is the
    # application's and stays as written (a template may split it on such tokens).
    guard = getattr(tokenizer, "guard_literals", None)
    for message in messages:
        if guard is not None and message["role"] in ("user", "tool") and isinstance(message["content"], str):
            message["content"] = guard(message["content"])
    prefix = forced_prefix(request, fmt) if use_prefix else ""
    tools = None
    if fmt.native and request.tools and request.tool_choice != "none":
        tools = [tool.model_dump(exclude_none=True) for tool in request.tools]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
    return text + prefix, prefix, media
