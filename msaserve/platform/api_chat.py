"""POST /v1/chat/completions (streaming and not, logprobs, tools)."""

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from msaserve.engine.types import GenerateRequest
from msaserve.platform import media
from msaserve.platform.chat_prompt import render_prompt
from msaserve.platform.errors import APIError
from msaserve.platform.generation import (
    SSE_DONE,
    Generation,
    fit_max_tokens,
    logprob_entries,
    record_metrics,
    sampling_from,
    sse,
    start_generation,
    usage_of,
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
    DeltaToolCall,
    ErrorResponse,
    ResponseFunctionCall,
    ResponseToolCall,
)
from msaserve.platform.tool_formats import tool_format_of
from msaserve.platform.tools import StreamingToolParser, forced_name, parse_reply

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 503)
}


def build_router(ctx: Any) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions", response_model=ChatCompletion, responses=_ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        key = ctx.authorize(request)
        ctx.check_model(body.model)
        info = await ctx.require_ready()
        ctx.auth.limits.acquire(key)
        try:
            gen, prefix, known_tools = await _start(ctx, body, request, info)
        except BaseException:
            ctx.auth.limits.release(key)
            raise
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = _stream(ctx, gen, body, prefix, known_tools, include_usage, info.tokenizer)
            return StreamingResponse(_released(events, ctx, key), media_type="text/event-stream")
        try:
            return await _complete(ctx, gen, body, prefix, known_tools, info.tokenizer)
        finally:
            ctx.auth.limits.release(key)

    return router


async def _released(events: AsyncIterator[str], ctx: Any, key: str) -> AsyncIterator[str]:
    try:
        async for event in events:
            yield event
    finally:
        ctx.auth.limits.release(key)


async def _start(ctx: Any, body: ChatCompletionRequest, request: Request, info: Any) -> tuple:
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    prefix_forces_call = body.tools and body.tool_choice not in (None, "none", "auto")
    params, given = sampling_from(
        body,
        max_tokens,
        logprobs=body.logprobs,
        top_logprobs=body.top_logprobs or 0,
        extra_stop=[tool_format_of(info.tokenizer).close] if prefix_forces_call else [],
    )
    prompt, prefix, parts = render_prompt(info.tokenizer, body)
    items = await media.preprocess(ctx, parts, info)
    token_ids, expanded = media.encode_prompt(info.tokenizer, prompt, items, info)
    fit_max_tokens(params, given, expanded or len(token_ids), info)
    greq = GenerateRequest(
        request_id=request.state.request_id,
        prompt_token_ids=token_ids,
        sampling=params,
        session_id=request.headers.get("x-session-id") or None,
        media=items,
    )
    known = {t.function.name for t in body.tools or []} if body.tool_choice != "none" else set()
    return await start_generation(ctx, greq), prefix, known


async def _complete(
    ctx: Any, gen: Generation, body: ChatCompletionRequest, prefix: str, known: set[str], tokenizer: Any
) -> ChatCompletion:
    texts: list[str] = []
    logprobs = []
    finish_reason = None
    async for out in gen.outputs():
        texts.append(out.text)
        if body.logprobs:
            logprobs += logprob_entries(tokenizer, out.logprobs)
        finish_reason = out.finish_reason
    record_metrics(ctx, gen, "/v1/chat/completions")
    text = prefix + "".join(texts)
    fmt = tool_format_of(tokenizer)
    content, calls = parse_reply(text, known, forced_name(body), fmt) if known else (text, [])
    tool_calls = None
    if calls:
        finish_reason = "tool_calls"
        tool_calls = [
            ResponseToolCall(id=c.id, function=ResponseFunctionCall(name=c.name, arguments=c.arguments))
            for c in calls
        ]
    message = AssistantMessage(content=content, tool_calls=tool_calls)
    return ChatCompletion(
        id="chatcmpl-" + gen.request.request_id,
        model=ctx.model_name,
        choices=[
            ChatChoice(
                message=message,
                finish_reason=finish_reason,
                logprobs=ChoiceLogprobs(content=logprobs) if body.logprobs else None,
            )
        ],
        usage=usage_of(gen.final_stats, len(gen.request.prompt_token_ids), gen.num_output_tokens),
    )


async def _stream(
    ctx: Any,
    gen: Generation,
    body: ChatCompletionRequest,
    prefix: str,
    known: set[str],
    include_usage: bool,
    tokenizer: Any,
) -> AsyncIterator[str]:
    chunk_id = "chatcmpl-" + gen.request.request_id

    def chunk(delta: ChatDelta, finish: str | None = None, logprobs: Any = None) -> str:
        choice = ChatChunkChoice(delta=delta, finish_reason=finish, logprobs=logprobs)
        return sse(ChatCompletionChunk(id=chunk_id, model=ctx.model_name, choices=[choice]))

    fmt = tool_format_of(tokenizer)
    parser = StreamingToolParser(known, prefix, forced_name(body), fmt) if known else None
    yield chunk(ChatDelta(role="assistant", content=""))
    finish_reason = None
    try:
        async for out in gen.outputs():
            text = parser.feed(out.text) if parser else out.text
            lp = ChoiceLogprobs(content=logprob_entries(tokenizer, out.logprobs)) if body.logprobs else None
            if text or lp:
                yield chunk(ChatDelta(content=text), logprobs=lp)
            finish_reason = out.finish_reason
        if parser:
            rest, calls = parser.finish()
            if rest:
                yield chunk(ChatDelta(content=rest))
            if calls:
                finish_reason = "tool_calls"
                deltas = [
                    DeltaToolCall(
                        index=i,
                        id=c.id,
                        type="function",
                        function=ResponseFunctionCall(name=c.name, arguments=c.arguments),
                    )
                    for i, c in enumerate(calls)
                ]
                yield chunk(ChatDelta(tool_calls=deltas))
        yield chunk(ChatDelta(), finish=finish_reason)
        record_metrics(ctx, gen, "/v1/chat/completions")
        if include_usage:
            usage = usage_of(gen.final_stats, len(gen.request.prompt_token_ids), gen.num_output_tokens)
            yield sse(ChatCompletionChunk(id=chunk_id, model=ctx.model_name, choices=[], usage=usage))
        yield SSE_DONE
    except APIError as e:
        # Headers are sent already: report in the stream, as OpenAI does.
        code = e.code or e.type
        ctx.metrics.inc("stream_errors", model=ctx.model_name, route="/v1/chat/completions", code=code)
        yield sse({"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}})
    finally:
        gen.close()
