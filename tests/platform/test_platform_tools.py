"""Hermes-style tool calls: prompt rendering, parsing whole replies and streamed ones."""

import json

import pytest

from msaserve.platform.errors import APIError
from msaserve.platform.openai_types import ChatCompletionRequest
from msaserve.platform.tools import (
    OPEN,
    StreamingToolParser,
    forced_name,
    forced_prefix,
    parse_reply,
    parse_tool_calls,
    tools_system_prompt,
)

KNOWN = {"get_weather", "search"}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def request(**kwargs) -> ChatCompletionRequest:
    tools = [
        {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in sorted(KNOWN)
    ]
    return ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "hi"}], tools=tools, **kwargs
    )


def test_plain_text_has_no_calls() -> None:
    assert parse_tool_calls("The capital is Paris.", KNOWN) == ("The capital is Paris.", [])


def test_one_call_with_leading_content() -> None:
    content, calls = parse_tool_calls("Let me check.\n" + CALL, KNOWN)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]


def test_parallel_calls_and_missing_close_tag() -> None:
    text = CALL + '\n<tool_call>{"name": "search", "arguments": {"q": "rain"}}'
    content, calls = parse_tool_calls(text, KNOWN)
    assert content is None
    assert [c.name for c in calls] == ["get_weather", "search"]


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "unknown_tool", "arguments": {}}</tool_call>',
        "<tool_call>not json</tool_call>",
        '<tool_call>["name"]</tool_call>',
    ],
)
def test_unparsable_or_unknown_calls_stay_content(text: str) -> None:
    assert parse_tool_calls(text, KNOWN) == (text, [])


def test_named_choice_always_yields_that_call() -> None:
    prefix = forced_prefix(request(tool_choice={"type": "function", "function": {"name": "search"}}))
    content, calls = parse_reply(prefix + '{"q": "x"}}\n</tool_call>', KNOWN, "search")
    assert content is None and calls[0].name == "search" and json.loads(calls[0].arguments) == {"q": "x"}
    _, garbled = parse_reply(prefix + "q=x}", KNOWN, "search")
    assert garbled[0].name == "search" and garbled[0].arguments == "q=x"


def test_forced_prefixes_and_unknown_named_tool() -> None:
    assert forced_prefix(request(tool_choice="auto")) == ""
    assert forced_prefix(request(tool_choice="required")).startswith(OPEN)
    with pytest.raises(APIError, match="'nope', which is not among tools") as info:
        forced_prefix(request(tool_choice={"type": "function", "function": {"name": "nope"}}))
    assert info.value.status == 400 and info.value.param == "tool_choice"


def test_system_prompt_lists_every_tool() -> None:
    text = tools_system_prompt(request().tools)
    assert '"name":"get_weather"' in text and '"name":"search"' in text and "<tool_call>" in text


@pytest.mark.parametrize("piece", [1, 2, 3, 7])
def test_streaming_parser_holds_back_only_what_may_be_a_call(piece: int) -> None:
    text = "Checking the weather" + CALL
    parser = StreamingToolParser(KNOWN)
    sent = "".join(parser.feed(text[i : i + piece]) for i in range(0, len(text), piece))
    rest, calls = parser.finish()
    assert sent + rest == "Checking the weather"
    assert [c.name for c in calls] == ["get_weather"]


def test_streaming_parser_releases_a_lone_angle_bracket() -> None:
    parser = StreamingToolParser(KNOWN)
    sent = parser.feed("a <to") + parser.feed("day> b")
    assert sent + parser.finish()[0] == "a <today> b"


def test_required_with_one_tool_forces_that_tool() -> None:
    one = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "hi"}], tool_choice="required",
        tools=[{"type": "function", "function": {"name": "search"}}],
    )  # fmt: skip
    assert forced_prefix(one).endswith('{"name": "search", "arguments": ')
    assert forced_name(one) == "search"
    assert forced_name(request(tool_choice="required")) is None
