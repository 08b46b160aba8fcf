"""What an OpenAI request asks the output to follow → the engine's `GrammarSpec`.

`response_format` json_object / json_schema (strict or not) / regex / grammar, and tool calls that
`tool_choice` requires (`required` or a named function): those are a Lark grammar over the Hermes
`<tool_call>` blocks the chat template describes (`tools.py`), whose JSON is the call's schema —
`{"name": <the tool>, "arguments": <its parameters schema>}` — so a small model cannot write an
unknown name or arguments that break the tool's schema. `parallel_tool_calls: false` allows exactly
one call. Compiling (and the 400 for a construct the library cannot compile) happens in the engine.
"""

import json
from typing import Any

from msaserve.engine.types import GrammarSpec, quoted
from msaserve.platform.errors import APIError
from msaserve.platform.openai_types import ChatCompletionRequest, NamedToolChoice, ResponseFormat, Tool
from msaserve.platform.tools import CLOSE, HERMES, OPEN, ToolFormat

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""`json.dumps`' separators, as the Hermes examples write them; no free whitespace (small models
otherwise pad with newlines until max_tokens)."""


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def response_format_grammar(fmt: ResponseFormat | None) -> GrammarSpec | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return GrammarSpec("json_object")
    if fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise _bad("response_format.json_schema", "response_format type json_schema needs json_schema")
        schema = {**fmt.json_schema.schema_, "x-guidance": JSON_STYLE}
        return GrammarSpec("json_schema", json.dumps(schema), strict=bool(fmt.json_schema.strict),
                           param="response_format.json_schema.schema",
                           shown=json.dumps(fmt.json_schema.schema_))
    field = "regex" if fmt.type == "regex" else "grammar"
    source = getattr(fmt, field)
    if not source:
        raise _bad(f"response_format.{field}", f"response_format type {fmt.type} needs a non-empty {field}")
    return GrammarSpec("regex" if fmt.type == "regex" else "lark", source, param=f"response_format.{field}")


def check_tools(tools: list[Tool] | None) -> None:
    """Each tool's name unique (a call names one tool) and its parameters an object's JSON Schema (a
    call's arguments are a JSON object), as OpenAI checks them, whether or not tool_choice forces a
    call: a tool the reply may call must be callable."""
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools or []):
        name = tool.function.name
        if name in seen:
            raise _bad(f"tools[{i}].function.name", f"tools[{i}].function.name={name!r} is invalid: allowed "
                       f"a name no other tool has (tools[{seen[name]}] has it)")
        seen[name] = i
        _check_parameters(tool.function.parameters, f"tools[{i}].function.parameters", name)


MAX_SCHEMA_DEPTH = 100
"""Levels of JSON objects and arrays in one tool's `parameters`. Real schemas use a dozen or so; the
tool list is written into the prompt (and echoed by the Responses API) by a serializer that stops at
255 levels, and llguidance parses a forced call's schema (this one wrapped in two more) to 128."""


def json_depth(value: Any) -> int:
    """Levels of nested objects and arrays in a parsed JSON value (a scalar is 0); iterative, so a
    value nested as deep as the body parser allows cannot exhaust the stack."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _check_parameters(schema: dict[str, Any] | None, param: str, name: str) -> None:
    if schema is None:
        return

    def bad(what: str, allowed: str) -> APIError:
        return _bad(param, f"{param}{what} is invalid for function {name!r}: allowed {allowed}")

    depth = json_depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise _bad(param, f"{param} of function {name!r} is nested {depth} levels deep: allowed at most "
                   f"{MAX_SCHEMA_DEPTH} levels of objects and arrays")

    if schema.get("type", "object") != "object":
        raise bad(f".type={quoted(schema['type'])}", "'object' (a call's arguments are a JSON object)")
    properties, required = schema.get("properties", {}), schema.get("required", [])
    if not isinstance(properties, dict):
        raise bad(f".properties={quoted(properties)}", "an object of property name → schema")
    if not isinstance(required, list):
        raise bad(f".required={quoted(required)}", "a list of property names")
    for prop, sub in properties.items():
        if not isinstance(sub, dict | bool):
            raise bad(f".properties.{prop}={quoted(sub)}", "a JSON Schema (an object or a boolean)")
    for prop in required:
        if not isinstance(prop, str):
            raise bad(f".required item {quoted(prop)}", "property names (strings)")


def required_tools(request: ChatCompletionRequest) -> list[Tool]:
    """The tools one of which the reply must call: [] unless tool_choice is required or named."""
    choice, tools = request.tool_choice, request.tools or []
    if choice in (None, "none", "auto"):
        return []
    if not tools:  # OpenAI refuses this too; ignoring it would answer without the call asked for
        shown = choice if isinstance(choice, str) else f"function {choice.function.name!r}"
        raise _bad("tool_choice", f"tool_choice={shown} is invalid without tools: allowed 'none' or 'auto' "
                   "when the request has no tools")
    if isinstance(choice, NamedToolChoice):
        named = [t for t in tools if t.function.name == choice.function.name]
        if not named:
            raise _bad("tool_choice", f"tool_choice names function {choice.function.name!r}, which is not "
                       f"among tools: {sorted(t.function.name for t in tools)}")
        return named
    return tools


def _is_pointer(ref: str) -> bool:
    """A JSON Pointer into this document ("#", "#/$defs/X"), not an anchor ("#name") or another URI."""
    return ref == "#" or ref.startswith("#/")


def _rebased(schema: Any, base: str) -> Any:
    """`schema` with every local JSON Pointer `$ref` ("#", "#/$defs/X", "#/properties/a") pointing
    below `base`."""
    if isinstance(schema, dict):
        return {
            key: base + value[1:] if key == "$ref" and isinstance(value, str) and _is_pointer(value)
            else _rebased(value, base)
            for key, value in schema.items()
        }
    if isinstance(schema, list):
        return [_rebased(item, base) for item in schema]
    return schema


def _call_schema(tools: list[Tool]) -> dict[str, Any]:
    """One call's JSON: a tool's name and its arguments. Each tool's parameters schema sits under the
    root's `$defs` with its local `$ref`s rebased there: a ref such as "#/$defs/X" (what pydantic and
    `openai.pydantic_function_tool` write) points into the tool's own schema, not into the wrapper."""
    defs: dict[str, Any] = {}
    options = []
    for i, t in enumerate(tools):
        name = f"tool_{i}"
        defs[name] = _rebased(t.function.parameters or {"type": "object"}, f"#/$defs/{name}")
        options.append({
            "type": "object",
            "properties": {"name": {"const": t.function.name}, "arguments": {"$ref": f"#/$defs/{name}"}},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    strict = all(t.function.strict for t in tools)
    return {"$defs": defs, **schema, "x-guidance": {**JSON_STYLE, "lenient": not strict}}


def tool_call_grammar(request: ChatCompletionRequest) -> GrammarSpec | None:
    """Lark: one `<tool_call>` block (or several when parallel_tool_calls is not false)."""
    tools = required_tools(request)
    if not tools:
        return None
    opening, closing = json.dumps(OPEN + "\n"), json.dumps("\n" + CLOSE)
    call = f"{opening} %json {json.dumps(_call_schema(tools))} {closing}"
    repeat = "" if request.parallel_tool_calls is False else ' ("\\n" call)*'
    shown = json.dumps({t.function.name: t.function.parameters or {"type": "object"} for t in tools})
    return GrammarSpec("lark", f"start: call{repeat}\ncall: {call}\n", param="tools", shown=shown)


def chat_grammar(request: ChatCompletionRequest, tool_format: ToolFormat = HERMES) -> GrammarSpec | None:
    """The constraint of a chat request; a required tool call and a response_format cannot both hold.
    Required calls get a grammar in the Hermes format only (a template's own format, e.g. MiniMax's,
    is forced by its call prefix instead: `tools.forced_prefix`)."""
    check_tools(request.tools)
    tools = tool_call_grammar(request) if tool_format.name == HERMES.name else None
    fmt = response_format_grammar(request.response_format)
    if required_tools(request) and fmt is not None:
        raise _bad("response_format", "response_format cannot constrain a reply that tool_choice forces "
                   "to be a tool call: use one of them")
    return tools or fmt
