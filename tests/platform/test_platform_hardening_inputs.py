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


# ----------------------------------------------------------------------------- a user and an attacker


@pytest.mark.parametrize("kind", ["input_image", [1], {"a": 1}, 5, None],
                         ids=["unknown-name", "list", "object", "number", "null"])
def test_an_input_item_of_unknown_type_lists_every_item_type(gateway, kind: object) -> None:
    """`"type": [1]` (unhashable) was a 500 TypeError from the item discriminator; an unknown name was
    answered "allowed 'message'", as if messages were the only items."""
    body = {"model": MODEL, "input": [{"type": kind, "image_url": "x"}], "max_output_tokens": 2}
    error = error_of(gateway.request("POST", "/v1/responses", json=body), 400)
    assert (error["param"], error["code"]) == ("input[0].type", "invalid_value"), error
    assert error["message"].startswith(f"input[0].type={kind!r} is not supported: allowed 'message', "
                                       "'function_call' or 'function_call_output'"), error


def test_the_unknown_item_catch_all_is_no_documented_item(gateway) -> None:
    schema = gateway.request("GET", "/openapi.json")
    assert schema.status_code == 200, schema.text
    items = schema.json()["components"]["schemas"]["ResponsesRequest"]["properties"]["input"]["anyOf"][1]
    assert [one["$ref"].rsplit("/", 1)[1] for one in items["items"]["oneOf"]] == [
        "InputMessage", "FunctionCallItem", "FunctionCallOutputItem"]


def nested_schema(levels: int) -> dict:
    """An object schema whose property `a` is arrays of arrays ...: `levels` levels of JSON in all."""
    inner: dict = {}
    for _ in range(levels - 3):
        inner = {"type": "array", "items": inner}
    schema = {"type": "object", "properties": {"a": inner}}
    from msaserve.platform.structured_request import json_depth

    assert json_depth(schema) == levels
    return schema


@pytest.mark.parametrize("tool_choice", ["auto", "required", "none"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
def test_tool_parameters_nested_past_the_bound_are_a_400(gateway, path: str, tool_choice: str) -> None:
    """Nested 301 levels, they were a 500 (PydanticSerializationError: the tool list is written into the
    prompt by pydantic's JSON serializer, which stops at 255 levels)."""
    parameters = nested_schema(301)
    if path == "/v1/responses":
        tool = {"type": "function", "name": "f", "parameters": parameters}
        body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, "tools": [tool],
                "tool_choice": tool_choice}
        param = "tools[0].parameters"
    else:
        body = chat(tools=[with_function(parameters=parameters)], tool_choice=tool_choice)
        param = "tools[0].function.parameters"
    error = error_of(gateway.request("POST", path, json=body), 400)
    assert (error["param"], error["code"]) == (param, "invalid_value"), error
    assert f"{param} of function 'f' is nested 301 levels deep: allowed at most 100 levels" in \
        error["message"], error


def test_tool_parameters_at_the_bound_are_served(gateway) -> None:
    body = chat(tools=[with_function(parameters=nested_schema(99))], tool_choice="none")
    assert gateway.request("POST", "/v1/chat/completions", json=body).status_code == 200


def test_json_depth_counts_objects_and_arrays() -> None:
    from msaserve.platform.structured_request import json_depth

    assert [json_depth(v) for v in (1, "x", {}, [], {"a": [1]}, [[], [[{}]]])] == [0, 0, 1, 1, 2, 4]
    deep: list = []
    for _ in range(50_000):
        deep = [deep]
    assert json_depth(deep) == 50_001  # no recursion


@pytest.mark.parametrize("logprobs", [21, -1])
def test_completions_logprobs_out_of_range_names_logprobs(gateway, logprobs: int) -> None:
    """It was named by the engine's field: `top_logprobs=21 is invalid`, param top_logprobs, which a
    completions request does not have."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "logprobs": logprobs}
    error = error_of(gateway.request("POST", "/v1/completions", json=body), 400)
    assert (error["param"], error["code"]) == ("logprobs", "invalid_value"), error
    assert error["message"].startswith(f"logprobs={logprobs} is invalid: allowed 0 to 20"), error


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_stream_options_without_stream_is_a_400(gateway, path: str) -> None:
    """It was silently ignored (OpenAI refuses it): a client asking for usage chunks got none."""
    base = chat() if path == "/v1/chat/completions" else {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    body = {**base, "stream_options": {"include_usage": True}}
    error = error_of(gateway.request("POST", path, json=body), 400)
    assert (error["param"], error["code"]) == ("stream_options", "invalid_value"), error
    assert "with stream: false: allowed only with stream: true" in error["message"], error
    assert gateway.request("POST", path, json={**base, "stream_options": None}).status_code == 200
    streamed = gateway.request("POST", path, json={**body, "stream": True})
    assert streamed.status_code == 200 and '"usage"' in streamed.text


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [("PUT", "/v1/chat/completions", "POST"), ("GET", "/v1/completions", "POST"),
     ("PUT", "/v1/responses/resp_1", "GET, DELETE"), ("DELETE", "/v1/models", "GET")],
)
def test_a_method_a_route_does_not_take_is_a_405_naming_the_allowed_ones(gateway, method: str, path: str,
                                                                         allow: str) -> None:
    """It was "Method Not Allowed" with no Allow header (RFC 9110 requires one), nor the method, nor the
    methods the path takes; for a path of two routes (GET and DELETE) Starlette's header named one."""
    response = gateway.request(method, path)
    error = error_of(response, 405)
    assert response.headers["allow"] == allow
    assert error["code"] == "method_not_allowed", error
    assert error["message"].startswith(f"method {method} is not allowed on {path!r}: allowed {allow}"), error


def test_an_unknown_route_is_a_404_naming_it(gateway) -> None:
    """It was a bare "Not Found"."""
    error = error_of(gateway.request("GET", "/v1/chat/completion"), 404)
    assert error["code"] == "route_not_found", error
    assert error["message"].startswith("no route GET '/v1/chat/completion': the API's routes are listed in "
                                       "/docs"), error


EMOJI = "\U0001f600"  # 4 UTF-8 bytes: 4 tokens of the tiny model's byte vocabulary


@pytest.mark.parametrize("stream", [False, True])
def test_logprob_bytes_of_tokens_that_split_a_character_are_the_tokens_own(gateway, stream: bool) -> None:
    """Each of an emoji's byte tokens decodes alone to U+FFFD, and `bytes` was that character's
    (239, 191, 189) for all of them: the tokens' bytes did not add up to the text."""
    body = chat(messages=[{"role": "user", "content": "smile"}], max_tokens=10, temperature=0, logprobs=True,
                top_logprobs=2, stream=stream, response_format={"type": "regex", "regex": EMOJI * 2})
    response = gateway.request("POST", "/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    if stream:
        chunks = [json.loads(line[6:]) for line in response.text.splitlines()
                  if line.startswith("data: {")]
        entries = [e for c in chunks for ch in c["choices"]
                   for e in (ch.get("logprobs") or {}).get("content", [])]
        text = "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"])
    else:
        choice = response.json()["choices"][0]
        entries, text = choice["logprobs"]["content"], choice["message"]["content"]
    assert text == EMOJI * 2
    assert [e["token"] for e in entries[8:]] in ([], ["<|im_end|>"])  # the end token, when sampled
    assert bytes(b for e in entries[:8] for b in e["bytes"]) == text.encode()
    assert [e["bytes"] for e in entries[:4]] == [[b] for b in EMOJI.encode()]
    assert all(len(t["bytes"]) == 1 for e in entries for t in e["top_logprobs"] if t["token"] == "\ufffd")


def fake_logprobs(tokenizer, text: str) -> list:
    from msaserve.engine.types import TokenLogprob

    ids = tokenizer.encode(text)
    return [TokenLogprob(i, -0.5, [(i, -0.5), (3 + 0xA0, -1.0), (3 + 0xA1, -2.0)]) for i in ids]


def test_completions_logprobs_of_a_split_character_offsets_and_labels() -> None:
    """text_offset counted each byte token as a character (U+FFFD): "a😀b" had offsets up to 5 in 3
    characters; and two byte tokens were one key "\ufffd" of top_logprobs, so alternatives were lost.
    Byte tokens are now labelled as OpenAI's legacy API writes them ("bytes:\\xf0")."""
    from msaserve.models.tokenizer import Tokenizer
    from msaserve.platform.api_completions import _logprobs
    from msaserve.platform.generation import TextOffsets

    tokenizer = Tokenizer.byte_level(300)
    logprobs = fake_logprobs(tokenizer, f"a{EMOJI}b")
    whole = _logprobs(tokenizer, logprobs, TextOffsets())
    assert whole.tokens == ["a", "bytes:\\xf0", "bytes:\\x9f", "bytes:\\x98", "bytes:\\x80", "b"]
    assert whole.text_offset == [0, 1, 1, 1, 1, 2]
    assert whole.top_logprobs is not None and all(len(top) == 3 for top in whole.top_logprobs)
    assert whole.top_logprobs[2] == {"bytes:\\x9f": -0.5, "bytes:\\xa0": -1.0, "bytes:\\xa1": -2.0}
    offsets = TextOffsets()  # streamed: a character's tokens split over two chunks, offsets go on
    streamed = [_logprobs(tokenizer, part, offsets) for part in (logprobs[:3], logprobs[3:])]
    assert streamed[0].text_offset + streamed[1].text_offset == whole.text_offset


def test_token_bytes_of_byte_level_and_byte_fallback_vocabularies() -> None:
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import decoders, models

    from msaserve.models.tokenizer import Tokenizer

    byte_level = Tokenizer.byte_level(300)
    ids = byte_level.encode(f"a{EMOJI}")
    assert [byte_level.token_bytes(i) for i in ids] == [b"a", b"\xf0", b"\x9f", b"\x98", b"\x80"]
    assert byte_level.token_bytes(2) == b"<|im_end|>"  # a special token: its text
    vocab = {"<0xF0>": 0, "<0x9F>": 1, "\u2581hi": 2}  # SentencePiece's byte fallback
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    fallback = Tokenizer(backend, bos_token_id=None, eos_token_ids=set())
    assert fallback.decode([0], skip_special_tokens=False) == "\ufffd"
    assert [fallback.token_bytes(i) for i in (0, 1)] == [b"\xf0", b"\x9f"]


# ----------------------------------------------------------------------------- empty OpenAI fields

@pytest.mark.parametrize("fields", [{"include": []}, {"include": None}, {"reasoning": None},
                                    {"reasoning": {}}, {"reasoning": {"effort": None, "summary": None}}])
def test_responses_fields_sent_empty_are_served(gateway, fields: dict) -> None:
    """`include: []` and `reasoning: null`, which generic clients send for "none", were 400s: not a
    supported parameter."""
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, **fields}
    response = gateway.request("POST", "/v1/responses", json=body)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(("fields", "param"), [({"include": ["message.output_text.logprobs"]}, "include"),
                                               ({"reasoning": {"effort": "high"}}, "reasoning")])
def test_responses_fields_asking_for_what_is_not_produced_are_a_400(gateway, fields: dict,
                                                                   param: str) -> None:
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, **fields}
    error = error_of(gateway.request("POST", "/v1/responses", json=body), 400)
    assert error["param"] == param and error["code"] == "invalid_value", error
    assert repr(next(iter(fields.values()))) in error["message"] and "allowed" in error["message"], error


@pytest.mark.parametrize("path", ["/health", "/ready"])
def test_probes_answer_head(gateway, path: str) -> None:
    """HEAD was a 405: a load balancer probing with it saw the gateway as down."""
    head = gateway.request("HEAD", path)
    assert head.status_code == gateway.request("GET", path).status_code == 200, head.text
    assert head.content == b""
