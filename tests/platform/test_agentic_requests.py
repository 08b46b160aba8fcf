"""Requests → grammar specs (no server): which constraint a chat request gets, and its refusals."""

import json

import pytest

from msaserve.platform.errors import APIError
from msaserve.platform.openai_types import ChatCompletionRequest
from msaserve.platform.structured_request import chat_grammar
from msaserve.platform.tool_formats import MINIMAX
from msaserve.platform.tools import HERMES

TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **fields)


def test_required_call_is_a_hermes_grammar_and_parallel_false_allows_one() -> None:
    spec = chat_grammar(chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), HERMES)
    assert spec.kind == "lark" and spec.param == "tools"
    assert '"const": "search"' in spec.source and 'call ("\\n" call)*' not in spec.source
    assert 'call ("\\n" call)*' in chat_grammar(chat(tools=TOOLS, tool_choice="required"), HERMES).source
    assert chat_grammar(chat(tools=TOOLS, tool_choice="auto"), HERMES) is None


def test_a_templates_own_format_keeps_its_prefix_instead() -> None:
    assert chat_grammar(chat(tools=TOOLS, tool_choice="required"), MINIMAX) is None


def test_json_schema_strictness_and_refusals() -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}, "strict": True}}
    spec = chat_grammar(chat(response_format=fmt))
    assert spec.kind == "json_schema" and spec.strict and json.loads(spec.source)["type"] == "object"
    with pytest.raises(APIError) as error:
        chat_grammar(chat(response_format=fmt, tools=TOOLS, tool_choice="required"))
    assert error.value.param == "response_format"
    with pytest.raises(APIError) as error:
        chat_grammar(chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}))
    assert error.value.param == "tool_choice" and "nope" in error.value.message
    with pytest.raises(APIError):
        chat_grammar(chat(response_format={"type": "regex"}))


@pytest.mark.parametrize(
    ("choice", "shown"),
    [("required", "required"), ({"type": "function", "function": {"name": "search"}}, "function 'search'")],
)
@pytest.mark.parametrize("tools", [None, []])
def test_a_forcing_tool_choice_without_tools_is_refused(choice, shown: str, tools) -> None:
    """It used to be ignored: the reply came back without the call the request asked for."""
    with pytest.raises(APIError) as error:
        chat_grammar(chat(tools=tools, tool_choice=choice), HERMES)
    assert error.value.status == 400 and error.value.param == "tool_choice"
    assert f"tool_choice={shown} is invalid without tools" in error.value.message
    for allowed in ("none", "auto", None):
        assert chat_grammar(chat(tools=tools, tool_choice=allowed), HERMES) is None


def test_a_tools_pointers_are_rebased_into_its_own_schema_and_nothing_else_is() -> None:
    from msaserve.platform.structured_request import _rebased

    schema = {"a": {"$ref": "#"}, "b": {"$ref": "#/$defs/X"}, "c": {"$ref": "#anchor"},
              "d": [{"$ref": "https://example.com/s#/y"}], "properties": {"$ref": {"type": "string"}}}
    assert _rebased(schema, "#/$defs/tool_0") == {
        "a": {"$ref": "#/$defs/tool_0"}, "b": {"$ref": "#/$defs/tool_0/$defs/X"}, "c": {"$ref": "#anchor"},
        "d": [{"$ref": "https://example.com/s#/y"}], "properties": {"$ref": {"type": "string"}},
    }
