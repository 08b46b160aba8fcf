"""Responses API ↔ the chat path: a `ResponsesRequest` (plus the stored conversation it continues)
becomes a `ChatCompletionRequest` that `api_chat.start_chat` renders and generates — one generation
path for both APIs — and the reply's content and tool calls become output items.

    input "text"                          -> user message
    message item (role, text parts)       -> that message (developer → system, as in chat)
    function_call item(s)                 -> one assistant message with tool_calls (ids = call_id)
    function_call_output item             -> tool message (tool_call_id = call_id)
    instructions                          -> a leading system message, this response only
    tools (flat), tool_choice, text.format, max_output_tokens -> tools, tool_choice,
                                             response_format, max_completion_tokens
"""

import re
import secrets
from typing import Any

from pydantic import ValidationError

from msaserve.platform.errors import APIError
from msaserve.platform.openai_types import ChatCompletionRequest
from msaserve.platform.responses_types import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputMessage,
    InputText,
    OutputFunctionCall,
    OutputMessage,
    OutputText,
    ResponsesRequest,
)
from msaserve.platform.tools import ParsedToolCall

_CHAT_PARAMS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "response_format.json_schema": "text.format.schema",
    "response_format.json_schema.schema": "text.format.schema",
}
"""A chat parameter named in an error → the Responses parameter the client set."""


_CHAT_TOOL = re.compile(r"^tools\[(\d+)\]\.function(?=\.|$)")
"""Chat nests a tool's fields under `function`; the Responses API's tools are flat."""


def responses_param(param: str | None) -> str | None:
    if param is None:
        return None
    if _CHAT_TOOL.match(param):
        return _CHAT_TOOL.sub(r"tools[\1]", param)
    for chat, responses in sorted(_CHAT_PARAMS.items(), key=lambda kv: -len(kv[0])):
        if param == chat or param.startswith(chat + ".") or param.startswith(chat + "["):
            return responses + param[len(chat):]
    return param


def as_responses_error(error: APIError) -> APIError:
    renamed = responses_param(error.param)
    if renamed != error.param and error.param is not None:
        error.message = error.message.replace(error.param, renamed or "")
        error.param = renamed
    return error


def _text(content: str | list[InputText]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


_ITEM_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as the items OpenAI lists for it: text is one user message; each item gets
    an id (its own if it had one), a status, and its content as typed parts."""
    items: list[dict[str, Any]] = (
        [{"type": "message", "role": "user", "content": body.input}] if isinstance(body.input, str)
        else [item.model_dump(exclude_none=True) for item in body.input]
    )
    for item in items:
        kind = item.setdefault("type", "message")
        item.setdefault("id", f"{_ITEM_ID_PREFIX[kind]}_{secrets.token_hex(12)}")
        item.setdefault("status", "completed")
        if kind == "message" and isinstance(item["content"], str):
            part = "output_text" if item["role"] == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
    return items


def input_messages(body: ResponsesRequest, known_call_ids: set[str]) -> list[dict[str, Any]]:
    """The input as chat messages (ChatMessage dicts). `known_call_ids`: calls made earlier in the
    conversation; a function_call_output must answer one of those or of this input."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    messages: list[dict[str, Any]] = []
    call_ids = set(known_call_ids)
    for i, item in enumerate(body.input):
        if isinstance(item, InputMessage):
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            call_ids.add(item.call_id)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in call_ids:
                raise APIError(
                    400, f"input[{i}].call_id={item.call_id!r} answers no function call: allowed the "
                    "call_id of a function_call earlier in this input or in the previous response",
                    param=f"input[{i}].call_id", code="invalid_value",
                )
            messages.append({"role": "tool", "content": _text(item.output), "tool_call_id": item.call_id})
    return messages


def call_ids_of(messages: list[dict[str, Any]]) -> set[str]:
    return {call["id"] for m in messages for call in m.get("tool_calls") or []}


def _response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    fmt = body.text.format if body.text else None
    if fmt is None or fmt.type != "json_schema":
        return None if fmt is None else {"type": fmt.type}
    for field, value in (("name", fmt.name), ("schema", fmt.schema_)):
        if value is None:
            raise APIError(400, f"text.format.{field} is required when text.format.type is json_schema",
                           param=f"text.format.{field}", code="missing_required_parameter")
    schema = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict, "description": fmt.description}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


def _tool_choice(body: ResponsesRequest) -> Any:
    choice = body.tool_choice
    if choice is None or isinstance(choice, str):
        return choice
    return {"type": "function", "function": {"name": choice.name}}


def chat_request(body: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request for this response: instructions, then the conversation `messages`."""
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    if not system and not messages:
        raise APIError(400, "input is empty: allowed text or at least one input item", param="input",
                       code="invalid_value")
    tools = [
        {"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
        for t in body.tools or []
    ]
    data = {
        "model": body.model, "messages": system + messages, "tools": tools or None,
        "tool_choice": _tool_choice(body), "parallel_tool_calls": body.parallel_tool_calls,
        "max_completion_tokens": body.max_output_tokens, "temperature": body.temperature,
        "top_p": body.top_p, "seed": body.seed, "user": body.user, "response_format": _response_format(body),
    }
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in data.items() if v is not None})
    except ValidationError as e:
        first = e.errors()[0]
        raise APIError(400, f"the request cannot be served: {first.get('msg')}", param="input",
                       code="invalid_value") from None


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def output_items(content: str | None, calls: list[ParsedToolCall], incomplete: bool
                 ) -> list[OutputMessage | OutputFunctionCall]:
    items: list[OutputMessage | OutputFunctionCall] = []
    if content:
        status = "incomplete" if incomplete else "completed"
        items.append(OutputMessage(id=new_id("msg_"), status=status, content=[OutputText(text=content)]))
    items += [OutputFunctionCall(id=new_id("fc_"), call_id=c.id, name=c.name, arguments=c.arguments)
              for c in calls]
    return items


def assistant_message(output: list[OutputMessage | OutputFunctionCall]) -> dict[str, Any]:
    """The output as one assistant chat message (what the next turn's prompt renders)."""
    text = "".join(part.text for item in output if isinstance(item, OutputMessage) for part in item.content)
    calls = [{"id": item.call_id, "type": "function",
              "function": {"name": item.name, "arguments": item.arguments}}
             for item in output if isinstance(item, OutputFunctionCall)]
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return message
