"""Agentic API features end to end through the official `openai` client against a real Serve app
(tiny random preset): structured outputs, enforced tool calls, n choices on shared prompt pages,
penalties and logit_bias. The model is random, so these check that the constraint holds, not text."""

import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "msaserve/tiny"
SERVE_CONFIG = {"model": {"spec": "tiny"}, "engine": {"max_num_seqs": 8, "max_model_len": 2048}}
HELLO = [{"role": "user", "content": "Hello there"}]
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "colour": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["ok", "colour", "count"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"unit": {"enum": ["c", "f"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["unit", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"utc": {"type": "boolean"}},
                "required": ["utc"],
                "additionalProperties": False,
            },
        },
    },
]


@pytest.fixture(scope="module")
def client(live_app) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_app.base_url + "/v1", api_key="unused", max_retries=0)


def _json_format(strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": strict}}


def test_json_schema_output_validates_streamed_and_not(client) -> None:
    for seed in range(3):
        kwargs = dict(
            model=MODEL,
            messages=HELLO,
            max_tokens=120,
            temperature=1.0,
            seed=seed,
            response_format=_json_format(),
        )
        reply = client.chat.completions.create(**kwargs)
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)
        chunks = client.chat.completions.create(**kwargs, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == reply.choices[0].message.content


def test_json_object_and_regex(client) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=HELLO,
        max_tokens=60,
        temperature=0,
        extra_body={"response_format": {"type": "regex", "regex": "[a-c]{5}"}},
    )
    assert len(reply.choices[0].message.content) == 5 and set(reply.choices[0].message.content) <= set("abc")
    obj = client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=400, temperature=0, response_format={"type": "json_object"}
    )
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:
        assert obj.choices[0].message.content.startswith("{")


def test_uncompilable_schema_is_400_naming_the_construct(client) -> None:
    bad = {
        "type": "json_schema",
        "json_schema": {"name": "x", "strict": True, "schema": {"type": "string", "pattern": "(?<=a)b"}},
    }
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, response_format=bad)
    body = error.value.body
    assert body["param"] == "response_format.json_schema.schema" and "look-around" in body["message"]


@pytest.mark.parametrize("parallel", [True, False])
def test_tool_choice_required_always_yields_valid_calls(client, parallel) -> None:
    for seed in range(4):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=HELLO,
            max_tokens=300,
            temperature=1.0,
            seed=seed,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=parallel,
        )
        choice = reply.choices[0]
        # With parallel calls allowed the random model may go on calling until max_tokens cuts it off
        # (the whole calls before the cut are returned); with one call the grammar ends the reply.
        allowed = ("tool_calls", "length") if parallel else ("tool_calls",)
        assert choice.finish_reason in allowed, choice.message
        calls = choice.message.tool_calls
        assert calls and (parallel or len(calls) == 1)
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_named_tool_choice_streams_a_valid_call(client) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=HELLO,
            max_tokens=300,
            temperature=0,
            tools=TOOLS,
            stream=True,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )
    )
    deltas = [
        tc
        for c in chunks
        if c.choices and c.choices[0].delta.tool_calls
        for tc in c.choices[0].delta.tool_calls
    ]
    # the first delta of a call names it; the arguments follow in pieces as they are generated
    assert deltas[0].id and deltas[0].type == "function" and deltas[0].function.name == "get_weather"
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:])
    assert len(deltas) > 2
    jsonschema.validate(json.loads("".join(d.function.arguments for d in deltas)), WEATHER)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_stop_token_ids_end_the_output(client) -> None:
    token_a = 3 + ord("a")  # the byte tokenizer: ids 3–258 are the bytes
    kwargs = dict(model=MODEL, max_tokens=12, temperature=0, logit_bias={str(token_a): 100})
    chat = client.chat.completions.create(**kwargs, messages=HELLO, extra_body={"stop_token_ids": [token_a]})
    assert chat.choices[0].message.content == "" and chat.choices[0].finish_reason == "stop"
    assert chat.usage.completion_tokens == 1  # the stop token ended it, and is not in the text
    text = client.completions.create(**kwargs, prompt="Hello", extra_body={"stop_token_ids": [7, token_a]})
    assert text.choices[0].text == "" and text.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(**kwargs, messages=HELLO, extra_body={"stop_token_ids": [-1]})
    assert error.value.body["param"] == "stop_token_ids"


def test_n_choices_start_together_without_hanging(client) -> None:
    """Choices 1..n-1 start together. Before each got a Serve internal request id of its own they
    shared the HTTP request's, and Serve's router left all but one of them waiting for a replica
    forever: after a plain request, an n=4 request hung every time (here: until this timeout)."""
    quick = client.with_options(timeout=60)
    for seed in range(2):
        quick.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
        reply = quick.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, n=4, seed=seed)
        assert [c.index for c in reply.choices] == [0, 1, 2, 3]
        assert reply.usage.completion_tokens == 16


def test_n_choices_share_the_prompt_pages_and_seed_reproduces_them(client, live_app) -> None:
    page_size = live_app.engine_stats().num_total_pages and 16  # tiny preset: P = 16
    long_prompt = [{"role": "user", "content": "tell me something " * 12}]  # > 200 byte tokens
    kwargs = dict(model=MODEL, messages=long_prompt, max_tokens=8, temperature=1.0, seed=11, n=3)
    first = client.chat.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    prompt = first.usage.prompt_tokens
    # choices 1 and 2 reuse every full page choice 0 prefilled (at least those before the last token)
    assert first.usage.prompt_tokens_details.cached_tokens >= 2 * ((prompt - 1) // page_size) * page_size
    again = client.chat.completions.create(**kwargs)
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in again.choices]
    assert len(set(texts)) > 1
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = [
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
        for i in range(3)
    ]
    assert streamed == texts


def test_logit_bias_and_penalties(client) -> None:
    token_a = 3 + ord("a")  # the byte tokenizer: ids 3–258 are the bytes
    kwargs = dict(model=MODEL, messages=HELLO, max_tokens=12, temperature=0)
    forced = client.chat.completions.create(**kwargs, logit_bias={str(token_a): 100})
    assert forced.choices[0].message.content == "a" * 12
    plain = client.chat.completions.create(**kwargs).choices[0].message.content
    penalized = (
        client.chat.completions.create(
            **kwargs, frequency_penalty=2.0, presence_penalty=2.0, extra_body={"repetition_penalty": 1.5}
        )
        .choices[0]
        .message.content
    )
    assert penalized != plain
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(**kwargs, presence_penalty=2.5)
    assert error.value.body["param"] == "presence_penalty"


def test_calls_before_a_cut_off_call_are_kept() -> None:
    from msaserve.platform.tools import parse_tool_calls

    whole = '<tool_call>\n{"name": "get_time", "arguments": {"utc": true}}\n</tool_call>'
    content, calls = parse_tool_calls(whole + '\n<tool_call>\n{"name": "get_wea', {"get_time", "get_weather"})
    assert [c.name for c in calls] == ["get_time"] and content is None
