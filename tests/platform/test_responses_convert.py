"""Responses API requests → the chat request the shared path renders (no model): input items become
chat messages, consecutive function calls one assistant turn, errors name the Responses field."""

import pytest

from msaserve.platform.errors import APIError
from msaserve.platform.response_store import ResponseStore, StoredResponse
from msaserve.platform.responses_convert import (
    as_responses_error,
    assistant_message,
    call_ids_of,
    chat_request,
    input_messages,
    output_items,
)
from msaserve.platform.responses_types import ResponsesRequest
from msaserve.platform.tools import ParsedToolCall

TOOL = {"type": "function", "name": "get_time", "parameters": {"type": "object"}, "strict": True}


def _body(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", **fields})


def test_items_become_chat_messages() -> None:
    body = _body(input=[
        {"role": "developer", "content": "be brief"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                        {"type": "input_text", "text": "b"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": '{"utc": true}'},
        {"type": "function_call_output", "call_id": "c1", "output": "noon"},
    ], instructions="sys", tools=[TOOL], tool_choice={"type": "function", "name": "get_time"},
        text={"format": {"type": "json_object"}}, max_output_tokens=7)
    messages = input_messages(body, set())
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    assert messages[1]["content"] == "ab"
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["c1", "c2"]  # one assistant turn
    chat = chat_request(body, messages)
    assert chat.messages[0].content == "sys" and chat.max_completion_tokens == 7
    assert chat.tools[0].function.name == "get_time" and chat.tools[0].function.strict
    assert chat.tool_choice.function.name == "get_time" and chat.response_format.type == "json_object"


def test_a_call_output_must_answer_a_known_call() -> None:
    body = _body(input=[{"type": "function_call_output", "call_id": "c9", "output": "x"}])
    with pytest.raises(APIError) as error:
        input_messages(body, set())
    assert error.value.param == "input[0].call_id"
    assert input_messages(body, {"c9"})[0] == {"role": "tool", "content": "x", "tool_call_id": "c9"}


def test_json_schema_needs_a_name_and_errors_name_responses_fields() -> None:
    body = _body(input="hi", text={"format": {"type": "json_schema", "schema": {"type": "object"}}})
    with pytest.raises(APIError) as error:
        chat_request(body, input_messages(body, set()))
    assert error.value.param == "text.format.name"
    renamed = as_responses_error(APIError(400, "max_completion_tokens=9 is big", "max_completion_tokens"))
    assert renamed.param == "max_output_tokens" and renamed.message.startswith("max_output_tokens=9")
    assert as_responses_error(APIError(400, "x", "messages")).param == "input"


def test_output_round_trips_into_the_next_turn() -> None:
    items = output_items("hello", [ParsedToolCall("call_1", "get_time", "{}")], incomplete=False)
    assert [i.type for i in items] == ["message", "function_call"] and items[1].call_id == "call_1"
    message = assistant_message(items)
    assert message["content"] == "hello" and call_ids_of([message]) == {"call_1"}


def test_store_keeps_the_most_recently_used() -> None:
    store = ResponseStore(max_responses=2)
    for key in "abc":
        store.put(key, StoredResponse({"id": key}, [], "s"))
    assert store.get("a") is None and store.get("b") is not None
    store.put("d", StoredResponse({"id": "d"}, [], "s"))  # "c" is now the least recently used
    assert store.get("c") is None and len(store) == 2 and store.delete("b") and not store.delete("b")
