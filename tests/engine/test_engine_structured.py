"""Grammar-constrained decoding in the engine (llguidance): outputs follow the grammar through
chunked prefill, mixed batches and decode rounds; a bad schema names its construct; the batch bitmask
matches its bit-by-bit reference."""

import json

import jsonschema
import pytest
import torch
from engine_helpers import make_engine, run_to_completion

from msaserve.engine.structured.bitmask import apply_bitmask, apply_bitmask_naive
from msaserve.engine.types import GenerateRequest, GrammarSpec, InvalidParameter, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "colour": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "colour"],
    "additionalProperties": False,
}


def _constrained(
    max_tokens: int, spec: GrammarSpec, temperature: float = 0.0, seed: int | None = None
) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, grammar=spec)


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_schema_holds_through_chunked_prefill_beside_free_requests(tiny_model, tiny_tokenizer, decode_steps):
    # 100-token prompts with a 64-token step budget: prefilled in chunks; the free request must
    # produce exactly what it produces alone (the grammar's mask touches only its own row).
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = list(range(3, 103))
    alone = run_to_completion(
        make_engine(tiny_model, tiny_tokenizer, decode_steps=decode_steps),
        [GenerateRequest("free", prompt, free)],
    )
    engine = make_engine(tiny_model, tiny_tokenizer, decode_steps=decode_steps)
    requests = [GenerateRequest("free", prompt, free)] + [
        GenerateRequest(f"json{i}", prompt[i:], _constrained(64, spec, temperature=1.0, seed=i))
        for i in range(4)
    ]
    out = run_to_completion(engine, requests)
    assert out["free"] == alone["free"]
    for i in range(4):
        value = json.loads(tiny_tokenizer.decode(out[f"json{i}"]))
        jsonschema.validate(value, SCHEMA)


def test_regex_and_json_object(tiny_model, tiny_tokenizer):
    engine = make_engine(tiny_model, tiny_tokenizer)
    out = run_to_completion(
        engine,
        [
            GenerateRequest("re", [5, 6, 7], _constrained(20, GrammarSpec("regex", r"(yes|no)-[0-9]{3}"))),
            GenerateRequest("obj", [8, 9], _constrained(200, GrammarSpec("json_object"), 1.0, seed=3)),
        ],
    )
    import re

    assert re.fullmatch(r"(yes|no)-[0-9]{3}", tiny_tokenizer.decode(out["re"]))
    text = tiny_tokenizer.decode(out["obj"])
    if len(out["obj"]) < 200:  # finished before the limit: a whole object
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{")


@pytest.mark.parametrize(
    ("schema", "construct"),
    [
        ({"type": "string", "pattern": "(?=a)b"}, "look-around"),
        ({"type": "strin"}, "strin"),
        (
            {"type": "object", "properties": {"a": {"type": "string", "format": "no-such-format"}}},
            "no-such-format",
        ),
    ],
)
def test_uncompilable_schema_names_the_construct(tiny_model, tiny_tokenizer, schema, construct):
    engine = make_engine(tiny_model, tiny_tokenizer)
    request = GenerateRequest("bad", [5, 6], _constrained(8, GrammarSpec("json_schema", json.dumps(schema))))
    with pytest.raises(InvalidParameter) as error:
        engine.add_request(request)
    assert error.value.param == "response_format" and construct in str(error.value)
    assert not engine.has_unfinished()


def test_grammar_compiled_once_per_schema(tiny_model, tiny_tokenizer):
    engine = make_engine(tiny_model, tiny_tokenizer)
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    run_to_completion(
        engine, [GenerateRequest(f"r{i}", [5 + i, 6], _constrained(40, spec)) for i in range(3)]
    )
    assert engine.grammars.compiler.num_compiles == 1


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100])
def test_apply_bitmask_matches_reference(vocab):
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=generator)
    width = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, width), generator=generator, dtype=torch.int32)
    rows = [4, 0, 2]
    fast, naive = logits.clone(), logits.clone()
    apply_bitmask(fast, bitmask, rows)
    apply_bitmask_naive(naive, bitmask, rows)
    assert torch.equal(fast, naive)
    assert torch.equal(fast[1], logits[1]) and torch.equal(fast[3], logits[3])


SMALL = {"type": "integer", "minimum": 0, "maximum": 99}
PYDANTIC_PARAMETERS = {  # what `openai.pydantic_function_tool` writes for a model with a nested model
    "type": "object",
    "$defs": {"Point": {"type": "object", "properties": {"x": SMALL, "y": SMALL},
                        "required": ["x", "y"], "additionalProperties": False}},
    "properties": {"at": {"$ref": "#/$defs/Point"},
                   "near": {"type": "array", "items": {"$ref": "#/$defs/Point"}, "maxItems": 2}},
    "required": ["at", "near"],
    "additionalProperties": False,
}


def test_forced_tool_calls_keep_each_tools_own_refs(tiny_model, tiny_tokenizer):
    """A tool's `$ref: "#/$defs/Point"` is relative to its own parameters. The call grammar wraps them
    in {"name", "arguments"}, and the ref resolved against the wrapper: a 400, "Pointer '/$defs/Point'
    does not exist", for every pydantic-built tool under tool_choice required."""
    from msaserve.platform.openai_types import ChatCompletionRequest
    from msaserve.platform.structured_request import tool_call_grammar
    from msaserve.platform.tools import parse_reply

    tools = [{"type": "function", "function": {"name": name, "parameters": PYDANTIC_PARAMETERS}}
             for name in ("place", "move")]
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=tools,
                                    tool_choice="required", parallel_tool_calls=False)
    spec = tool_call_grammar(request)
    engine = make_engine(tiny_model, tiny_tokenizer)
    requests = [GenerateRequest(f"call{i}", [5 + i, 6], _constrained(120, spec, 1.0, seed=i))
                for i in range(3)]
    out = run_to_completion(engine, requests)
    for i in range(3):
        text = tiny_tokenizer.decode(out[f"call{i}"])
        _, calls = parse_reply(text, {"place", "move"}, None)
        assert len(calls) == 1 and calls[0].name in {"place", "move"}, text
        jsonschema.validate(json.loads(calls[0].arguments), PYDANTIC_PARAMETERS)
