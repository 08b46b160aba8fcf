"""Tool calls in MiniMax's format (MiniMax-M2/M3 chat templates):

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    <parameter name="days">3</parameter>
    </invoke>
    </minimax:tool_call>

One block may hold several invokes. The template renders the tools, the assistant's calls and the
tool results itself (`native`). Parameter values are text: a value that parses as a JSON number,
boolean, null, array or object becomes that value, anything else stays a string.
"""

import json
import re
from typing import Any

from msaserve.platform.tools import ParsedToolCall, ToolFormat, new_call_id

OPEN, CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"
_INVOKE = re.compile(r'<invoke name="([^"]+)">(.*?)</invoke>', re.DOTALL)
_PARAMETER = re.compile(r'<parameter name="([^"]+)">(.*?)</parameter>', re.DOTALL)


def _value(text: str) -> Any:
    text = text.strip("\n")
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return text if isinstance(value, str) else value


def _arguments(body: str) -> str:
    return json.dumps({name: _value(value) for name, value in _PARAMETER.findall(body)}, ensure_ascii=False)


def parse_block(block: str, known: set[str]) -> list[ParsedToolCall] | None:
    """The invokes of one block → calls; None when there is none or one names an unknown tool."""
    invokes = _INVOKE.findall(block)
    if not invokes or any(name not in known for name, _ in invokes):
        return None
    return [ParsedToolCall(id=new_call_id(), name=name, arguments=_arguments(body)) for name, body in invokes]


def call_prefix(name: str | None) -> str:
    if name is None:
        return OPEN + '\n<invoke name="'
    return OPEN + f'\n<invoke name="{name}">\n'


def forced_call(text: str, name: str) -> ParsedToolCall:
    """A named tool_choice: the call of `name` with whatever parameters the reply holds."""
    return ParsedToolCall(id=new_call_id(), name=name, arguments=_arguments(text.split(CLOSE)[0]))


MINIMAX = ToolFormat("minimax", OPEN, CLOSE, True, parse_block, call_prefix, forced_call)
