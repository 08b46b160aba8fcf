"""OpenAI-compatible request and response bodies (the subset msaserve implements).

Requests forbid unknown fields, so a misspelt or unsupported parameter is a 400 that names it rather
than being silently ignored, and take each value in its own JSON type (strict): "yes" is not a
boolean, "5" or true not an integer, "0.5" not a number (an integer is a number), as OpenAI answers.
Responses are plain pydantic models (they document the OpenAPI schema).
"""

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


# ----------------------------------------------------------------------------- requests


class ImageURL(_Request):
    url: str = Field(description="data: URL, or http(s):// / file:// when the server allows them.")
    detail: Literal["auto", "low", "high"] | None = None


class VideoURL(_Request):
    url: str


class ContentPart(_Request):
    type: Literal["text", "image_url", "video_url"]
    text: str | None = None
    image_url: ImageURL | None = None
    video_url: VideoURL | None = None


class FunctionCall(_Request):
    name: str
    arguments: str = Field(description="JSON-encoded arguments, as the model wrote them.")


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(_Request):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="JSON Schema of the arguments.")
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class StreamOptions(_Request):
    include_usage: bool = False


class JSONSchemaFormat(_Request):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] = Field(
        default_factory=dict, alias="schema", description="JSON Schema the output must satisfy."
    )
    strict: bool | None = Field(
        None, description="true: a keyword the grammar library cannot enforce is a 400; otherwise ignored."
    )


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema", "regex", "grammar"] = Field(
        "text",
        description="text, json_object, json_schema (with json_schema); msaserve extensions: regex "
        "(with regex) and grammar (a Lark grammar in grammar, llguidance's dialect).",
    )
    json_schema: JSONSchemaFormat | None = None
    regex: str | None = Field(None, max_length=10_000, description="type=regex: the whole output matches it.")
    grammar: str | None = Field(None, max_length=100_000, description="type=grammar: Lark grammar text.")


class _SamplingFields(_Request):
    """Sampling parameters shared by chat and text completions. Ranges are checked by
    `SamplingParams.validate()` so that both endpoints report them the same way."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, description="0.0 to 2.0 (0 = greedy); default 1.0.")
    top_p: float | None = Field(None, description="Greater than 0.0 and at most 1.0; default 1.0.")
    top_k: int | None = Field(None, description="msaserve extension: 0 (off) or a positive integer.")
    max_tokens: int | None = Field(None, description="Output tokens; default: up to the context length.")
    stop: str | list[str] | None = Field(None, description="Up to 16 strings that end the output.")
    stop_token_ids: list[int] | None = Field(
        None, description="msaserve extension (as vLLM's): token ids that end the output, not part of it."
    )
    seed: int | None = Field(None, description="Same seed and request → same output.")
    n: int = Field(1, description="Choices to generate, 1 to 16; they share the prompt's cached pages.")
    presence_penalty: float = Field(0.0, description="-2.0 to 2.0, once per token already in the output.")
    frequency_penalty: float = Field(0.0, description="-2.0 to 2.0, per occurrence in the output.")
    repetition_penalty: float = Field(
        1.0, description="msaserve extension: greater than 0 and at most 2 (1 = off), over prompt and output."
    )
    min_p: float = Field(0.0, description="msaserve extension: 0.0 to 1.0, relative to the top token.")
    logit_bias: dict[str, float] | None = Field(
        None, description="Token id (as a string) → bias from -100 to 100 added to its logit."
    )
    ignore_eos: bool = Field(False, description="msaserve extension: keep going past end-of-sequence.")
    user: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(
        None, description="Preferred over max_tokens when both are set."
    )
    logprobs: bool = False
    top_logprobs: int | None = Field(None, description="0 to 20; needs logprobs=true.")
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="Text, or token ids; a list of one string or of one list of token ids."
    )
    logprobs: int | None = Field(None, description="0 to 20 alternatives per token (legacy completions).")
    echo: bool = Field(False, description="Only false is supported.")
    suffix: str | None = Field(None, description="Not supported (must be unset).")


# ----------------------------------------------------------------------------- responses


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobEntry(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(_Response):
    content: list[TokenLogprobEntry] | None = None


class ResponseFunctionCall(_Response):
    name: str
    arguments: str


class ResponseToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ResponseToolCall] | None = None


class ChatChoice(_Response):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class DeltaFunctionCall(_Response):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Response):
    """The first delta of a call has id, type and function.name; later ones add arguments text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatDelta(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(_Response):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class Completion(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class CompletionChunkChoice(CompletionChoice):
    """A choice in one streamed chunk of /v1/completions. Chunks are sent without their None
    fields, so `finish_reason` is absent until the choice's last chunk: optional here, where a whole
    `CompletionChoice` always has it (null or not)."""

    finish_reason: str | None = None


class CompletionChunk(Completion):
    """One `data:` event of a /v1/completions stream, in the `Completion` shape: the choice's new
    text, or, last with `stream_options.include_usage`, no choices and the usage."""

    choices: list[CompletionChunkChoice]


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "msaserve"
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    error: ErrorDetail
