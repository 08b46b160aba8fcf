"""POST /v1/responses, GET /v1/responses/{id}, DELETE /v1/responses/{id} (the OpenAI Responses API).

A response is generated through the chat path (`responses_convert.chat_request` → `api_chat.start_chat`),
so tools, tool_choice, structured outputs (`text.format`) and sampling behave as in chat. With
`store` (the default) the response and its conversation are kept on the model replica that served
it (`response_store.py`) and `previous_response_id` continues it there: a response id
`resp_<conversation:16 hex><own:16 hex>` names its conversation, whose session id
(`responses-<conversation>`, tenant-scoped) routes every turn and lookup to that replica. Ids are
scoped to the caller's API key like sessions: another key gets 404. `store: false` keeps nothing:
such a response cannot be retrieved or continued.
"""

import re
import secrets
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from msaserve.engine.types import quoted
from msaserve.platform.api_chat import start_chat
from msaserve.platform.choices import merged, total_usage
from msaserve.platform.errors import APIError, bad_parameter
from msaserve.platform.generation import EventStream, Generation, closing, record_metrics
from msaserve.platform.openai_types import ChatCompletionRequest, ErrorResponse, Usage
from msaserve.platform.response_store import StoredResponse
from msaserve.platform.responses_convert import (
    as_responses_error,
    assistant_message,
    call_ids_of,
    chat_request,
    input_items,
    input_messages,
    output_items,
)
from msaserve.platform.responses_stream import ResponseEventWriter
from msaserve.platform.responses_types import (
    DeletedResponse,
    InputItemList,
    ResponseObject,
    ResponsesRequest,
    ResponseStreamEvent,
    ResponseUsage,
)
from msaserve.platform.sse_schema import event_stream_response
from msaserve.platform.tool_formats import tool_format_of
from msaserve.platform.tool_stream import tool_stream_parser
from msaserve.platform.tools import forced_name, parse_reply

ROUTE = "/v1/responses"
_ID = re.compile(r"^resp_([0-9a-f]{16})([0-9a-f]{16})$")
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 503)
}
_STREAM = event_stream_response(
    ResponseStreamEvent,
    "The response; with `stream: true`, its events instead (server-sent, each named by its type), "
    "the last one response.completed, response.incomplete or error.",
    named_events=True,
)


def _not_found(response_id: str, param: str) -> APIError:
    return APIError(404, f"response {response_id[:80]!r} is not found: it was not stored (store: false), "
                    "was deleted, or belongs to another API key", param=param, code="response_not_found")


def _session_of(conversation: str, request: Request) -> str:
    return request.state.tenant.scope("responses-" + conversation)


async def _load(ctx: Any, request: Request, response_id: str, param: str) -> StoredResponse:
    match = _ID.match(response_id)
    if match is None:
        raise _not_found(response_id, param)
    session = _session_of(match.group(1), request)
    handle = ctx.model.options(session_id=session)
    record = await handle.get_response.remote(request.state.tenant.scope(response_id))
    if record is None:
        raise _not_found(response_id, param)
    return record


def _usage(usage: Usage) -> ResponseUsage:
    cached = (usage.prompt_tokens_details or {}).get("cached_tokens", 0)
    return ResponseUsage(
        input_tokens=usage.prompt_tokens, input_tokens_details={"cached_tokens": cached},
        output_tokens=usage.completion_tokens, output_tokens_details={"reasoning_tokens": 0},
        total_tokens=usage.total_tokens,
    )


def _echo(body: ResponsesRequest, response_id: str) -> ResponseObject:
    """The response before its output: the request's settings as OpenAI echoes them."""
    fmt = body.text.format if body.text and body.text.format else None
    return ResponseObject(
        id=response_id, model=body.model, instructions=body.instructions,
        max_output_tokens=body.max_output_tokens, previous_response_id=body.previous_response_id,
        store=body.store, temperature=body.temperature, top_p=body.top_p,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        tool_choice=(body.tool_choice.model_dump() if hasattr(body.tool_choice, "model_dump")
                     else body.tool_choice or "auto"),
        tools=[t.model_dump(exclude_none=True) for t in body.tools or []],
        text={"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
        metadata=body.metadata or {}, user=body.user,
    )


class _Turn:
    """One response being made: its request, conversation and generation."""

    def __init__(self, body: ResponsesRequest, chat: ChatCompletionRequest, messages: list[dict],
                 conversation: str, session: str | None) -> None:
        self.body, self.chat, self.messages = body, chat, messages
        self.session = session
        self.response = _echo(body, f"resp_{conversation}{secrets.token_hex(8)}")
        self.gen: Generation | None = None
        self.prefix, self.known = "", set()

    def finish(self, usage: Usage, finish_reason: str | None) -> None:
        self.response.usage = _usage(usage)
        if finish_reason == "length":
            self.response.status = "incomplete"
            self.response.incomplete_details = {"reason": "max_output_tokens"}
        else:
            self.response.status = "completed"

    async def store(self, ctx: Any, request: Request) -> None:
        if not self.body.store or self.session is None:
            return
        record = StoredResponse(
            response=self.response.model_dump(mode="json"),
            messages=[*self.messages, assistant_message(self.response.output)],
            session_id=self.session,
            input_items=input_items(self.body),
        )
        handle = ctx.model.options(session_id=self.session)
        await handle.put_response.remote(request.state.tenant.scope(self.response.id), record)


def check_unsupported(body: ResponsesRequest) -> None:
    """OpenAI fields that generic clients may send empty for "none" (`include: []`): empty is served,
    a value that asks for something this server does not produce is a 400 naming it."""
    if body.include:
        raise bad_parameter("include", body.include, "an empty list or null (no includable output data "
                            "is produced)")
    if body.reasoning and any(value is not None for value in body.reasoning.values()):
        raise bad_parameter("reasoning", body.reasoning, "null, {} or null values (the served models have "
                            "no reasoning settings)")


async def _begin(ctx: Any, body: ResponsesRequest, request: Request, info: Any) -> _Turn:
    check_unsupported(body)
    if body.previous_response_id is not None:
        previous = await _load(ctx, request, body.previous_response_id, "previous_response_id")
        history, session = previous.messages, previous.session_id
        conversation = _ID.match(body.previous_response_id).group(1)  # type: ignore[union-attr]
    else:
        history, conversation = [], secrets.token_hex(8)
        session = _session_of(conversation, request) if body.store else None
    messages = history + input_messages(body, call_ids_of(history))
    turn = _Turn(body, chat_request(body, messages), messages, conversation, session)
    try:
        gens, turn.prefix, turn.known = await start_chat(ctx, turn.chat, request, info, session)
    except APIError as e:
        raise as_responses_error(e) from None
    turn.gen = gens[0]
    return turn


def build_router(ctx: Any) -> APIRouter:
    router = APIRouter()

    @router.post(ROUTE, response_model=ResponseObject, responses={200: _STREAM, **_ERRORS})
    async def create_response(body: ResponsesRequest, request: Request) -> Any:
        key, info = await ctx.admit(body, request)
        try:
            turn = await _begin(ctx, body, request, info)
        except BaseException:
            ctx.auth.limits.release(key)
            raise
        if body.stream:
            events = _stream(ctx, turn, request, info.tokenizer)
            assert turn.gen is not None
            return EventStream(events, closing([turn.gen], lambda: ctx.auth.limits.release(key)))
        try:
            return await _complete(ctx, turn, request, info.tokenizer)
        finally:
            ctx.auth.limits.release(key)

    @router.get(ROUTE + "/{response_id}", response_model=ResponseObject, responses=_ERRORS)
    async def get_response(response_id: str, request: Request) -> Any:
        ctx.authorize(request)
        await ctx.require_ready()
        return (await _load(ctx, request, response_id, "response_id")).response

    @router.get(ROUTE + "/{response_id}/input_items", response_model=InputItemList, responses=_ERRORS)
    async def list_input_items(response_id: str, request: Request, limit: int = 20,
                               order: str = "desc", after: str | None = None) -> Any:
        """The response's own input items (not those of the responses before it), newest first by
        default; `after` an item id to page on, as OpenAI's cursor."""
        ctx.authorize(request)
        if not 1 <= limit <= 100:
            raise APIError(400, f"limit={limit} is invalid: allowed 1 to 100", param="limit",
                           code="invalid_value")
        if order not in ("asc", "desc"):
            raise APIError(400, f"order={quoted(order)} is invalid: allowed 'asc' or 'desc'", param="order",
                           code="invalid_value")
        await ctx.require_ready()
        items = (await _load(ctx, request, response_id, "response_id")).input_items
        items = items if order == "asc" else items[::-1]
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise APIError(400, f"after={quoted(after)} is invalid: allowed the id of one of this "
                               "response's input items", param="after", code="invalid_value")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return InputItemList(data=page, first_id=page[0]["id"] if page else None,
                             last_id=page[-1]["id"] if page else None, has_more=len(items) > limit)

    @router.delete(ROUTE + "/{response_id}", response_model=DeletedResponse, responses=_ERRORS)
    async def delete_response(response_id: str, request: Request) -> Any:
        ctx.authorize(request)
        await ctx.require_ready()
        record = await _load(ctx, request, response_id, "response_id")
        handle = ctx.model.options(session_id=record.session_id)
        await handle.delete_response.remote(request.state.tenant.scope(response_id))
        return DeletedResponse(id=response_id)

    return router


async def _complete(ctx: Any, turn: _Turn, request: Request, tokenizer: Any) -> ResponseObject:
    assert turn.gen is not None
    texts, finish = [], None
    async for _, out in merged([turn.gen]):
        texts.append(out.text)
        finish = out.finish_reason
    record_metrics(ctx, turn.gen, ROUTE)
    text = turn.prefix + "".join(texts)
    content, calls = (parse_reply(text, turn.known, forced_name(turn.chat), tool_format_of(tokenizer))
                      if turn.known else (text, []))
    turn.response.output = output_items(content, calls, incomplete=finish == "length")
    turn.finish(total_usage([turn.gen]), finish)
    await turn.store(ctx, request)
    return turn.response


async def _stream(ctx: Any, turn: _Turn, request: Request, tokenizer: Any) -> AsyncIterator[str]:
    assert turn.gen is not None
    writer = ResponseEventWriter(turn.response)
    parser = tool_stream_parser(turn.known, turn.prefix, forced_name(turn.chat), tool_format_of(tokenizer))
    for line in writer.start():
        yield line
    try:
        finish = None
        async for _, out in merged([turn.gen]):
            events = parser.feed(out.text) + (parser.finish() if out.finished else [])
            for event in events:
                for line in writer.on_event(event):
                    yield line
            finish = out.finish_reason
        record_metrics(ctx, turn.gen, ROUTE)
        turn.finish(total_usage([turn.gen]), finish)
        lines = writer.finish(incomplete=finish == "length")
        await turn.store(ctx, request)
        for line in lines:
            yield line
    except APIError as e:
        code = e.code or e.type
        ctx.metrics.inc("stream_errors", model=ctx.model_name, route=ROUTE, code=code)
        yield writer.error(e.message, e.code, e.param)
    finally:
        turn.gen.close()
