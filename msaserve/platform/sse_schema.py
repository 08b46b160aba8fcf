"""The OpenAPI description of a streamed answer (`stream: true`): a `text/event-stream` entry on the
route's 200, beside the JSON body that the route's `response_model` documents.

It takes OpenAPI 3.2's form for server-sent events, which FastAPI also writes for its own
`EventSourceResponse` routes: `itemSchema` describes one event as an object of the event's fields,
and the `data` field is a string whose `contentMediaType` is JSON and whose `contentSchema` is the
payload's schema. schemathesis reads a stream that way (it parses the events, then validates each
one's fields, and each `data` as JSON against `contentSchema`), so a plain `{"type": "string"}`
schema fails on every event. The chat and text completion streams end with `data: [DONE]`, the one
event whose data is not JSON: it is documented as that exception, not by loosening `data`.

The payload schema is inlined, without references: a route's `responses=` takes raw schemas but
cannot add models to `components/schemas`, and pydantic's `$defs` would not resolve inside an
OpenAPI document (`#/$defs/...` points into the document's root).
"""

from typing import Any

from pydantic import TypeAdapter

from msaserve.platform.generation import SSE_DONE

DONE_DATA = SSE_DONE.removeprefix("data: ").rstrip("\n")
"""The data of a completion stream's last event: `[DONE]`."""


def event_stream_response(payload: Any, description: str, *, ends_with_done: bool = False,
                          named_events: bool = False) -> dict[str, Any]:
    """A `responses=` entry for the 200 of a route that streams events whose `data` is the JSON of
    `payload` (a model, or a union of them). `ends_with_done`: the stream ends with `data: [DONE]`
    (chat and text completions). `named_events`: every event has an `event:` line, the payload's
    `type` (the Responses API); otherwise no event is named."""
    schema = inlined_schema(payload)
    json_data = {"contentMediaType": "application/json", "contentSchema": schema}
    data: dict[str, Any] = {"type": "string", **json_data}
    if ends_with_done:
        done = {"const": DONE_DATA, "description": "The stream's last event."}
        data = {"type": "string", "anyOf": [json_data, done]}
    properties: dict[str, Any] = {"data": data}
    required = ["data"]
    if named_events:
        properties["event"] = {"type": "string", "enum": type_names(schema)}
        required.append("event")
    item = {"type": "object", "required": required, "properties": properties}
    return {"description": description, "content": {"text/event-stream": {"itemSchema": item}}}


def inlined_schema(payload: Any) -> dict[str, Any]:
    """The serialization JSON schema of `payload` with every `#/$defs/...` reference replaced by its
    definition (the models it is used for are not recursive)."""
    schema = TypeAdapter(payload).json_schema(mode="serialization")
    definitions = schema.pop("$defs", {})

    def resolve(node: Any, seen: tuple[str, ...]) -> Any:
        if isinstance(node, list):
            return [resolve(value, seen) for value in node]
        if not isinstance(node, dict):
            return node
        ref = node.get("$ref")
        if not (isinstance(ref, str) and ref.startswith("#/$defs/")):
            return {key: resolve(value, seen) for key, value in node.items()}
        name = ref.removeprefix("#/$defs/")
        if name in seen:
            raise ValueError(f"{name} is recursive: its schema cannot be inlined")
        siblings = {key: resolve(value, seen) for key, value in node.items() if key != "$ref"}
        return {**resolve(definitions[name], (*seen, name)), **siblings}

    return resolve(schema, ())


def type_names(schema: dict[str, Any]) -> list[str]:
    """The values of `type` that a payload schema (an object, or `anyOf` objects) allows."""
    names: list[str] = []
    for member in schema.get("anyOf", [schema]):
        kind = member["properties"]["type"]
        names += [kind["const"]] if "const" in kind else kind["enum"]
    return names
