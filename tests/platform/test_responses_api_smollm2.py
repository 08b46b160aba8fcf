"""The Responses API (`/v1/responses`) with the real SmolLM2-135M-Instruct behind a real Serve app,
through the official `openai` client: a conversation with a function call and its output round-trips
through previous_response_id; streamed events parse (create(stream=True), responses.stream) and
their text and arguments add up to the final response; store false and another API key get 404; bad
input gets a 400 that names the field; chat streams send a call's arguments in pieces that the SDK's
stream accumulator assembles into a valid call."""

import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "msaserve/smollm2"
KEY_A, KEY_B = "responses-key-a", "responses-key-b"
SERVE_CONFIG = {
    "model": {"spec": "smollm2"},
    "engine": {"max_model_len": 2048, "max_num_seqs": 4},
    "auth": {"api_keys": [KEY_A, KEY_B]},
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
        "parameters": WEATHER, "strict": True}
CHAT_TOOL = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}


def _client(live_app, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_app.base_url + "/v1", api_key=key, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def client(live_app) -> openai.OpenAI:
    return _client(live_app, KEY_A)


INSTRUCTIONS = "You are a weather assistant."


def test_function_call_conversation_round_trips(client, live_app) -> None:
    first = client.responses.create(
        model=MODEL, instructions=INSTRUCTIONS, input="What's the weather in Paris?",
        tools=[TOOL], tool_choice="required", parallel_tool_calls=False, max_output_tokens=80, temperature=0,
    )
    assert first.status == "completed", first
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, instructions=INSTRUCTIONS, tools=[TOOL],
        max_output_tokens=40, temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 21}'}],
    )
    assert second.previous_response_id == first.id and second.output_text
    assert second.usage.input_tokens > first.usage.input_tokens
    # the second turn's prompt starts as the first's (instructions are per response, so they are sent
    # again, as agent frameworks do): it reused the first turn's cached pages
    assert second.usage.input_tokens_details.cached_tokens > 0
    (item,) = client.responses.input_items.list(second.id).data  # its own input, not the first turn's
    assert item.type == "function_call_output" and item.call_id == call.call_id and item.id
    again = client.responses.retrieve(second.id)
    assert again.id == second.id and again.output_text == second.output_text
    # a third turn continues from the second one's stored conversation
    third = client.responses.create(model=MODEL, previous_response_id=second.id, input="Thanks!",
                                    instructions=INSTRUCTIONS, tools=[TOOL], max_output_tokens=10,
                                    temperature=0)
    assert third.usage.input_tokens > second.usage.input_tokens
    with pytest.raises(openai.NotFoundError):  # another API key sees none of it
        _client(live_app, KEY_B).responses.retrieve(second.id)
    with pytest.raises(openai.NotFoundError) as error:
        _client(live_app, KEY_B).responses.create(model=MODEL, previous_response_id=second.id, input="hi")
    assert error.value.body["param"] == "previous_response_id"
    client.responses.delete(third.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(third.id)


def test_streamed_events_add_up_to_the_response(client) -> None:
    kwargs = dict(model=MODEL, input="Say hello to Ada in five words.", max_output_tokens=30, temperature=0)
    events = list(client.responses.create(**kwargs, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert text and done.text == text == events[-1].response.output_text
    assert text == client.responses.create(**kwargs).output_text  # greedy: the same reply

    with client.responses.stream(model=MODEL, input="What's the weather in Rome?", tools=[TOOL],
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 parallel_tool_calls=False, max_output_tokens=80, temperature=0) as stream:
        streamed = list(stream)
        final = stream.get_final_response()
    pieces = [e.delta for e in streamed if e.type == "response.function_call_arguments.delta"]
    (call,) = final.output
    assert len(pieces) > 1 and "".join(pieces) == call.arguments  # arguments arrive as generated
    jsonschema.validate(json.loads(call.arguments), WEATHER)


def test_store_false_and_bad_input(client) -> None:
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as error:
        client.responses.create(model=MODEL, previous_response_id=unstored.id, input="and then?")
    assert error.value.body["param"] == "previous_response_id"
    bad = [
        ({"input": [{"type": "function_call_output", "call_id": "c1", "output": "1"}]}, "input[0].call_id"),
        ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text"),
        ({"input": "hi", "tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
        ({"input": "hi", "max_output_tokens": 5000}, "max_output_tokens"),
        ({"input": "hi", "temperature": 3}, "temperature"),
    ]
    for extra, param in bad:
        with pytest.raises(openai.BadRequestError) as error:
            client.responses.create(model=MODEL, **extra)
        assert error.value.body["param"] == param, (extra, error.value.body)


def test_text_format_json_schema(client) -> None:
    fmt = {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}
    reply = client.responses.create(model=MODEL, input="Describe the weather in Oslo as JSON.",
                                    text={"format": fmt}, max_output_tokens=60, temperature=0)
    jsonschema.validate(json.loads(reply.output_text), WEATHER)
    assert reply.text.format.type == "json_schema"


def test_chat_stream_tool_arguments_arrive_in_pieces(client) -> None:
    with client.chat.completions.stream(
        model=MODEL, messages=[{"role": "user", "content": "What's the weather in Lima?"}], tools=[CHAT_TOOL],
        tool_choice="required", parallel_tool_calls=False, max_tokens=80, temperature=0,
    ) as stream:
        chunks = [e.chunk for e in stream if e.type == "chunk"]
        final = stream.get_final_completion()
    deltas = [tc for c in chunks if c.choices and c.choices[0].delta.tool_calls
              for tc in c.choices[0].delta.tool_calls]
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    assert len(deltas) > 2 and all(d.id is None and d.function.name is None for d in deltas[1:])
    (call,) = final.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and final.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    assert call.function.parsed_arguments == json.loads(call.function.arguments)  # strict tool: parsed
