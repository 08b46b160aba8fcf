"""POST /v1/completions (legacy text completions; prompt as text or token ids)."""

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from msaserve.engine.types import GenerateRequest
from msaserve.platform.errors import APIError, bad_parameter
from msaserve.platform.gateway_tenancy import session_of
from msaserve.platform.generation import (
    SSE_DONE,
    EventStream,
    Generation,
    TextOffsets,
    closing,
    fit_max_tokens,
    record_metrics,
    sampling_from,
    sse,
    start_generation,
    token_bytes,
    token_label,
    usage_of,
)
from msaserve.platform.openai_types import (
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionChunkChoice,
    CompletionLogprobs,
    CompletionRequest,
    ErrorResponse,
)
from msaserve.platform.sse_schema import event_stream_response

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 503)
}
_ROUTE = "/v1/completions"
_STREAM = event_stream_response(
    CompletionChunk | ErrorResponse,
    "The completion; with `stream: true`, server-sent events instead: a chunk per piece of text, "
    "then data: [DONE] (an error once the stream began is its last event, an error body).",
    ends_with_done=True,
)


def build_router(ctx: Any) -> APIRouter:
    router = APIRouter()

    @router.post(_ROUTE, response_model=Completion, responses={200: _STREAM, **_ERRORS})
    async def completions(body: CompletionRequest, request: Request) -> Any:
        key, info = await ctx.admit(body, request)
        try:
            gen = await _start(ctx, body, request, info)
        except BaseException:
            ctx.auth.limits.release(key)
            raise
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = _stream(ctx, gen, body, include_usage, info.tokenizer)
            return EventStream(events, closing([gen], lambda: ctx.auth.limits.release(key)))
        try:
            return await _complete(ctx, gen, body, info.tokenizer)
        finally:
            ctx.auth.limits.release(key)

    return router


def _prompt_ids(body: CompletionRequest, tokenizer: Any) -> list[int]:
    prompt: Any = body.prompt
    for kind, one in ((str, "string"), (list, "list of token ids")):  # a batch of one is that prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, kind) for p in prompt):
            if len(prompt) != 1:  # OpenAI's batch of prompts: one request per prompt here
                raise bad_parameter("prompt", f"a batch of {len(prompt)} prompts",
                                    f"one prompt: a string, a list of token ids or a list of one {one}")
            prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad_parameter("prompt", prompt, "a non-empty string")
        return tokenizer.encode(prompt)
    if not prompt:
        raise bad_parameter("prompt", prompt, "a non-empty string or list of token ids")
    vocab = tokenizer.vocab_size
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise bad_parameter("prompt", bad[0], f"token ids from 0 to {vocab - 1}")
    return list(prompt)


async def _start(ctx: Any, body: CompletionRequest, request: Request, info: Any) -> Generation:
    if body.echo:
        raise bad_parameter("echo", body.echo, "false (echo is not supported)")
    if body.suffix is not None:
        raise bad_parameter("suffix", body.suffix, "unset (suffix is not supported)")
    if body.n != 1:
        raise bad_parameter("n", body.n, "1 on /v1/completions (n > 1 is served by /v1/chat/completions)")
    top = body.logprobs or 0
    params, given = sampling_from(
        body, body.max_tokens, logprobs=body.logprobs is not None, top_logprobs=top, extra_stop=[],
        top_logprobs_param="logprobs",
    )
    token_ids = _prompt_ids(body, info.tokenizer)
    fit_max_tokens(params, given, len(token_ids), info, "prompt", "max_tokens")
    greq = GenerateRequest(
        request_id=request.state.request_id,
        prompt_token_ids=token_ids,
        sampling=params,
        session_id=session_of(request),
        cache_salt=request.state.tenant.cache_salt,
    )
    return await start_generation(ctx, greq)


def _logprobs(tokenizer: Any, outputs_logprobs: list, offsets: TextOffsets) -> CompletionLogprobs:
    result = CompletionLogprobs(top_logprobs=[])
    for lp in outputs_logprobs:
        result.tokens.append(token_label(tokenizer, lp.token_id))
        result.token_logprobs.append(lp.logprob)
        result.text_offset.append(offsets.add(token_bytes(tokenizer, lp.token_id)))
        assert result.top_logprobs is not None
        result.top_logprobs.append({token_label(tokenizer, t): v for t, v in lp.top})
    return result


async def _complete(ctx: Any, gen: Generation, body: CompletionRequest, tokenizer: Any) -> Completion:
    texts, all_logprobs, finish_reason = [], [], None
    async for out in gen.outputs():
        texts.append(out.text)
        all_logprobs += out.logprobs or []
        finish_reason = out.finish_reason
    record_metrics(ctx, gen, _ROUTE)
    logprobs = _logprobs(tokenizer, all_logprobs, TextOffsets()) if body.logprobs is not None else None
    return Completion(
        id="cmpl-" + gen.request.request_id,
        model=ctx.model_name,
        choices=[CompletionChoice(text="".join(texts), finish_reason=finish_reason, logprobs=logprobs)],
        usage=usage_of(gen.final_stats, len(gen.request.prompt_token_ids), gen.num_output_tokens),
    )


async def _stream(
    ctx: Any, gen: Generation, body: CompletionRequest, include_usage: bool, tokenizer: Any
) -> AsyncIterator[str]:
    cid = "cmpl-" + gen.request.request_id
    offsets = TextOffsets()  # across chunks: a character's tokens may arrive in two
    try:
        async for out in gen.outputs():
            logprobs = None if body.logprobs is None else _logprobs(tokenizer, out.logprobs or [], offsets)
            choice = CompletionChunkChoice(text=out.text, finish_reason=out.finish_reason, logprobs=logprobs)
            yield sse(CompletionChunk(id=cid, model=ctx.model_name, choices=[choice]))
        record_metrics(ctx, gen, _ROUTE)
        if include_usage:
            usage = usage_of(gen.final_stats, len(gen.request.prompt_token_ids), gen.num_output_tokens)
            yield sse(CompletionChunk(id=cid, model=ctx.model_name, choices=[], usage=usage))
        yield SSE_DONE
    except APIError as e:
        ctx.metrics.inc("stream_errors", model=ctx.model_name, route=_ROUTE, code=e.code or e.type)
        yield sse({"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}})
    finally:
        gen.close()
