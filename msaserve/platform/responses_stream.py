"""Streamed Responses API events, in the `openai` package's shapes (`types/responses/*_event.py`).

    response.created, response.in_progress
    per message:  response.output_item.added, response.content_part.added,
                  response.output_text.delta ..., response.output_text.done,
                  response.content_part.done, response.output_item.done
    per call:     response.output_item.added, response.function_call_arguments.delta ...,
                  response.function_call_arguments.done, response.output_item.done
    response.completed (or response.incomplete when max_output_tokens cut it off)

Every event carries `sequence_number` (0, 1, ...). The reply's events come from the same parser as
chat streams (`tool_stream.py`): a call's arguments stream as the model writes them.
"""

import json
from typing import Any

from msaserve.platform.responses_convert import new_id
from msaserve.platform.responses_types import (
    OutputFunctionCall,
    OutputMessage,
    OutputText,
    ResponseObject,
)
from msaserve.platform.tool_stream import ArgumentsDelta, CallFinished, CallStarted, Event, Text


class ResponseEventWriter:
    """Turns reply events into SSE lines and builds the response's output items as it goes."""

    def __init__(self, response: ResponseObject) -> None:
        self.response = response
        self.sequence = 0
        self._message: OutputMessage | None = None
        self._message_index = -1
        self._text: list[str] = []
        self._calls: dict[int, tuple[int, OutputFunctionCall]] = {}

    def sse(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, **fields, "sequence_number": self.sequence}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def _snapshot(self) -> dict[str, Any]:
        return self.response.model_dump(mode="json")

    def start(self) -> list[str]:
        self.response.status = "in_progress"
        return [self.sse("response.created", response=self._snapshot()),
                self.sse("response.in_progress", response=self._snapshot())]

    def on_event(self, event: Event) -> list[str]:
        if isinstance(event, Text):
            return self._on_text(event.text)
        if isinstance(event, CallStarted):
            return self._on_call_started(event)
        if isinstance(event, ArgumentsDelta):
            index, item = self._calls[event.index]
            return [self.sse("response.function_call_arguments.delta", item_id=item.id, output_index=index,
                             delta=event.text)]
        if isinstance(event, CallFinished):
            index, item = self._calls[event.index]
            item.arguments, item.status = event.arguments, "completed"
            return [self.sse("response.function_call_arguments.done", item_id=item.id, output_index=index,
                             arguments=event.arguments, name=item.name),
                    self.sse("response.output_item.done", output_index=index,
                             item=item.model_dump(mode="json"))]
        return []

    def _on_text(self, text: str) -> list[str]:
        lines = []
        if self._message is None:
            self._message = OutputMessage(id=new_id("msg_"), status="in_progress", content=[])
            self._message_index = len(self.response.output)
            self.response.output.append(self._message)
            part = {"type": "output_text", "text": "", "annotations": []}
            lines += [
                self.sse("response.output_item.added", output_index=self._message_index,
                         item=self._message.model_dump(mode="json")),
                self.sse("response.content_part.added", item_id=self._message.id,
                         output_index=self._message_index, content_index=0, part=part),
            ]
        self._text.append(text)
        lines.append(self.sse("response.output_text.delta", item_id=self._message.id,
                              output_index=self._message_index, content_index=0, delta=text, logprobs=[]))
        return lines

    def close_message(self, incomplete: bool = False) -> list[str]:
        message, self._message = self._message, None
        if message is None:
            return []
        text = "".join(self._text)
        self._text = []
        message.content = [OutputText(text=text)]
        message.status = "incomplete" if incomplete else "completed"
        where = {"item_id": message.id, "output_index": self._message_index, "content_index": 0}
        return [
            self.sse("response.output_text.done", **where, text=text, logprobs=[]),
            self.sse("response.content_part.done", **where, part=message.content[0].model_dump(mode="json")),
            self.sse("response.output_item.done", output_index=self._message_index,
                     item=message.model_dump(mode="json")),
        ]

    def _on_call_started(self, event: CallStarted) -> list[str]:
        lines = self.close_message()
        item = OutputFunctionCall(id=new_id("fc_"), call_id=event.id, name=event.name, arguments="",
                                  status="in_progress")
        index = len(self.response.output)
        self.response.output.append(item)
        self._calls[event.index] = (index, item)
        added = self.sse("response.output_item.added", output_index=index, item=item.model_dump(mode="json"))
        return [*lines, added]

    def finish(self, incomplete: bool) -> list[str]:
        """The last events; the response's status and usage must be set by then."""
        lines = self.close_message(incomplete)
        kind = "response.incomplete" if self.response.status == "incomplete" else "response.completed"
        return [*lines, self.sse(kind, response=self._snapshot())]

    def error(self, message: str, code: str | None, param: str | None) -> str:
        return self.sse("error", code=code, message=message, param=param)
