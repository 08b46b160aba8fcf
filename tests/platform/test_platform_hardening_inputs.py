"""Issue 26, items 1, 6 and 8: careless and hostile inputs get a 4xx that names the field, never a
500; and every 5xx is counted. In process (the gateway app in front of a real tiny engine, no Ray)."""

import json
from collections.abc import Iterator

import pytest
from inprocess_app import InProcessGateway, inprocess_gateway

MODEL = "msaserve/tiny"


@pytest.fixture(scope="module")
def gateway() -> Iterator[InProcessGateway]:
    with inprocess_gateway() as g:
        yield g


def post_raw(gateway: InProcessGateway, path: str, raw: str):
    return gateway.request("POST", path, content=raw.encode(), headers={"content-type": "application/json"})


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


# ----------------------------------------------------------------------------- item 1: lone surrogates

LONE_SURROGATE_BODIES = {
    # (path, raw JSON: `\ud800` stays a JSON escape, which Python decodes to a lone surrogate)
    "message": ("/v1/chat/completions",
                '{"model":"msaserve/tiny","messages":[{"role":"user","content":"\\ud800"}],"max_tokens":2}',
                "messages[0].content"),
    "tool description": ("/v1/chat/completions",
                         '{"model":"msaserve/tiny","messages":[{"role":"user","content":"x"}],"max_tokens":2,'
                         '"tools":[{"type":"function","function":{"name":"f","description":"\\udfff x"}}]}',
                         "tools[0].function.description"),
    "text part": ("/v1/chat/completions",
                  '{"model":"msaserve/tiny","max_tokens":2,'
                  '"messages":[{"role":"user","content":[{"type":"text","text":"a\\ud83d"}]}]}',
                  "messages[0].content[0].text"),
    "stop": ("/v1/chat/completions",
             '{"model":"msaserve/tiny","messages":[{"role":"user","content":"x"}],"stop":["\\ud800"]}',
             "stop[0]"),
    "prompt": ("/v1/completions", '{"model":"msaserve/tiny","prompt":"\\udc00","max_tokens":2}', "prompt"),
}


@pytest.mark.parametrize("case", sorted(LONE_SURROGATE_BODIES))
def test_lone_surrogate_is_a_400_naming_the_field(gateway, case: str) -> None:
    path, raw, param = LONE_SURROGATE_BODIES[case]
    error = error_of(post_raw(gateway, path, raw), 400)
    assert error["param"] == param and error["code"] == "invalid_unicode", error
    assert "surrogate" in error["message"]


def test_a_surrogate_pair_is_valid_text(gateway) -> None:
    raw = '{"model":"msaserve/tiny","messages":[{"role":"user","content":"\\ud83d\\ude00"}],"max_tokens":2}'
    assert post_raw(gateway, "/v1/chat/completions", raw).status_code == 200


def test_an_unknown_field_named_with_a_lone_surrogate_is_a_400(gateway) -> None:
    raw = '{"model":"msaserve/tiny","messages":[{"role":"user","content":"x"}],"\\ud800":1}'
    assert post_raw(gateway, "/v1/chat/completions", raw).status_code == 400


def test_an_internal_error_is_counted_by_route_and_cause(gateway) -> None:
    """A 500 of any kind lands in the request metrics (it did not: the middleware never saw it)."""

    async def go(client, ctx):
        def boom(*_args, **_kwargs):
            raise RuntimeError("injected fault")

        ctx.model_info = boom  # a fault inside the gateway, below every handler
        response = await client.post("/v1/chat/completions", json=chat())
        return response, ctx.metrics

    response, metrics = gateway.run(go)
    assert response.status_code == 500
    route = "/v1/chat/completions"
    assert metrics.count("requests", route=route, status="500") == 1
    assert metrics.count("server_errors", route=route, status="500", cause="RuntimeError") == 1


def test_a_503_is_counted_with_its_error_code(gateway) -> None:
    async def go(client, ctx):
        async def not_ready():
            from msaserve.platform.model_messages import ModelInfo

            return ModelInfo(name=MODEL, ready=False)

        ctx.model_info = not_ready
        response = await client.post("/v1/chat/completions", json=chat())
        return response, ctx.metrics

    response, metrics = gateway.run(go)
    assert response.status_code == 503
    assert metrics.count("server_errors", route="/v1/chat/completions", cause="warming_up") == 1


# ----------------------------------------------------------------------------- item 6: the right param


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", chat(max_tokens=100_000), "max_tokens"),
        ("/v1/chat/completions", chat(max_tokens=None, max_completion_tokens=100_000),
         "max_completion_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 100_000}, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi " * 600, "max_tokens": 2}, "prompt"),
        ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "hi " * 600}]), "messages"),
    ],
)
def test_context_overflow_names_what_to_change(gateway, path: str, body: dict, param: str) -> None:
    body = {k: v for k, v in body.items() if v is not None}
    error = error_of(gateway.request("POST", path, json=body), 400)
    assert (error["param"], error["code"]) == (param, "context_length_exceeded"), error
    if param.startswith("max_"):
        assert f"allowed {param} ≤" in error["message"]


def test_unknown_content_part_type_names_the_part_and_the_allowed_types(gateway) -> None:
    body = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "audio"}]}])
    error = error_of(gateway.request("POST", "/v1/chat/completions", json=body), 400)
    assert error["param"] == "messages[0].content[1].type", error
    assert "'audio'" in error["message"] and "'text', 'image_url' or 'video_url'" in error["message"]


def test_validation_errors_use_openai_paths(gateway) -> None:
    body = chat(messages=[{"role": "bot", "content": "x"}])
    error = error_of(gateway.request("POST", "/v1/chat/completions", json=body), 400)
    assert error["param"] == "messages[0].role" and "'bot'" in error["message"]
    error = error_of(gateway.request("POST", "/v1/chat/completions", json=chat(tool_choice="maybe")), 400)
    assert error["param"] == "tool_choice" and "'none', 'auto' or 'required'" in error["message"]


# ----------------------------------------------------------------------------- item 8: no vision tower


@pytest.mark.parametrize("kind", ["image_url", "video_url"])
def test_media_to_a_text_only_deployment_says_which_models_see(gateway, kind: str) -> None:
    part = {"type": kind, kind: {"url": "data:image/png;base64,iVBORw0KGgo="}}
    body = chat(messages=[{"role": "user", "content": [part, {"type": "text", "text": "what is it?"}]}])
    error = error_of(gateway.request("POST", "/v1/chat/completions", json=body), 400)
    assert error["code"] == "unsupported_content"
    assert "has no vision tower" in error["message"] and MODEL in error["message"]
    assert "vision_config" in error["message"] and "'tiny' preset" in error["message"]  # which models do


def test_error_bodies_are_ascii_json(gateway) -> None:
    raw = '{"model":"\\ud800","messages":[{"role":"user","content":"x"}]}'
    response = post_raw(gateway, "/v1/chat/completions", raw)
    assert response.status_code == 400
    response.content.decode("ascii")
    json.loads(response.content)


@pytest.mark.parametrize(
    "raw",
    [
        '{"model":"msaserve/tiny","messages":' + "[" * 100_000 + "]" * 100_000 + "}",  # deep nesting
        '{"model":"msaserve/tiny","messages":[{"role":"user","content":"x"}],"max_tokens":'
        + "9" * 5000 + "}",
    ],
    ids=["nested-100000-deep", "5000-digit-integer"],
)
def test_an_unparsable_body_says_what_the_parser_accepts(gateway, raw: str) -> None:
    error = error_of(post_raw(gateway, "/v1/chat/completions", raw), 400)
    assert error["code"] == "invalid_json" and "nested" in error["message"], error


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("/v1/chat/completions", {"stream": True, "stream_options": {"include_usage": "yes"}},
         "stream_options.include_usage"),
        ("/v1/chat/completions", {"max_tokens": "5"}, "max_tokens"),
        ("/v1/chat/completions", {"max_tokens": True}, "max_tokens"),
        ("/v1/chat/completions", {"n": 2.0}, "n"),
        ("/v1/chat/completions", {"temperature": "0.5"}, "temperature"),
        ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
        ("/v1/completions", {"echo": "false"}, "echo"),
        ("/v1/responses", {"store": "no"}, "store"),
    ],
)
def test_a_value_of_the_wrong_json_type_is_a_400_not_coerced(gateway, path: str, fields: dict,
                                                             param: str) -> None:
    """"yes" for a boolean, "5" or true for an integer, "0.5" for a number: OpenAI refuses them, and a
    lax parser would read "yes" as true and true as max_tokens=1."""
    if path == "/v1/responses":
        body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, **fields}
    elif path == "/v1/completions":
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, **fields}
    else:
        body = chat(**fields)
    error = error_of(gateway.request("POST", path, json=body), 400)
    assert error["param"] == param and error["code"] == "invalid_value", error


def test_an_integer_is_a_valid_number(gateway) -> None:
    response = gateway.request("POST", "/v1/chat/completions", json=chat(temperature=0, top_p=1))
    assert response.status_code == 200, response.text


def test_a_body_that_is_not_utf8_is_named_as_such(gateway) -> None:
    """Bytes that are not UTF-8 failed json.loads and were answered with the parser's nesting and digit
    limits, which say nothing about the cause."""
    raw = b'{"model":"msaserve/tiny","messages":[{"role":"user","content":"\xff\xfe"}]}'
    response = gateway.request("POST", "/v1/chat/completions", content=raw,
                               headers={"content-type": "application/json"})
    error = error_of(response, 400)
    assert error["code"] == "invalid_json", error
    assert "not valid UTF-8" in error["message"] and "0xff at offset 63" in error["message"], error
    assert "nested" not in error["message"]


# ----------------------------------------------------------------------------- tools a reply may call

FUNCTION = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def with_function(name: str = "f", parameters: object = None) -> dict:
    function = {"name": name} | ({} if parameters is None else {"parameters": parameters})
    return {"type": "function", "function": function}


@pytest.mark.parametrize(
    ("tools", "param", "words"),
    [
        ([FUNCTION, with_function("g"), with_function("f")], "tools[2].function.name",
         "allowed a name no other tool has (tools[0] has it)"),
        ([with_function(parameters={"type": "objectx"})], "tools[0].function.parameters",
         "parameters.type='objectx' is invalid for function 'f': allowed 'object'"),
        ([with_function(parameters={"type": "string"})], "tools[0].function.parameters", "allowed 'object'"),
        ([with_function(parameters={"type": "object", "properties": ["a"]})], "tools[0].function.parameters",
         "parameters.properties=['a'] is invalid"),
        ([with_function(parameters={"properties": {"a": 3}})], "tools[0].function.parameters",
         "parameters.properties.a=3 is invalid"),
        ([with_function(parameters={"type": "object", "required": "a"})], "tools[0].function.parameters",
         "parameters.required='a' is invalid"),
        ([with_function(parameters={"required": [1]})], "tools[0].function.parameters",
         "parameters.required item 1 is invalid"),
    ],
    ids=["duplicate-name", "unknown-type", "not-an-object", "properties-list", "property-not-schema",
         "required-string", "required-not-names"],
)
@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_a_tool_that_cannot_be_called_is_a_400(gateway, tools: list, param: str, words: str,
                                               tool_choice: str) -> None:
    """Checked whatever tool_choice says: with "auto" the tools were only shown to the model, so a
    schema no call can satisfy or two tools of one name went through to a reply that could not be
    parsed back to one tool."""
    body = chat(tools=tools, tool_choice=tool_choice)
    error = error_of(gateway.request("POST", "/v1/chat/completions", json=body), 400)
    assert (error["param"], error["code"]) == (param, "invalid_value"), error
    assert words in error["message"], error


def test_the_responses_api_names_its_own_flat_tool_fields(gateway) -> None:
    tool = {"type": "function", "name": "f", "parameters": {"type": "array"}}
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, "tools": [tool]}
    error = error_of(gateway.request("POST", "/v1/responses", json=body), 400)
    assert error["param"] == "tools[0].parameters", error
    assert error["message"].startswith("tools[0].parameters.type='array'"), error


def test_valid_tools_are_served(gateway) -> None:
    tools = [FUNCTION, with_function("g", {"properties": {"a": {"type": "string"}, "b": True},
                                           "required": ["a"]})]
    # tool_choice none: the checks still run, and the tiny model's 512 tokens need not hold the tool list
    response = gateway.request("POST", "/v1/chat/completions", json=chat(tools=tools, tool_choice="none"))
    assert response.status_code == 200, response.text


def test_one_model_is_retrieved_by_its_name_with_its_slash(gateway) -> None:
    """`client.models.retrieve("msaserve/tiny")` sends the name with its slash escaped; it was a 404
    with no route."""
    card = gateway.request("GET", "/v1/models/msaserve%2Ftiny")
    assert card.status_code == 200 and card.json()["id"] == MODEL, card.text
    assert gateway.request("GET", "/v1/models/msaserve/tiny").json()["id"] == MODEL
    error = error_of(gateway.request("GET", "/v1/models/nope"), 404)
    assert (error["param"], error["code"]) == ("model", "model_not_found"), error


def test_routes_with_ids_are_counted_under_their_collection() -> None:
    from msaserve.platform.request_metrics import route_label

    assert route_label("/v1/models/msaserve/tiny") == "/v1/models"
    assert route_label("/v1/responses/resp_1/input_items") == "/v1/responses"
    assert route_label("/v1/responses") == "/v1/responses"
    assert route_label("/v1/sessions/s/move") == "/v1/sessions"
    assert route_label("/v1/modelsx") == "other" and route_label("/v1/nope") == "other"


@pytest.mark.parametrize(
    ("fields", "param", "quoted"),
    [
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "a", "schema": {"$ref": "#/definitions/nope"}}}},
         "response_format.json_schema.schema", '\'{"$ref": "#/definitions/nope"}\''),
        ({"response_format": {"type": "regex", "regex": "(("}}, "response_format.regex", "'(('"),
        ({"tools": [with_function(parameters={"properties": {"a": {"$ref": "#/nope"}}})],
          "tool_choice": "required"},
         "tools", '\'{"f": {"properties": {"a": {"$ref": "#/nope"}}}}\''),
    ],
    ids=["json-schema", "regex", "tool-parameters"],
)
def test_an_uncompilable_constraint_quotes_what_the_client_wrote(gateway, fields: dict, param: str,
                                                                quoted: str) -> None:
    """The 400 quoted the grammar the server built (the schema with its own `x-guidance` layout keys,
    the tool call's Lark wrapper) and named `response_format` / `tool_choice` as a whole."""
    error = error_of(gateway.request("POST", "/v1/chat/completions", json=chat(**fields)), 400)
    assert error["param"] == param, error
    assert error["message"].startswith(f"{param}={quoted} is invalid"), error
    assert "x-guidance" not in error["message"] and "start:" not in error["message"].split("allowed")[0]


# ----------------------------------------------------------------------------- stored responses' input


def test_a_stored_responses_input_items_are_listed_and_paged(gateway) -> None:
    """`client.responses.input_items.list(id)` was a 404 (no route)."""
    given = [{"role": "user", "content": "a"}, {"type": "message", "role": "assistant", "content": "b"},
             {"role": "user", "content": [{"type": "input_text", "text": "c"}], "id": "msg_mine"}]
    body = {"model": MODEL, "input": given, "max_output_tokens": 2}
    created = gateway.request("POST", "/v1/responses", json=body)
    assert created.status_code == 200, created.text
    path = f"/v1/responses/{created.json()['id']}/input_items"
    listed = gateway.request("GET", path, params={"order": "asc"}).json()
    assert [i["content"][0]["text"] for i in listed["data"]] == ["a", "b", "c"]
    assert [i["content"][0]["type"] for i in listed["data"]] == ["input_text", "output_text", "input_text"]
    assert listed["data"][2]["id"] == "msg_mine" and listed["has_more"] is False
    assert all(i["type"] == "message" and i["status"] == "completed" for i in listed["data"])
    first = gateway.request("GET", path, params={"limit": 2}).json()  # newest first by default
    assert [i["content"][0]["text"] for i in first["data"]] == ["c", "b"] and first["has_more"]
    rest = gateway.request("GET", path, params={"limit": 2, "after": first["last_id"]}).json()
    assert [i["content"][0]["text"] for i in rest["data"]] == ["a"] and not rest["has_more"]
    for params, param in [({"limit": 0}, "limit"), ({"limit": "x"}, "limit"), ({"order": "up"}, "order"),
                          ({"after": "msg_nope"}, "after")]:
        error = error_of(gateway.request("GET", path, params=params), 400)
        assert error["param"] == param, error
    text = gateway.request("POST", "/v1/responses",
                           json={"model": MODEL, "input": "hi", "max_output_tokens": 2})
    (item,) = gateway.request("GET", f"/v1/responses/{text.json()['id']}/input_items").json()["data"]
    assert item["role"] == "user" and item["content"] == [{"type": "input_text", "text": "hi"}]
    assert item["id"].startswith("msg_")
    error = error_of(gateway.request("GET", "/v1/responses/resp_nope/input_items"), 404)
    assert error["param"] == "response_id"


@pytest.mark.parametrize("value", ["r" * 257, "a b", "caf\u00e9"], ids=["257-chars", "space", "latin-1"])
def test_a_request_id_that_cannot_name_a_request_is_a_400(gateway, value: str) -> None:
    """A client's X-Request-ID becomes the response's id and goes into every log line: 5,000
    characters of it went there whole."""
    response = gateway.request("POST", "/v1/chat/completions", json=chat(),
                               headers={"x-request-id": value.encode("latin-1")})
    error = error_of(response, 400)
    assert (error["param"], error["code"]) == ("X-Request-ID", "invalid_value"), error
    assert value not in response.headers["x-request-id"] and len(response.headers["x-request-id"]) == 32


def test_a_client_request_id_names_the_request(gateway) -> None:
    rid = "r" * 256
    response = gateway.request("POST", "/v1/chat/completions", json=chat(), headers={"x-request-id": rid})
    assert response.status_code == 200 and response.json()["id"] == f"chatcmpl-{rid}", response.text


@pytest.mark.parametrize(
    ("content", "content_type", "words"),
    [
        (b"", "application/json", "the request body is empty: allowed a JSON object"),
        (b'{"model": "msaserve/tiny"}', "text/plain",
         "its Content-Type is 'text/plain'; allowed a JSON object sent with Content-Type: application/json"),
        (b"model=x", "application/x-www-form-urlencoded",
         "its Content-Type is 'application/x-www-form-urlencoded'"),
        (b"null", "application/json", "the request body is null: allowed a JSON object"),
        (b"[1, 2]", "application/json", "the request body is an array: allowed a JSON object"),
        (b'"hi"', "application/json", "the request body is a string: allowed a JSON object"),
    ],
    ids=["empty", "text-plain", "form", "null", "array", "string"],
)
def test_a_body_that_is_not_a_json_object_says_which_way(gateway, content: bytes, content_type: str,
                                                          words: str) -> None:
    """These were pydantic's "body: Field required" and "Input should be a valid dictionary ... (got
    b'...')", with the raw bytes."""
    response = gateway.request("POST", "/v1/chat/completions", content=content,
                               headers={"content-type": content_type})
    error = error_of(response, 400)
    assert (error["param"], error["code"]) == ("body", "invalid_value"), error
    assert words in error["message"], error


def test_a_batch_of_prompts_is_refused_by_name_and_a_batch_of_one_is_served(gateway) -> None:
    """OpenAI takes a list of token-id lists as a batch; that was "prompt[0]: Input should be a valid
    integer". A batch of one is the one prompt, as a list of one string already was."""
    def complete(prompt):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
        return gateway.request("POST", "/v1/completions", json=body)

    for batch in ([[1, 2, 3], [4, 5]], ["a", "b"]):
        error = error_of(complete(batch), 400)
        assert error["param"] == "prompt", error
        assert "'a batch of 2 prompts' is invalid: allowed one prompt" in error["message"], error
    one = complete([[5, 6, 7]])
    assert one.status_code == 200 and one.json()["usage"]["prompt_tokens"] == 3, one.text
    assert complete([5, 6, 7]).json()["choices"][0]["text"] == one.json()["choices"][0]["text"]


def test_a_request_whose_client_left_is_counted() -> None:
    """Serve cancels a handler when its client disconnects (a stream closed mid-way): the middleware
    saw a CancelledError, not an Exception, and counted nothing, so requests_total missed every
    aborted stream (13 of 26 in a hand test)."""
    import asyncio

    from msaserve.platform.metrics import PlatformMetrics
    from msaserve.platform.request_metrics import RequestMetricsMiddleware

    async def streaming_app(scope, receive, send):
        if scope["path"] == "/v1/responses":
            await send({"type": "http.response.start", "status": 200, "headers": []})
        raise asyncio.CancelledError

    async def sent(_message):
        return None

    metrics = PlatformMetrics()
    middleware = RequestMetricsMiddleware(streaming_app, metrics, MODEL)
    for path in ("/v1/responses", "/v1/chat/completions"):  # left mid-stream; before any answer
        with pytest.raises(asyncio.CancelledError):
            asyncio.run(middleware({"type": "http", "path": path}, None, sent))
    assert metrics.count("requests", route="/v1/responses", status="200") == 1
    assert metrics.count("requests", route="/v1/chat/completions", status="499") == 1
    assert metrics.count("server_errors") == 0


@pytest.mark.parametrize(("metadata", "param"),
                         [({"k": "v" * 513}, "metadata.k"), ({"k" * 65: "v"}, "metadata.")])
def test_responses_metadata_has_openais_bounds(gateway, metadata: dict, param: str) -> None:
    """Values of any length were kept with the stored response (16 values of 2 MB fit a body)."""
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, "metadata": metadata}
    error = error_of(gateway.request("POST", "/v1/responses", json=body), 400)
    assert error["param"].startswith(param) and "at most" in error["message"], error
    fits = {"k" * 64: "v" * 512}
    response = gateway.request("POST", "/v1/responses", json={**body, "metadata": fits})
    assert response.status_code == 200 and response.json()["metadata"] == fits


CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("messages", "param", "code"),
    [
        ([{"role": "user"}], "messages[0].content", "missing_required_parameter"),
        ([{"role": "user", "content": []}], "messages[0].content", "invalid_value"),
        ([{"role": "user", "content": "hi"}, {"role": "assistant"}, {"role": "user", "content": "x"}],
         "messages[1].content", "missing_required_parameter"),
        ([{"role": "user", "content": "hi", "tool_calls": [CALL]}], "messages[0].tool_calls",
         "invalid_value"),
        ([{"role": "user", "content": "hi", "tool_call_id": "call_1"}], "messages[0].tool_call_id",
         "invalid_value"),
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [CALL]},
          {"role": "tool", "content": "sunny"}], "messages[2].tool_call_id", "missing_required_parameter"),
    ],
    ids=["user-without-content", "empty-parts", "assistant-with-nothing", "user-with-calls",
         "user-with-call-id", "tool-without-call-id"],
)
def test_a_message_missing_or_carrying_what_its_role_does_not_is_a_400(gateway, messages: list, param: str,
                                                                      code: str) -> None:
    """All of these were served: the fields a role does not take were dropped, a missing content read
    as empty, so the model answered a conversation other than the one sent."""
    error = error_of(gateway.request("POST", "/v1/chat/completions", json=chat(messages=messages)), 400)
    assert (error["param"], error["code"]) == (param, code), error


def test_a_tool_round_trip_with_its_ids_is_served(gateway) -> None:
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    response = gateway.request("POST", "/v1/chat/completions", json=chat(messages=messages))
    assert response.status_code == 200, response.text
