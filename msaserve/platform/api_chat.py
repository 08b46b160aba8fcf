"""POST /v1/chat/completions (streaming and not, logprobs, tools, n choices, structured outputs)."""

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from msaserve.engine.types import GenerateRequest
from msaserve.platform import media
from msaserve.platform.chat_prompt import render_prompt
from msaserve.platform.choices import merged, start_choices, total_usage
from msaserve.platform.errors import APIError
from msaserve.platform.gateway_tenancy import session_of
from msaserve.platform.generation import (
    SSE_DONE,
    EventStream,
    Generation,
    closing,
    fit_max_tokens,
    logprob_entries,
    record_metrics,
    sampling_from,
    sse,
)
from msaserve.platform.openai_types import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChoiceLogprobs,
    DeltaFunctionCall,
    DeltaToolCall,
    ErrorResponse,
    ResponseFunctionCall,
    ResponseToolCall,
)
from msaserve.platform.sse_schema import event_stream_response
from msaserve.platform.structured_request import chat_grammar, required_tools
from msaserve.platform.tool_formats import tool_format_of
from msaserve.platform.tool_stream import ArgumentsDelta, CallStarted, Event, Text, tool_stream_parser
from msaserve.platform.tools import ToolFormat, forced_name, parse_reply

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 503)
}
_STREAM = event_stream_response(
    ChatCompletionChunk | ErrorResponse,
    "The chat completion; with `stream: true`, server-sent events instead: its chunks, then "
    "data: [DONE] (an error once the stream began is its last event, an error body).",
    ends_with_done=True,
)


def build_router(ctx: Any) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions", response_model=ChatCompletion, responses={200: _STREAM, **_ERRORS})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        key, info = await ctx.admit(body, request)
        try:
            gens, prefix, known_tools = await start_chat(ctx, body, request, info, session_of(request))
        except BaseException:
            ctx.auth.limits.release(key)
            raise
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = _stream(ctx, gens, body, prefix, known_tools, include_usage, info.tokenizer)
            return EventStream(events, closing(gens, lambda: ctx.auth.limits.release(key)))
        try:
            return await _complete(ctx, gens, body, prefix, known_tools, info.tokenizer)
        finally:
            ctx.auth.limits.release(key)

    return router


async def start_chat(
    ctx: Any, body: ChatCompletionRequest, request: Request, info: Any, session_id: str | None
) -> tuple[list[Generation], str, set[str]]:
    """(generations, one per choice; the assistant prefix in the prompt; the callable tool names).
    Shared by /v1/chat/completions and /v1/responses (which builds a chat request)."""
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    fmt = tool_format_of(info.tokenizer)
    grammar = chat_grammar(body, fmt)  # a required or named Hermes call is enforced by the grammar
    # A tool format without a call grammar (a template's own, e.g. MiniMax): forced by the prefix.
    prefix_forces_call = bool(required_tools(body)) and grammar is None
    params, given = sampling_from(
        body, max_tokens, logprobs=body.logprobs, top_logprobs=body.top_logprobs or 0,
        extra_stop=[fmt.close] if prefix_forces_call else [], grammar=grammar,
    )
    prompt, prefix, parts = render_prompt(info.tokenizer, body, use_prefix=prefix_forces_call)
    items = await media.preprocess(ctx, parts, info, media.media_locations(body.messages))
    token_ids, expanded = media.encode_prompt(info.tokenizer, prompt, items, info)
    chosen = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    fit_max_tokens(params, given, expanded or len(token_ids), info, "messages", chosen)
    greq = GenerateRequest(
        request_id=request.state.request_id,
        prompt_token_ids=token_ids,
        sampling=params,
        session_id=session_id,
        media=items,
        cache_salt=request.state.tenant.cache_salt,
    )
    known = {t.function.name for t in body.tools or []} if body.tool_choice != "none" else set()
    return await start_choices(ctx, greq, body.n), prefix, known


def _message(text: str, body: ChatCompletionRequest, known: set[str], finish_reason: str | None,
             fmt: ToolFormat) -> tuple[AssistantMessage, str | None]:
    content, calls = parse_reply(text, known, forced_name(body), fmt) if known else (text, [])
    if not calls:
        return AssistantMessage(content=content), finish_reason
    tool_calls = [
        ResponseToolCall(id=c.id, function=ResponseFunctionCall(name=c.name, arguments=c.arguments))
        for c in calls
    ]
    return AssistantMessage(content=content, tool_calls=tool_calls), _calls_reason(body, finish_reason)


def _calls_reason(body: ChatCompletionRequest, finish_reason: str | None) -> str:
    """"tool_calls"; but "length" when max_tokens cut the reply off after some whole calls (they are
    returned) — except under a named tool_choice, whose reply is always that one call."""
    return "length" if finish_reason == "length" and forced_name(body) is None else "tool_calls"


async def _complete(
    ctx: Any, gens: list[Generation], body: ChatCompletionRequest, prefix: str, known: set[str],
    tokenizer: Any,
) -> ChatCompletion:
    texts: list[list[str]] = [[] for _ in gens]
    logprobs: list[list] = [[] for _ in gens]
    finish: list[str | None] = [None] * len(gens)
    async for index, out in merged(gens):
        texts[index].append(out.text)
        if body.logprobs:
            logprobs[index] += logprob_entries(tokenizer, out.logprobs)
        finish[index] = out.finish_reason
    choices = []
    fmt = tool_format_of(tokenizer)
    for index, gen in enumerate(gens):
        record_metrics(ctx, gen, "/v1/chat/completions")
        message, reason = _message(prefix + "".join(texts[index]), body, known, finish[index], fmt)
        lp = ChoiceLogprobs(content=logprobs[index]) if body.logprobs else None
        choices.append(ChatChoice(index=index, message=message, finish_reason=reason, logprobs=lp))
    return ChatCompletion(
        id="chatcmpl-" + gens[0].request.request_id,
        model=ctx.model_name,
        choices=choices,
        usage=total_usage(gens),
    )


def _chat_deltas(events: list[Event]) -> list[ChatDelta]:
    """The chat deltas of reply events: content; a call's start (id, type, name — with its arguments
    when they came in the same batch, e.g. a call parsed whole); then its arguments in pieces."""
    deltas: list[ChatDelta] = []
    for i, event in enumerate(events):
        if isinstance(event, Text):
            deltas.append(ChatDelta(content=event.text))
        elif isinstance(event, CallStarted):
            after = events[i + 1] if i + 1 < len(events) else None
            joined = isinstance(after, ArgumentsDelta) and after.index == event.index
            function = DeltaFunctionCall(name=event.name, arguments=after.text if joined else "")
            deltas.append(ChatDelta(tool_calls=[DeltaToolCall(index=event.index, id=event.id, type="function",
                                                              function=function)]))
        elif isinstance(event, ArgumentsDelta) and not (
            i and isinstance(events[i - 1], CallStarted) and events[i - 1].index == event.index
        ):
            function = DeltaFunctionCall(arguments=event.text)
            deltas.append(ChatDelta(tool_calls=[DeltaToolCall(index=event.index, function=function)]))
    return deltas


async def _stream(
    ctx: Any,
    gens: list[Generation],
    body: ChatCompletionRequest,
    prefix: str,
    known: set[str],
    include_usage: bool,
    tokenizer: Any,
) -> AsyncIterator[str]:
    chunk_id = "chatcmpl-" + gens[0].request.request_id

    def chunk(index: int, delta: ChatDelta, finish: str | None = None, logprobs: Any = None) -> str:
        choice = ChatChunkChoice(index=index, delta=delta, finish_reason=finish, logprobs=logprobs)
        return sse(ChatCompletionChunk(id=chunk_id, model=ctx.model_name, choices=[choice]))

    fmt = tool_format_of(tokenizer)
    parsers = [tool_stream_parser(known, prefix, forced_name(body), fmt) for _ in gens]
    called = [False] * len(gens)
    for index in range(len(gens)):
        yield chunk(index, ChatDelta(role="assistant", content=""))
    try:
        async for index, out in merged(gens):
            events = parsers[index].feed(out.text) + (parsers[index].finish() if out.finished else [])
            called[index] = called[index] or any(isinstance(e, CallStarted) for e in events)
            lp = ChoiceLogprobs(content=logprob_entries(tokenizer, out.logprobs)) if body.logprobs else None
            deltas = _chat_deltas(events)
            if lp and not any(d.content is not None for d in deltas):
                yield chunk(index, ChatDelta(content=""), logprobs=lp)
                lp = None
            for delta in deltas:
                yield chunk(index, delta, logprobs=lp if delta.content is not None else None)
                lp = None if delta.content is not None else lp
            if out.finished:
                reason = _calls_reason(body, out.finish_reason) if called[index] else out.finish_reason
                yield chunk(index, ChatDelta(), finish=reason)
        for gen in gens:
            record_metrics(ctx, gen, "/v1/chat/completions")
        if include_usage:
            usage = total_usage(gens)
            yield sse(ChatCompletionChunk(id=chunk_id, model=ctx.model_name, choices=[], usage=usage))
        yield SSE_DONE
    except APIError as e:
        # Headers are sent already: report in the stream, as OpenAI does.
        code = e.code or e.type
        ctx.metrics.inc("stream_errors", model=ctx.model_name, route="/v1/chat/completions", code=code)
        yield sse({"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}})
    finally:
        for gen in gens:
            gen.close()
