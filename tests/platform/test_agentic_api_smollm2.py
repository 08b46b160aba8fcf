"""The real SmolLM2-135M-Instruct behind the API, through the official `openai` client: a
json_schema reply parses and validates on 20 varied prompts (all of them), and tool_choice
"required" always yields a call whose arguments satisfy the tool's schema."""

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "msaserve/smollm2"
SERVE_CONFIG = {"model": {"spec": "smollm2"}, "engine": {"max_model_len": 2048, "max_num_seqs": 10}}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "mood": {"enum": ["happy", "sad", "neutral"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["name", "age", "mood", "tags"],
    "additionalProperties": False,
}
PROMPTS = [
    "Describe a pirate captain.",
    "Who is the main character of a fairy tale?",
    "Invent a chess player.",
    "Describe your neighbour.",
    "Tell me about a famous scientist.",
    "Make up a football coach.",
    "Describe a sleepy cat as if it were a person.",
    "Create a character for a space opera.",
    "Who would be a good teacher?",
    "Describe an old fisherman.",
    "Invent a jazz musician.",
    "Describe a child on their birthday.",
    "Make up a detective.",
    "Describe a grumpy baker.",
    "Invent a mountain climber.",
    "Who runs the local library?",
    "Describe a marathon runner.",
    "Make up a villain for a comic book.",
    "Describe a gardener in spring.",
    "Invent a robot's owner.",
]
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string", "maxLength": 60}},
                "required": ["query"],
                "additionalProperties": False,
            },
        },
    },
]


@pytest.fixture(scope="module")
def client(live_app) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_app.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_json_schema_holds_on_twenty_prompts(client) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    def ask(prompt: str) -> str:
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=120,
            temperature=0.7,
            seed=1,
            response_format=fmt,
        )
        assert reply.choices[0].finish_reason == "stop", reply.choices[0].message.content
        return reply.choices[0].message.content

    with ThreadPoolExecutor(10) as pool:
        replies = list(pool.map(ask, PROMPTS))
    for text in replies:
        jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize(
    "question", ["What's the weather in Paris?", "Find me a pasta recipe.", "Tell me a joke."]
)
def test_tool_choice_required_yields_a_valid_call(client, question) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": question}],
        max_tokens=150,
        temperature=0,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    (call,) = choice.message.tool_calls
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)
