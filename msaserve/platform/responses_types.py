"""The OpenAI Responses API bodies msaserve implements (`/v1/responses`), shaped as the `openai`
package's `types/responses` (Response, ResponseOutputMessage, ResponseFunctionToolCall, the stream
events). Requests forbid unknown fields, as the chat bodies do (`openai_types.py`); input items
accept the fields a Response's own output items carry, so `input=previous.output + [...]` works.
"""

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag
from pydantic.json_schema import SkipJsonSchema

from msaserve.platform.openai_types import _Request, _Response

# ----------------------------------------------------------------------------- requests


class InputText(_Request):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputMessage(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallItem(_Request):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=128)
    name: str
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_Request):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=128)
    output: str | list[InputText]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class UnknownItem(_Request):
    """Where an item of an unknown `type` goes: its `type` is the one error, listing every item type."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["message", "function_call", "function_call_output"]


_ITEM_TAGS = {
    "message": "Message", "function_call": "FunctionCall", "function_call_output": "FunctionCallOutput",
}


def _item_kind(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")
    return _ITEM_TAGS.get(kind, "Unknown") if isinstance(kind, str) else "Unknown"


InputItem = Annotated[
    Annotated[InputMessage, Tag("Message")]
    | Annotated[FunctionCallItem, Tag("FunctionCall")]
    | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutput")]
    | SkipJsonSchema[Annotated[UnknownItem, Tag("Unknown")]],
    Discriminator(_item_kind),
]
"""An item without `type` is a message (EasyInputMessage); one of another type (a string the API does
not know, or not a string: `[1]` is unhashable, so no lookup) goes to `UnknownItem`, whose error lists
every item type. Tags are capitalised so that error locations name the field (`input[0].content`),
not the union member (errors.param_path)."""


class FunctionTool(_Request):
    """The Responses tool shape: flat, not nested under `function` as in chat."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(_Request):
    type: Literal["function"]
    name: str


class TextFormat(_Request):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = Field(None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Request):
    format: TextFormat | None = None


MetadataKey = Annotated[str, Field(max_length=64)]
MetadataValue = Annotated[str, Field(max_length=512)]


class ResponsesRequest(_Request):
    model: str
    input: str | list[InputItem] = Field(description="Text (one user message) or input items.")
    instructions: str | None = Field(None, description="A system message; not carried to later turns.")
    previous_response_id: str | None = Field(None, description="Continue a stored response's conversation.")
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    store: bool = Field(True, description="false: not retrievable, cannot be continued.")
    stream: bool = False
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    metadata: dict[MetadataKey, MetadataValue] | None = Field(
        None, max_length=16, description="Up to 16 pairs (keys ≤ 64, values ≤ 512 characters, as OpenAI's), "
        "echoed back.",
    )
    truncation: Literal["disabled"] | None = Field(
        None, description="Only disabled: an input too long for the context is a 400."
    )
    user: str | None = None
    seed: int | None = Field(None, description="msaserve extension: same seed and request → same output.")
    include: list[str] | None = Field(
        None, description="Accepted empty or null only: no includable output data (logprobs, reasoning, "
        "tool results) is produced.",
    )
    reasoning: dict[str, Any] | None = Field(
        None, description="Accepted as null, {} or with null values only: the served models have no "
        "reasoning settings.",
    )


# ----------------------------------------------------------------------------- responses


class OutputText(_Response):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


class OutputMessage(_Response):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[OutputText] = Field(default_factory=list)


class OutputFunctionCall(_Response):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ResponseUsage(_Response):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(_Response):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["completed", "incomplete", "in_progress"] = "completed"
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, str] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputMessage | OutputFunctionCall] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: float | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


class InputItemList(_Response):
    """One page of a response's input items (`GET /v1/responses/{id}/input_items`)."""

    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


# ----------------------------------------------------------------------------- stream events
# The `data:` of each event of a /v1/responses stream (`responses_stream.ResponseEventWriter` writes
# them; the `event:` line repeats `type`). They document the stream in the OpenAPI schema, and the
# tests check the writer's events against them. Events of one shape share a model (`type` names the
# event), so the inlined OpenAPI schema holds each shape once.


class ResponseStateEvent(_Response):
    """The response as it stands: created and in progress first, completed or incomplete last."""

    type: Literal["response.created", "response.in_progress", "response.completed", "response.incomplete"]
    response: ResponseObject
    sequence_number: int


class ResponseOutputItemEvent(_Response):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputMessage | OutputFunctionCall
    sequence_number: int


class ResponseContentPartEvent(_Response):
    type: Literal["response.content_part.added", "response.content_part.done"]
    item_id: str
    output_index: int
    content_index: int
    part: OutputText
    sequence_number: int


class ResponseTextDeltaEvent(_Response):
    type: Literal["response.output_text.delta"]
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any]
    sequence_number: int


class ResponseTextDoneEvent(_Response):
    type: Literal["response.output_text.done"]
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any]
    sequence_number: int


class ResponseArgumentsDeltaEvent(_Response):
    type: Literal["response.function_call_arguments.delta"]
    item_id: str
    output_index: int
    delta: str
    sequence_number: int


class ResponseArgumentsDoneEvent(_Response):
    type: Literal["response.function_call_arguments.done"]
    item_id: str
    output_index: int
    arguments: str
    name: str
    sequence_number: int


class ResponseErrorEvent(_Response):
    """An error after the stream began (its headers are sent): the stream's last event."""

    type: Literal["error"]
    code: str | None
    message: str
    param: str | None
    sequence_number: int


ResponseStreamEvent = (
    ResponseStateEvent | ResponseOutputItemEvent | ResponseContentPartEvent | ResponseTextDeltaEvent
    | ResponseTextDoneEvent | ResponseArgumentsDeltaEvent | ResponseArgumentsDoneEvent | ResponseErrorEvent
)
