"""Gateway side of one generation, shared by chat and text completions.

`start_generation` validates sampling, checks the context length, calls the model deployment with a
streaming handle and waits for its first item, so that engine refusals (bad parameter, queue full,
context too long) become HTTP errors before any response bytes are sent. `Generation` then yields
the engine's outputs; closing it (client gone, or done) cancels the model-side generator, which
aborts the request in the engine and frees its pages.
"""

import codecs
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from ray.exceptions import RayActorError
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from msaserve.engine.types import (
    ContextTooLong,
    GenerateOutput,
    GenerateRequest,
    GrammarSpec,
    InvalidParameter,
    RequestStats,
    SamplingParams,
    TokenLogprob,
)
from msaserve.platform.errors import APIError, bad_parameter, from_engine_error
from msaserve.platform.model_messages import ModelError, ModelInfo
from msaserve.platform.openai_types import TokenLogprobEntry, TopLogprob, Usage, _SamplingFields
from msaserve.platform.serve_calls import own_internal_id

logger = logging.getLogger("ray.serve.msaserve.gateway")


MAX_N = 16


def _logit_bias(body: _SamplingFields) -> dict[int, float]:
    bias: dict[int, float] = {}
    for key, value in (body.logit_bias or {}).items():
        try:
            bias[int(key)] = value
        except ValueError:
            raise bad_parameter("logit_bias", key, "token ids written as decimal strings") from None
    return bias


def sampling_from(
    body: _SamplingFields, max_tokens: int | None, logprobs: bool, top_logprobs: int, extra_stop: list[str],
    grammar: GrammarSpec | None = None, top_logprobs_param: str = "top_logprobs",
) -> tuple[SamplingParams, bool]:
    """SamplingParams from an OpenAI body; the bool says whether the client chose max_tokens.
    top_logprobs_param: the body's field that `top_logprobs` came from, which its errors name
    (legacy completions send it as `logprobs`)."""
    if not 1 <= body.n <= MAX_N:
        raise bad_parameter("n", body.n, f"1 to {MAX_N} choices")
    if body.stream_options is not None and not body.stream:  # as OpenAI: it would do nothing
        raise APIError(
            400, f"stream_options={body.stream_options.model_dump()} is invalid with stream: false: allowed "
            "only with stream: true (leave it out, or null, otherwise)", param="stream_options",
            code="invalid_value",
        )
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    params = SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else 1,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        seed=body.seed,
        stop=stop + extra_stop,
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        min_p=body.min_p,
        logit_bias=_logit_bias(body),
        grammar=grammar,
    )
    try:
        params.validate()
    except InvalidParameter as e:
        if e.param == "top_logprobs":
            raise bad_parameter(top_logprobs_param, e.value, e.allowed) from None
        raise from_engine_error(e) from None
    return params, max_tokens is not None


def fit_max_tokens(
    params: SamplingParams,
    given: bool,
    num_prompt_tokens: int,
    info: ModelInfo,
    prompt_param: str = "messages",
    max_tokens_param: str = "max_tokens",
) -> None:
    """No max_tokens → as many as fit; too many → 400 with the token counts (OpenAI's behaviour).
    The error names what to change: the prompt when it alone fills the context, else the
    `max_tokens_param` the client set (`max_tokens` or `max_completion_tokens`)."""
    limit = info.max_model_len or 0
    room = limit - num_prompt_tokens
    asked = params.max_tokens if given else 1
    if room >= 1 and asked <= room:
        if not given:
            params.max_tokens = room
        return
    error = from_engine_error(ContextTooLong(num_prompt_tokens, asked, limit))
    if room >= 1:  # the prompt fits: the output budget is what is too large
        error.param = max_tokens_param
        error.message += f"; allowed {max_tokens_param} ≤ {room} for this prompt"
    else:
        error.param = prompt_param
    raise error


@dataclass
class Generation:
    """The model deployment's stream for one request (first item already received)."""

    request: GenerateRequest
    first: GenerateOutput
    stream: Any
    """ray.serve DeploymentResponseGenerator of GenerateOutput."""
    start_time: float
    final_stats: RequestStats | None = None
    num_output_tokens: int = 0
    _done: bool = field(default=False)

    async def outputs(self) -> AsyncIterator[GenerateOutput]:
        try:
            item: Any = self.first
            while True:
                if isinstance(item, ModelError):
                    raise _api_error(item)
                self.num_output_tokens += len(item.token_ids)
                if item.finished:
                    self.final_stats = item.stats
                    self._done = True
                yield item
                if item.finished:
                    return
                item = await _next_from_replica(self.stream)
        finally:
            self.close()

    def close(self) -> None:
        """Cancel the model-side generator unless it finished (the engine then frees the pages)."""
        if not self._done:
            self._done = True
            self.stream.cancel()
            logger.info(
                "[%s] client went away or request failed: generation cancelled", self.request.request_id
            )


async def start_generation(ctx: Any, request: GenerateRequest, own_call_id: bool = False) -> Generation:
    """own_call_id: the call gets an internal id of its own (`serve_calls.own_internal_id`), for a
    call made while another call of the same HTTP request may still wait for a replica."""
    handle = ctx.model.options(stream=True)
    if request.session_id:
        handle = handle.options(session_id=request.session_id)
    start = time.perf_counter()
    if own_call_id:
        with own_internal_id():
            stream = handle.generate.remote(request)
    else:
        stream = handle.generate.remote(request)
    try:
        first = await _next_from_replica(stream)
    except StopAsyncIteration:
        raise APIError(500, "the model deployment ended the stream without output") from None
    if isinstance(first, ModelError):
        raise _api_error(first)
    return Generation(request=request, first=first, stream=stream, start_time=start)


REPLICA_LOST_RETRY_AFTER_S = 1.0


async def _next_from_replica(stream: Any) -> Any:
    """The next item; a model replica that dies (or becomes unreachable) mid-request becomes a 503
    the client may retry, instead of a stream that just stops (or a 500 naming a Ray exception)."""
    try:
        return await stream.__anext__()
    except RayActorError as e:
        logger.warning("model replica lost mid-request: %s", type(e).__name__)
        raise APIError(
            503,
            "the model replica serving this request stopped; retry the request (other replicas serve it)",
            code="replica_unavailable",
            retry_after_s=REPLICA_LOST_RETRY_AFTER_S,
        ) from None


def _api_error(e: ModelError) -> APIError:
    return APIError(e.status, e.message, param=e.param, code=e.code, retry_after_s=e.retry_after_s)


def usage_of(stats: RequestStats | None, num_prompt_tokens: int, num_output_tokens: int) -> Usage:
    prompt = stats.num_prompt_tokens if stats else num_prompt_tokens
    output = stats.num_output_tokens if stats else num_output_tokens
    cached = stats.num_cached_tokens if stats else 0
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=output,
        total_tokens=prompt + output,
        prompt_tokens_details={"cached_tokens": cached},
    )


def record_metrics(ctx: Any, gen: Generation, route: str) -> None:
    stats, name = gen.final_stats, ctx.model_name
    ctx.metrics.observe("e2e_latency_seconds", time.perf_counter() - gen.start_time, model=name, route=route)
    if stats is None:
        return
    if stats.ttft_s is not None:
        ctx.metrics.observe("ttft_seconds", stats.ttft_s, model=name)
    if stats.tpot_s is not None:
        ctx.metrics.observe("tpot_seconds", stats.tpot_s, model=name)
    ctx.metrics.inc("prompt_tokens", stats.num_prompt_tokens, model=name)
    ctx.metrics.inc("output_tokens", stats.num_output_tokens, model=name)


def token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The token's own bytes: part of a UTF-8 character for a token that splits one (its text is then
    U+FFFD, whose bytes are not the token's); the text's bytes for a tokenizer that cannot tell."""
    of = getattr(tokenizer, "token_bytes", None)
    return of(token_id) if of is not None else token_text(tokenizer, token_id).encode()


def token_label(tokenizer: Any, token_id: int) -> str:
    """The token as the legacy completions API names it: its text, or, for a token that is part of a
    UTF-8 character, its bytes as OpenAI writes them (`bytes:\\xf0\\x9f`), so that two such tokens
    (each U+FFFD as text) stay two keys of `top_logprobs`."""
    raw = token_bytes(tokenizer, token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class TextOffsets:
    """Each token's `text_offset` for the legacy completions API: the characters of the output text
    before it. A token that completes a character counts it only once whole (the three tokens of one
    emoji start at the same offset), so offsets stay within the text."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.chars = 0

    def add(self, raw: bytes) -> int:
        """The offset of a token of bytes `raw`, which then counts as text."""
        offset = self.chars
        self.chars += len(self._decoder.decode(raw))
        return offset


def logprob_entries(tokenizer: Any, logprobs: list[TokenLogprob] | None) -> list[TokenLogprobEntry]:
    entries = []
    for lp in logprobs or []:
        text = token_text(tokenizer, lp.token_id)
        top = [
            TopLogprob(token=token_text(tokenizer, tid), logprob=v, bytes=list(token_bytes(tokenizer, tid)))
            for tid, v in lp.top
        ]
        entries.append(TokenLogprobEntry(
            token=text, logprob=lp.logprob, bytes=list(token_bytes(tokenizer, lp.token_id)), top_logprobs=top
        ))
    return entries


def sse(payload: Any) -> str:
    """One server-sent event; payload is a pydantic model or a dict."""
    data = (
        payload.model_dump_json(exclude_none=True)
        if hasattr(payload, "model_dump_json")
        else json.dumps(payload)
    )
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class EventStream(StreamingResponse):
    """An SSE reply that ends its generations and frees the caller's slot as soon as it ends, however
    it ends: all sent, failed, or the client gone. A client that went away left the events generator
    suspended at a `yield` (or never started, when it left before the first event): its own `finally`
    ran only when the cyclic garbage collector got to it (seconds to minutes later; a never-started
    generator's never), so the engine generated on for nobody and the key's concurrency slot stayed
    taken. `on_close` runs exactly once, after the generator is closed; it must be idempotent with
    what the generator's `finally` does (`Generation.close` is)."""

    def __init__(self, events: AsyncGenerator[str, None], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self._events.aclose()
            finally:
                self._on_close()


def closing(gens: list[Generation], release: Callable[[], None]) -> Callable[[], None]:
    """`EventStream`'s on_close for `gens`: cancel those still running, then `release` the slot."""

    def close() -> None:
        try:
            for gen in gens:
                gen.close()
        finally:
            release()

    return close
