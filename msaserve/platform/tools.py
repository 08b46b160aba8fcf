"""Tool calling: the Hermes format (documented in docs/api.md) and the `ToolFormat` a chat
template may define instead (`tool_formats.py` picks one per model).

Hermes: the tools are described to the model in a system message; the model calls one by writing
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; tool results go back as
`<tool_response>...</tool_response>`. `tool_choice` "required" or a named function is enforced by
starting the assistant's reply with the opening of a call, which the model then completes.
"""

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from msaserve.platform.errors import APIError
from msaserve.platform.openai_types import ChatCompletionRequest, NamedToolChoice, Tool, ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"

_SYSTEM_TEMPLATE = """You may call one or more functions to help with the user's request.
The functions are described, as JSON schemas, inside <tools></tools>:
<tools>
{tools}
</tools>
To call a function, reply with a JSON object inside <tool_call></tool_call> tags, one per call:
<tool_call>
{{"name": "<function name>", "arguments": {{<arguments as a JSON object>}}}}
</tool_call>"""


def tools_system_prompt(tools: list[Tool]) -> str:
    return _SYSTEM_TEMPLATE.format(tools="\n".join(t.model_dump_json(exclude_none=True) for t in tools))


def forced_name(request: ChatCompletionRequest) -> str | None:
    """The function the reply must call: the named tool_choice, or the only tool under "required"."""
    choice, tools = request.tool_choice, request.tools or []
    if isinstance(choice, NamedToolChoice) and tools:
        return choice.function.name
    if choice == "required" and len(tools) == 1:
        return tools[0].function.name
    return None


def forced_prefix(request: ChatCompletionRequest, fmt: "ToolFormat | None" = None) -> str:
    """The start of the reply that forces a call: "required" → any tool, named → that tool."""
    choice = request.tool_choice
    if not request.tools or choice in (None, "none", "auto"):
        return ""
    if isinstance(choice, NamedToolChoice):
        names = {t.function.name for t in request.tools}
        if choice.function.name not in names:
            raise APIError(
                400,
                f"tool_choice names function {choice.function.name!r}, "
                f"which is not among tools: {sorted(names)}",
                param="tool_choice",
                code="invalid_value",
            )
    return (fmt or HERMES).call_prefix(forced_name(request))


def _hermes_prefix(name: str | None) -> str:
    if name is None:  # "required" with several tools: the model picks the name
        return OPEN + '\n{"name": "'
    return OPEN + '\n{"name": ' + json.dumps(name) + ', "arguments": '


def render_tool_call(call: ToolCall) -> str:
    try:
        arguments = json.loads(call.function.arguments)
    except json.JSONDecodeError:
        arguments = call.function.arguments
    return OPEN + "\n" + json.dumps({"name": call.function.name, "arguments": arguments}) + "\n" + CLOSE


def render_tool_result(content: str) -> str:
    return "<tool_response>\n" + content + "\n</tool_response>"


@dataclass
class ParsedToolCall:
    id: str
    name: str
    arguments: str


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolFormat:
    """How one model writes tool calls: between `open` and `close`, one block per call site."""

    name: str
    open: str
    close: str
    native: bool
    """The chat template renders tools, assistant tool_calls and tool results itself (they are
    passed to it as structured messages); otherwise they are written as text in this format."""
    parse_block: Callable[[str, set[str]], list[ParsedToolCall] | None]
    """The text between open and close → its calls of known tools, None if it does not parse."""
    call_prefix: Callable[[str | None], str]
    """The start of a reply that forces a call: of any tool (None) or of the named one."""
    forced_call: Callable[[str, str], ParsedToolCall]
    """(reply text, name) → the call a named tool_choice makes, whatever the model wrote."""


def _parse_one(block: str, known: set[str]) -> ParsedToolCall | None:
    """One call's JSON; tolerant of trailing text after the object (small models ramble)."""
    try:
        obj, _ = json.JSONDecoder().raw_decode(block.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in known:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return ParsedToolCall(id=new_call_id(), name=obj["name"], arguments=text)


def _parse_hermes_block(block: str, known: set[str]) -> list[ParsedToolCall] | None:
    call = _parse_one(block, known)
    return None if call is None else [call]


def _forced_call(text: str, name: str) -> ParsedToolCall:
    """tool_choice named `name`: the reply is that call whatever the model wrote as arguments
    (OpenAI documents that arguments may not be valid JSON; callers must check)."""
    head = OPEN + '\n{"name": ' + json.dumps(name) + ', "arguments": '
    body = text[len(head) :] if text.startswith(head) else text
    body = body.split(CLOSE)[0].strip()
    try:
        obj, _ = json.JSONDecoder().raw_decode(body)
        arguments = json.dumps(obj)
    except json.JSONDecodeError:
        arguments = body.removesuffix("}").strip()
    return ParsedToolCall(id=new_call_id(), name=name, arguments=arguments)


HERMES = ToolFormat("hermes", OPEN, CLOSE, False, _parse_hermes_block, _hermes_prefix, _forced_call)


def parse_reply(
    text: str, known: set[str], forced: str | None, fmt: ToolFormat | None = None
) -> tuple[str | None, list[ParsedToolCall]]:
    """(content, calls) of a complete reply; with a named tool_choice there is always one call."""
    fmt = fmt or HERMES
    content, calls = parse_tool_calls(text, known, fmt)
    if forced and not calls:
        return None, [fmt.forced_call(text, forced)]
    return content, calls


def parse_tool_calls(
    text: str, known: set[str], fmt: ToolFormat | None = None
) -> tuple[str | None, list[ParsedToolCall]]:
    """Split a complete reply into (content before the first call, calls). A block that does not
    parse as a call of a known tool stays in the content, so nothing the model wrote is lost."""
    fmt = fmt or HERMES
    start = text.find(fmt.open)
    if start < 0:
        return text, []
    calls: list[ParsedToolCall] = []
    rest = text[start:]
    while rest.startswith(fmt.open):
        end = rest.find(fmt.close)
        opened = len(fmt.open)
        block, rest = (rest[opened:end], rest[end + len(fmt.close):]) if end >= 0 else (rest[opened:], "")
        parsed = fmt.parse_block(block, known)
        if parsed is None:
            return text, []
        calls.extend(parsed)
        rest = rest.lstrip()
    content = text[:start].strip()
    return (content or None), calls


class StreamingToolParser:
    """Streams content until a `<tool_call>` may be starting, then holds everything back; `finish()`
    parses the held text. `feed` returns the content that is safe to send now."""

    def __init__(
        self, known: set[str], prefix: str = "", forced: str | None = None, fmt: ToolFormat | None = None
    ) -> None:
        self.known = known
        self.forced = forced
        self.fmt = fmt or HERMES
        self._held = ""
        self._in_call = False
        self._sent_content = False
        if prefix:
            self.feed(prefix)

    def feed(self, text: str) -> str:
        if self._in_call:
            self._held += text
            return ""
        buffer = self._held + text
        start = buffer.find(self.fmt.open)
        if start >= 0:
            self._in_call = True
            self._held = buffer[start:]
            return self._emit(buffer[:start])
        keep = _partial_marker_len(buffer, self.fmt.open)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return self._emit(buffer[: len(buffer) - keep])

    def _emit(self, text: str) -> str:
        self._sent_content = self._sent_content or bool(text)
        return text

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        """(content not yet sent, parsed calls); an unparsable held block is returned as content."""
        held, self._held = self._held, ""
        if not self._in_call:
            return held, []
        _, calls = parse_reply(held, self.known, self.forced, self.fmt)
        return ("", calls) if calls else (held, [])


def _partial_marker_len(text: str, marker: str = OPEN) -> int:
    """Length of the longest suffix of text that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
