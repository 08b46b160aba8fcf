"""A reply streamed as events: content text, and tool calls whose arguments arrive as they are written.

    parser = tool_stream_parser(known, prefix, forced, fmt)
    parser.feed(text) -> [Text | CallStarted | ArgumentsDelta | CallFinished]   # per engine output
    parser.finish()   -> [...]                                                  # at the end

Hermes (`tools.py`): a call is committed once its head `<tool_call>\\n{"name": "<known tool>",
"arguments": {` is there (`CallStarted` with the call's id and name); the arguments' JSON object
then streams as written (`ArgumentsDelta`, concatenated they are the value's text) and ends at the
value's last character (`CallFinished`); the rest of the block (`}`, `</tool_call>`) is dropped. A
block whose head does not match (another key order, an unknown name, arguments that are not an
object or array, e.g. a JSON string) is held to its end and parsed
whole, as the non-streamed reply is; a block that does not parse stays content while no call was
sent. Text after the last call is dropped, as in the non-streamed reply.

Other formats (a chat template's own, e.g. MiniMax) keep the held-block parser
(`tools.StreamingToolParser`): each call comes whole when the reply ends.
"""

import json
import re
from dataclasses import dataclass

from msaserve.platform.tools import (
    HERMES,
    ParsedToolCall,
    StreamingToolParser,
    ToolFormat,
    _partial_marker_len,
    new_call_id,
)


@dataclass
class Text:
    text: str


@dataclass
class CallStarted:
    index: int
    """0, 1, ... in the order the calls appear in the reply."""
    id: str
    name: str


@dataclass
class ArgumentsDelta:
    index: int
    text: str


@dataclass
class CallFinished:
    index: int
    arguments: str
    """The whole arguments text (the concatenated deltas)."""


Event = Text | CallStarted | ArgumentsDelta | CallFinished

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_MAX_HEAD_CHARS = 400
"""A block whose head has not matched within this many characters is parsed whole at its end."""


class _JSONValueEnd:
    """Finds where a JSON object or array ends, fed a character at a time (strings and escapes skipped)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.started = False

    def feed(self, ch: str) -> bool:
        """True when `ch` (part of the value) ends it."""
        self.started = True
        if self.in_string:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
            return False
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            return self.depth == 0
        return False


class HermesStreamParser:
    """Hermes replies as events (see the module docstring)."""

    def __init__(self, known: set[str], prefix: str = "", forced: str | None = None) -> None:
        self.known, self.forced = known, forced
        self._mode = "content"  # content | head | args | tail | between
        self._held = ""
        self._calls = 0
        self._args_text = ""
        self._value: _JSONValueEnd | None = None
        self._pending: list[Event] = []
        if prefix:
            self._pending = self.feed(prefix)

    def feed(self, text: str) -> list[Event]:
        events, self._pending = self._pending, []
        self._held += text
        while self._held:
            before = (self._mode, len(self._held))
            getattr(self, "_" + self._mode)(events)
            if (self._mode, len(self._held)) == before:
                break  # waiting for more text
        return events

    def _content(self, events: list[Event]) -> None:
        start = self._held.find(HERMES.open)
        if start < 0:
            keep = _partial_marker_len(self._held, HERMES.open)
            self._emit_text(events, self._held[: len(self._held) - keep])
            self._held = self._held[len(self._held) - keep :]
            return
        self._emit_text(events, self._held[:start])
        self._held = self._held[start + len(HERMES.open) :]
        self._mode = "head"

    def _emit_text(self, events: list[Event], text: str) -> None:
        if text:
            events.append(Text(text))

    def _head(self, events: list[Event]) -> None:
        match = _HEAD.match(self._held)
        name = json.loads(match.group(1)) if match else None
        value_start = self._held[match.end() : match.end() + 1] if match else ""
        if match and not value_start:
            return  # the arguments' first character decides
        if name in self.known and value_start in ("{", "["):
            events.append(CallStarted(self._calls, new_call_id(), name))
            self._held = self._held[match.end() :]
            self._mode, self._args_text, self._value = "args", "", _JSONValueEnd()
            return
        close = self._held.find(HERMES.close)
        if close >= 0 or len(self._held) > _MAX_HEAD_CHARS or match:
            self._mode = "opaque"
            self._opaque(events)

    def _opaque(self, events: list[Event]) -> None:
        """A block parsed whole once its close tag is there."""
        close = self._held.find(HERMES.close)
        if close < 0:
            return
        block, self._held = self._held[:close], self._held[close + len(HERMES.close) :]
        self._mode = "between"
        calls = HERMES.parse_block(block, self.known)
        if calls:
            for call in calls:
                events.extend(self._whole_call(call))
        elif not self._calls:
            self._emit_text(events, HERMES.open + block + HERMES.close)
            self._mode = "content"

    def _whole_call(self, call: ParsedToolCall) -> list[Event]:
        index, self._calls = self._calls, self._calls + 1
        return [CallStarted(index, call.id, call.name), ArgumentsDelta(index, call.arguments),
                CallFinished(index, call.arguments)]

    def _args(self, events: list[Event]) -> None:
        assert self._value is not None
        for i, ch in enumerate(self._held):
            if not self._value.started and ch.isspace():
                continue
            if self._value.feed(ch):
                self._end_args(events, self._held[: i + 1], self._held[i + 1 :])
                return
        piece, self._held = self._held, ""
        self._send_args(events, piece)

    def _send_args(self, events: list[Event], piece: str) -> None:
        piece = piece.lstrip() if not self._args_text else piece
        if piece:
            self._args_text += piece
            events.append(ArgumentsDelta(self._calls, piece))

    def _end_args(self, events: list[Event], piece: str, rest: str) -> None:
        self._send_args(events, piece)
        events.append(CallFinished(self._calls, self._args_text))
        self._calls += 1
        self._held, self._mode = rest, "tail"

    def _tail(self, events: list[Event]) -> None:
        close = self._held.find(HERMES.close)
        if close >= 0:
            self._held, self._mode = self._held[close + len(HERMES.close) :], "between"
        else:  # drop what cannot start the close tag
            self._held = self._held[len(self._held) - _partial_marker_len(self._held, HERMES.close) :]

    def _between(self, events: list[Event]) -> None:
        stripped = self._held.lstrip()
        if stripped.startswith(HERMES.open):
            self._held, self._mode = stripped[len(HERMES.open) :], "head"
        elif HERMES.open.startswith(stripped):
            self._held = stripped  # maybe the start of another call
        else:
            self._held = ""  # text after the last call is dropped

    def finish(self) -> list[Event]:
        events, self._pending = self._pending, []
        held, self._held = self._held, ""
        if self._mode == "content":
            self._emit_text(events, held)
        elif self._mode == "args":  # cut off (max_tokens) inside the arguments
            self._send_args(events, held)
            events.append(CallFinished(self._calls, self._args_text))
            self._calls += 1
        elif self._mode in ("head", "opaque"):  # cut off inside a block not yet committed
            events.extend(self._unfinished_block(held))
        if self.forced and not self._calls:
            events.extend(self._whole_call(HERMES.forced_call(held, self.forced)))
        return events

    def _unfinished_block(self, block: str) -> list[Event]:
        calls = HERMES.parse_block(block, self.known)
        if calls:
            return [event for call in calls for event in self._whole_call(call)]
        if self._calls or self.forced:
            return []
        return [Text(HERMES.open + block)]


class HeldBlockStreamParser:
    """Events from `tools.StreamingToolParser`: content as it comes, every call whole at the end."""

    def __init__(self, known: set[str], prefix: str, forced: str | None, fmt: ToolFormat) -> None:
        self._parser = StreamingToolParser(known, prefix, forced, fmt)

    def feed(self, text: str) -> list[Event]:
        sent = self._parser.feed(text)
        return [Text(sent)] if sent else []

    def finish(self) -> list[Event]:
        rest, calls = self._parser.finish()
        events: list[Event] = [Text(rest)] if rest else []
        for index, call in enumerate(calls):
            events += [CallStarted(index, call.id, call.name), ArgumentsDelta(index, call.arguments),
                       CallFinished(index, call.arguments)]
        return events


class PlainStreamParser:
    """No tools: every piece of text is content."""

    def feed(self, text: str) -> list[Event]:
        return [Text(text)] if text else []

    def finish(self) -> list[Event]:
        return []


def tool_stream_parser(
    known: set[str], prefix: str, forced: str | None, fmt: ToolFormat
) -> HermesStreamParser | HeldBlockStreamParser | PlainStreamParser:
    if not known:
        return PlainStreamParser()
    if fmt.name == HERMES.name:
        return HermesStreamParser(known, prefix, forced)
    return HeldBlockStreamParser(known, prefix, forced, fmt)


def calls_of(events: list[Event]) -> list[ParsedToolCall]:
    """The calls a list of events (all of one reply) describes."""
    started = {e.index: e for e in events if isinstance(e, CallStarted)}
    return [ParsedToolCall(started[e.index].id, started[e.index].name, e.arguments)
            for e in events if isinstance(e, CallFinished)]
