"""Tool calls in the format an M3 chat template defines (MiniMax's `<minimax:tool_call>` XML):
the template renders the tools and the conversation's calls itself, replies are parsed in that
format, whole and streamed. The template is the test checkpoint's (transformers ships no M3
chat template; tests/models/m3_checkpoint.py writes a MiniMax-style one)."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from m3_checkpoint import BOS, EOS, VOCAB_SIZE, write_tokenizer

from msaserve.models.loader import _directory_tokenizer
from msaserve.platform.chat_prompt import render_prompt
from msaserve.platform.openai_types import ChatCompletionRequest
from msaserve.platform.tool_formats import tool_format_of
from msaserve.platform.tools import HERMES, StreamingToolParser, parse_reply
from msaserve.platform.tools_minimax import MINIMAX

KNOWN = {"get_weather", "search"}
REPLY = (
    "Let me look.\n<minimax:tool_call>\n<invoke name=\"get_weather\">\n"
    "<parameter name=\"city\">Paris</parameter>\n<parameter name=\"days\">3</parameter>\n</invoke>\n"
    "<invoke name=\"search\">\n<parameter name=\"query\">rain gear</parameter>\n</invoke>\n"
    "</minimax:tool_call>"
)
TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    for name in sorted(KNOWN)
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok")
    write_tokenizer(directory)
    ids = SimpleNamespace(vocab_size=VOCAB_SIZE, bos_token_id=BOS, eos_token_id=EOS, eos_token_ids=(EOS,))
    return _directory_tokenizer(directory, ids)


def test_the_template_picks_the_format(tokenizer) -> None:
    assert tool_format_of(tokenizer) is MINIMAX
    assert tool_format_of(object()) is HERMES


def test_reply_with_two_invokes_parses_to_two_calls() -> None:
    content, calls = parse_reply(REPLY, KNOWN, None, MINIMAX)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 3}), ("search", {"query": "rain gear"}),
    ]


def test_unknown_tool_stays_content() -> None:
    text = REPLY.replace('"search"', '"delete_everything"')
    assert parse_reply(text, KNOWN, None, MINIMAX) == (text, [])


def test_streamed_reply_holds_the_call_back() -> None:
    parser = StreamingToolParser(KNOWN, fmt=MINIMAX)
    sent = "".join(parser.feed(REPLY[i:i + 5]) for i in range(0, len(REPLY), 5))
    rest, calls = parser.finish()
    assert (sent + rest).strip() == "Let me look." and [c.name for c in calls] == ["get_weather", "search"]


def test_template_renders_tools_calls_and_results_itself(tokenizer) -> None:
    body = ChatCompletionRequest(model="m", tools=TOOLS, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ])
    prompt, prefix, media = render_prompt(tokenizer, body)
    assert prefix == "" and media == []
    assert prompt.startswith("]~!b[]~b]system\nYou may call these tools:\n<tools>\n")
    assert '<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n</invoke>' in prompt
    assert "]~b]tool\n<response>sunny</response>[e~[\n" in prompt and prompt.endswith("]~b]ai\n")
    assert "<tool_call>" not in prompt  # no Hermes system prompt


def test_named_tool_choice_starts_the_invoke(tokenizer) -> None:
    body = ChatCompletionRequest(model="m", tools=TOOLS, messages=[{"role": "user", "content": "hi"}],
                                 tool_choice={"type": "function", "function": {"name": "search"}})
    prompt, prefix, _ = render_prompt(tokenizer, body)
    assert prefix == '<minimax:tool_call>\n<invoke name="search">\n' and prompt.endswith(prefix)
    reply = prefix + '<parameter name="query">x</parameter>\n</invoke>\n'
    _, calls = parse_reply(reply, KNOWN, "search", MINIMAX)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("search", {"query": "x"})]
