"""The served OpenAPI document describes the streamed answers (`stream: true`) of /v1/completions,
/v1/chat/completions and /v1/responses: their 200 has a `text/event-stream` entry whose events'
`data` is the JSON of the route's chunk (or event) models, and real streams conform to it, checked
with jsonschema and with schemathesis's own response validation (what
tests/reliability/test_reliability_fuzz.py runs). In process (the gateway app in front of a real
tiny engine, no Ray)."""

import json
from collections.abc import Iterator
from datetime import timedelta

import httpx
import jsonschema
import pytest
import schemathesis
from inprocess_app import InProcessGateway, inprocess_gateway

from msaserve.platform.openai_types import Completion
from msaserve.platform.responses_stream import ResponseEventWriter
from msaserve.platform.responses_types import ResponseObject
from msaserve.platform.sse_schema import inlined_schema
from msaserve.platform.tool_stream import ArgumentsDelta, CallFinished, CallStarted, Text

MODEL = "msaserve/tiny"
HELLO = [{"role": "user", "content": "hi"}]
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather"}}
PAYLOADS = {
    "/v1/completions": (["CompletionChunk", "ErrorResponse"], "Completion"),
    "/v1/chat/completions": (["ChatCompletionChunk", "ErrorResponse"], "ChatCompletion"),
    "/v1/responses": (
        ["ResponseStateEvent", "ResponseOutputItemEvent", "ResponseContentPartEvent",
         "ResponseTextDeltaEvent", "ResponseTextDoneEvent", "ResponseArgumentsDeltaEvent",
         "ResponseArgumentsDoneEvent", "ResponseErrorEvent"],
        "ResponseObject",
    ),
}
"""Per streaming route: the models of its events' data, and the JSON body's model."""
STREAMS = {
    "completions": ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4, "logprobs": 2,
                                        "stream_options": {"include_usage": True}}),
    "chat": ("/v1/chat/completions", {"model": MODEL, "messages": HELLO, "max_tokens": 4, "n": 2,
                                      "logprobs": True, "top_logprobs": 2,
                                      "stream_options": {"include_usage": True}}),
    "chat tool call": ("/v1/chat/completions", {
        "model": MODEL, "messages": HELLO, "max_tokens": 16, "temperature": 0, "tools": [CHAT_TOOL],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
    "responses": ("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 4}),
    "responses tool call": ("/v1/responses", {
        "model": MODEL, "input": "hi", "max_output_tokens": 16, "temperature": 0,
        "tools": [{"type": "function", "name": "get_weather"}],
        "tool_choice": {"type": "function", "name": "get_weather"}}),
}


@pytest.fixture(scope="module")
def gateway() -> Iterator[InProcessGateway]:
    with inprocess_gateway() as g:
        yield g


@pytest.fixture(scope="module")
def document(gateway) -> dict:
    return gateway.request("GET", "/openapi.json").json()


def event_item_schema(document: dict, path: str) -> dict:
    return document["paths"][path]["post"]["responses"]["200"]["content"]["text/event-stream"]["itemSchema"]


def data_schema(document: dict, path: str) -> dict:
    """The schema of one event's JSON data (`contentSchema`)."""
    data = event_item_schema(document, path)["properties"]["data"]
    json_data = next(d for d in data["anyOf"] if "contentSchema" in d) if "anyOf" in data else data
    assert json_data["contentMediaType"] == "application/json"
    return json_data["contentSchema"]


def events_of(text: str) -> list[dict[str, str]]:
    """The server-sent events of a stream as {field: value} (our events' lines never wrap)."""
    return [dict(line.split(": ", 1) for line in block.split("\n")) for block in text.split("\n\n") if block]


def sse_response(path: str, text: str) -> httpx.Response:
    response = httpx.Response(200, headers={"content-type": "text/event-stream; charset=utf-8"},
                              content=text.encode(), request=httpx.Request("POST", "http://gateway" + path))
    response.read()
    response.elapsed = timedelta(0)  # set by a client's send; schemathesis reads it
    return response


def conforms(document: dict, path: str, response: httpx.Response) -> str | None:
    """None if schemathesis finds `response` true to the document, else its failure."""
    operation = schemathesis.openapi.from_dict(document)[path]["POST"]
    try:
        operation.validate_response(response)
    except Exception as e:
        return str(e)
    return None


@pytest.mark.parametrize("path", sorted(PAYLOADS))
def test_streaming_route_documents_its_events_beside_the_json_body(document, path: str) -> None:
    chunk_models, json_model = PAYLOADS[path]
    content = document["paths"][path]["post"]["responses"]["200"]["content"]
    assert content["application/json"]["schema"] == {"$ref": f"#/components/schemas/{json_model}"}
    assert [m["title"] for m in data_schema(document, path)["anyOf"]] == chunk_models
    assert "$ref" not in json.dumps(event_item_schema(document, path))  # inlined: resolvable anywhere
    data = event_item_schema(document, path)["properties"]["data"]
    if path == "/v1/responses":  # every event is named after its data's type; no [DONE]
        event = event_item_schema(document, path)["properties"]["event"]
        assert "response.output_text.delta" in event["enum"] and "error" in event["enum"]
        assert "anyOf" not in data
    else:
        assert [d.get("const") for d in data["anyOf"]] == [None, "[DONE]"]


@pytest.mark.parametrize("case", sorted(STREAMS))
def test_a_real_stream_conforms_to_the_documented_events(gateway, document, case: str) -> None:
    path, body = STREAMS[case]
    response = gateway.request("POST", path, json={**body, "stream": True})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    events = events_of(response.text)
    validator = jsonschema.Draft202012Validator(data_schema(document, path))
    if path == "/v1/responses":
        assert events[-1]["event"] in ("response.completed", "response.incomplete")
    else:
        assert events[-1] == {"data": "[DONE]"} and all(e["data"] != "[DONE]" for e in events[:-1])
        events = events[:-1]
    for event in events:
        data = json.loads(event["data"])
        validator.validate(data)
        assert event.get("event", "message") == data.get("type", "message")
    assert conforms(document, path, response) is None


def test_a_streamed_completion_chunk_is_not_a_whole_completion(gateway) -> None:
    """Why /v1/completions documents its own chunk model: a chunk is sent without its None fields, so
    its choice lacks the `finish_reason` that a whole Completion requires (null or not)."""
    response = gateway.request("POST", "/v1/completions", json={**STREAMS["completions"][1], "stream": True})
    first = json.loads(events_of(response.text)[0]["data"])
    assert "finish_reason" not in first["choices"][0]
    with pytest.raises(jsonschema.ValidationError, match="finish_reason"):
        jsonschema.validate(first, inlined_schema(Completion))


def test_every_responses_event_the_writer_makes_conforms(document) -> None:
    """The writer's events for text, a call (its arguments in pieces) and the end, cut off or not,
    and its error event: all of them, not only those a tiny model happens to stream."""
    validator = jsonschema.Draft202012Validator(data_schema(document, "/v1/responses"))
    for incomplete in (False, True):
        writer = ResponseEventWriter(ResponseObject(id="resp_1", model=MODEL))
        lines = writer.start()
        for event in (Text("It is "), Text("sunny"), CallStarted(0, "call_1", "get_weather"),
                      ArgumentsDelta(0, '{"city": '), ArgumentsDelta(0, '"Oslo"}'),
                      CallFinished(0, '{"city": "Oslo"}')):
            lines += writer.on_event(event)
        writer.response.status = "incomplete" if incomplete else "completed"
        lines += [*writer.finish(incomplete), writer.error("engine failed", "engine_error", None)]
        stream = "".join(lines)
        kinds = [e["event"] for e in events_of(stream)]
        assert {"response.output_text.delta", "response.function_call_arguments.delta",
                "response.function_call_arguments.done", "response.content_part.done", "error"} <= set(kinds)
        for event in events_of(stream):
            validator.validate(json.loads(event["data"]))
        assert conforms(document, "/v1/responses", sse_response("/v1/responses", stream)) is None


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_an_error_in_a_completion_stream_conforms(document, path: str) -> None:
    """A stream's error after its headers went out is its last event, an error body (as the routes
    write it: json.dumps of the error, param and code null when unset), with no [DONE]."""
    error = {"error": {"message": "engine failed", "type": "server_error", "param": None, "code": None}}
    assert conforms(document, path, sse_response(path, f"data: {json.dumps(error)}\n\n")) is None


CHUNK = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": MODEL,
         "choices": [{"index": 0, "text": "a"}]}
NOT_SENT = {
    "chunk with a null id": (
        "/v1/completions", f"data: {json.dumps({**CHUNK, 'id': None})}\n\ndata: [DONE]\n\n"
    ),
    "text data": ("/v1/completions", "data: hello\n\n"),
    "chat chunk of the wrong object": ("/v1/chat/completions", f"data: {json.dumps(CHUNK)}\n\n"),
    "[DONE] in a responses stream": ("/v1/responses", "event: response.created\ndata: [DONE]\n\n"),
    "unnamed responses event": (
        "/v1/responses",
        'data: {"type": "error", "code": null, "message": "m", "param": null, "sequence_number": 0}\n\n',
    ),
    "unknown responses event": (
        "/v1/responses",
        'event: error\ndata: {"type": "oops", "code": null, "message": "m", "param": null, '
        '"sequence_number": 0}\n\n',
    ),
}


@pytest.mark.parametrize("case", sorted(NOT_SENT))
def test_the_documented_events_refuse_what_the_routes_never_send(document, case: str) -> None:
    """The stream schema is not loose: events unlike the routes' own fail schemathesis's check."""
    path, stream = NOT_SENT[case]
    failure = conforms(document, path, sse_response(path, stream))
    assert failure is not None and "SSE" in failure, failure
