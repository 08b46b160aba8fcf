"""The streamed reply parser (`platform/tool_stream.py`): content as it comes, a Hermes call committed
once its name is known, its arguments in pieces that add up to the value as written — whatever the
sizes of the pieces the engine hands it. No model: the replies are written out here."""

import json
import random

import pytest

from msaserve.platform.tool_stream import (
    ArgumentsDelta,
    CallFinished,
    CallStarted,
    Text,
    calls_of,
    tool_stream_parser,
)
from msaserve.platform.tools import HERMES, parse_reply
from msaserve.platform.tools_minimax import MINIMAX

KNOWN = {"get_weather", "get_time"}
TWO_CALLS = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"unit": "c", "note": "a}\\"b"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"utc": true}}\n</tool_call> bye'
)


def _run(reply: str, seed: int, known: set[str] = KNOWN, forced: str | None = None, fmt=HERMES) -> list:
    parser = tool_stream_parser(known, "", forced, fmt)
    rnd, events, i = random.Random(seed), [], 0
    while i < len(reply):
        size = rnd.randint(1, 7)
        events += parser.feed(reply[i : i + size])
        i += size
    return events + parser.finish()


def _text(events: list) -> str:
    return "".join(e.text for e in events if isinstance(e, Text))


@pytest.mark.parametrize("seed", range(20))
def test_calls_stream_and_match_the_whole_reply_parse(seed) -> None:
    events = _run(TWO_CALLS, seed)
    content, whole = parse_reply(TWO_CALLS, KNOWN, None)
    assert _text(events).strip() == content
    calls = calls_of(events)
    assert [c.name for c in calls] == [c.name for c in whole]
    assert [json.loads(c.arguments) for c in calls] == [json.loads(c.arguments) for c in whole]
    for call_index, call in enumerate(calls):
        pieces = [e.text for e in events if isinstance(e, ArgumentsDelta) and e.index == call_index]
        assert "".join(pieces) == call.arguments
    started = [e for e in events if isinstance(e, CallStarted)]
    assert [e.index for e in started] == [0, 1] and all(e.id.startswith("call_") for e in started)
    # a call's start comes before its arguments, which come before its end
    order = [(type(e).__name__, e.index) for e in events if not isinstance(e, Text)]
    first = [order.index((kind, 0)) for kind in ("CallStarted", "ArgumentsDelta", "CallFinished")]
    assert first == sorted(first)


def test_arguments_stream_before_the_call_is_complete() -> None:
    parser = tool_stream_parser(KNOWN, "", None, HERMES)
    events = parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"unit": ')
    assert [type(e) for e in events] == [CallStarted, ArgumentsDelta]
    assert events[1].text == '{"unit": '
    assert parser.feed('"f"}}\n</tool_call>') == [ArgumentsDelta(0, '"f"}'), CallFinished(0, '{"unit": "f"}')]
    assert parser.finish() == []


def test_unknown_name_or_no_call_stays_content() -> None:
    reply = 'x <tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>'
    for seed in range(5):
        events = _run(reply, seed)
        assert calls_of(events) == [] and _text(events) == reply
    assert _text(_run("just <tool text> here <tool_c", 1)) == "just <tool text> here <tool_c"


def test_other_key_order_is_parsed_whole_at_the_block_end() -> None:
    reply = '<tool_call>\n{"arguments": {"utc": false}, "name": "get_time"}\n</tool_call>'
    events = _run(reply, 3)
    (call,) = calls_of(events)
    assert call.name == "get_time" and json.loads(call.arguments) == {"utc": False} and _text(events) == ""


def test_cut_off_arguments_end_the_call_with_what_was_written() -> None:
    events = _run('<tool_call>\n{"name": "get_time", "arguments": {"ut', 2)
    (call,) = calls_of(events)
    assert call.name == "get_time" and call.arguments == '{"ut'


def test_a_named_choice_always_yields_its_call() -> None:
    events = _run("no call at all", 0, forced="get_time")
    assert [c.name for c in calls_of(events)] == ["get_time"]


def test_a_template_format_sends_each_call_whole_at_the_end() -> None:
    reply = 'hi <minimax:tool_call>\n<invoke name="get_time">\n<parameter name="utc">true</parameter>\n' \
            '</invoke>\n</minimax:tool_call>'
    content, whole = parse_reply(reply, KNOWN, None, MINIMAX)
    events = _run(reply, 4, fmt=MINIMAX)
    assert [(c.name, c.arguments) for c in calls_of(events)] == [(c.name, c.arguments) for c in whole]
    assert _text(events).strip() == content


def test_arguments_written_as_a_string_are_parsed_whole() -> None:
    reply = '<tool_call>\n{"name": "get_time", "arguments": "{\\"utc\\": true}"}\n</tool_call>'
    events = _run(reply, 6)
    (call,) = calls_of(events)
    assert call.arguments == parse_reply(reply, KNOWN, None)[1][0].arguments == '{"utc": true}'
