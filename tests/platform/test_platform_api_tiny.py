"""The OpenAI-compatible API end to end on a real local Ray Serve app serving the `tiny` preset.

Driven by the official `openai` client (and httpx where the client hides what is checked: headers,
raw error bodies, disconnects). The tiny model is random, so these tests check behaviour, not text.
"""

import asyncio
import time

import httpx
import openai
import pytest

from msaserve.platform.metrics import METRIC_NAMES

pytestmark = pytest.mark.slow

API_KEY = "test-key-1"
MODEL = "msaserve/tiny"
SERVE_CONFIG = {
    "model": {"spec": "tiny"},
    "engine": {"max_num_seqs": 8, "max_waiting": 16, "max_model_len": 2048,
               # prompts of 200 tokens and more decode sparse-resident (the short ones here do not)
               "sparse_residency_sessions": 2, "sparse_residency_min_tokens": 200},
    "auth": {"api_keys": [API_KEY]},
    "http": {"max_body_bytes": 65536},
}
HELLO = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def client(live_app) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_app.base_url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def async_client(live_app) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=live_app.base_url + "/v1", api_key=API_KEY, max_retries=0)


def post(live_app, path: str, body: dict, key: str | None = API_KEY, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(live_app.base_url + path, json=body, headers=headers, timeout=60, **kwargs)


def assert_error(response: httpx.Response, status: int, error_type: str, *fragments: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == error_type
    for fragment in fragments:
        assert fragment in error["message"], error["message"]
    assert response.headers["x-request-id"] in error["message"]
    return error


# ----------------------------------------------------------------------------- happy paths


def test_models_and_health(live_app, client) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL  # sent as /v1/models/msaserve%2Ftiny
    with pytest.raises(openai.NotFoundError, match="model 'nope' does not exist"):
        client.models.retrieve("nope")
    assert httpx.get(live_app.base_url + "/health").json() == {"status": "ok"}
    ready = httpx.get(live_app.base_url + "/ready", timeout=30)
    assert ready.status_code == 200 and ready.json()["model"] == MODEL
    assert "/v1/chat/completions" in httpx.get(live_app.base_url + "/openapi.json").json()["paths"]


def test_chat_without_streaming(client) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason in ("length", "stop")
    assert reply.usage.completion_tokens == 12 or choice.finish_reason == "stop"
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_streaming_matches_non_streaming_and_reports_usage(client) -> None:
    kwargs = dict(model=MODEL, messages=HELLO, max_tokens=16, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


def test_completions_text_and_token_ids(live_app, client) -> None:
    by_text = client.completions.create(model=MODEL, prompt="abc", max_tokens=8, temperature=0)
    assert by_text.usage.prompt_tokens == 3 and by_text.usage.completion_tokens <= 8
    ids = live_app.model_handle().info.remote().result(timeout_s=30).tokenizer.encode("abc")
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    streamed = client.completions.create(model=MODEL, prompt="abc", max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == by_text.choices[0].text


def test_seed_reproducibility(client) -> None:
    def sample(seed: int) -> str:
        reply = client.chat.completions.create(
            model=MODEL, messages=HELLO, max_tokens=24, temperature=1.0, seed=seed
        )
        return reply.choices[0].message.content

    assert sample(1234) == sample(1234)
    assert sample(1234) != sample(4321)


def test_logprobs(client) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    entries = reply.choices[0].logprobs.content
    assert len(entries) == reply.usage.completion_tokens
    for entry in entries:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0.0
        # Greedy: the chosen token is the most likely one.
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs), abs=1e-4)


def test_named_tool_choice_returns_a_tool_call(client) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    reply = client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=16, temperature=0, tools=tools,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert choice.message.tool_calls[0].id.startswith("call_")


def test_streamed_named_tool_choice_ends_with_a_tool_call_chunk(client) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=HELLO, max_tokens=16, temperature=0, tools=tools, stream=True,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )
    )  # fmt: skip
    calls = [
        tc
        for c in chunks
        if c.choices and c.choices[0].delta.tool_calls
        for tc in c.choices[0].delta.tool_calls
    ]
    assert [tc.function.name for tc in calls] == ["get_weather"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_results_round_trip(client) -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
    ]  # fmt: skip
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=4)
    assert reply.usage.prompt_tokens > 40


def test_sixteen_concurrent_streams(async_client) -> None:
    async def one(i: int) -> tuple[str, int]:
        stream = await async_client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"stream {i}"}], max_tokens=24,
            stream=True, stream_options={"include_usage": True},
        )  # fmt: skip
        finish, usage = None, 0
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return finish, usage

    async def run_all() -> list:
        return await asyncio.gather(*(one(i) for i in range(16)))

    results = asyncio.run(run_all())
    assert all(finish in ("length", "stop") and usage > 0 for finish, usage in results), results


def test_session_header_records_the_session(live_app, client) -> None:
    headers = {"X-Session-Id": "conv-42"}
    for _turn in range(2):
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, extra_headers=headers)
    auth = {"Authorization": f"Bearer {API_KEY}"}
    info = httpx.get(live_app.base_url + "/v1/sessions/conv-42", headers=auth).json()
    assert info["num_turns"] == 2 and info["num_cached_tokens"] > 0
    assert httpx.delete(live_app.base_url + "/v1/sessions/conv-42", headers=auth).json()["deleted"] is True
    gone = httpx.get(live_app.base_url + "/v1/sessions/conv-42", headers=auth)
    assert_error(gone, 404, "not_found_error", "conv-42")
    move = httpx.post(live_app.base_url + "/v1/sessions/conv-42/move", headers=auth)
    assert_error(move, 501, "not_implemented_error", "kvcache.enabled")


# ----------------------------------------------------------------------------- errors


def test_bad_parameter_names_it_and_its_range(live_app) -> None:
    r = post(live_app, "/v1/chat/completions", {"model": MODEL, "messages": HELLO, "temperature": 3.5})
    error = assert_error(r, 400, "invalid_request_error", "temperature=3.5", "0.0 to 2.0")
    assert error["param"] == "temperature"
    r = post(live_app, "/v1/chat/completions", {"model": MODEL, "messages": HELLO, "top_logprobs": 30,
                                                "logprobs": True})  # fmt: skip
    assert_error(r, 400, "invalid_request_error", "top_logprobs=30", "0 to 20")
    r = post(live_app, "/v1/chat/completions", {"model": MODEL, "messages": HELLO, "best_of": 3})
    assert_error(r, 400, "invalid_request_error", "best_of is not a supported parameter")


def test_openai_client_raises_typed_errors(client) -> None:
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=0)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4", messages=HELLO)
    bad_key = openai.OpenAI(base_url=str(client.base_url), api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="incorrect API key"):
        bad_key.models.list()


def test_missing_api_key_is_401(live_app) -> None:
    r = post(live_app, "/v1/chat/completions", {"model": MODEL, "messages": HELLO}, key=None)
    assert_error(r, 401, "authentication_error", "Authorization: Bearer")


def test_body_too_large_is_413(live_app) -> None:
    big = [{"role": "user", "content": "x" * 70_000}]
    r = post(live_app, "/v1/chat/completions", {"model": MODEL, "messages": big})
    assert_error(r, 413, "invalid_request_error", "http.max_body_bytes=65536")


def test_context_too_long_gives_token_counts(live_app) -> None:
    r = post(live_app, "/v1/completions", {"model": MODEL, "prompt": "y" * 2100, "max_tokens": 4})
    assert_error(r, 400, "invalid_request_error", "maximum context length is 2048", "2100 prompt tokens")
    r = post(live_app, "/v1/completions", {"model": MODEL, "prompt": "y" * 2000, "max_tokens": 100})
    error = assert_error(r, 400, "invalid_request_error", "2000 prompt tokens", "100 output tokens")
    assert error["code"] == "context_length_exceeded"


def test_full_queue_is_429_with_retry_after(live_app) -> None:
    body = {"model": MODEL, "prompt": "queue", "max_tokens": 300, "ignore_eos": True}

    async def fire() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as http:
            headers = {"Authorization": f"Bearer {API_KEY}"}
            return await asyncio.gather(
                *(
                    http.post(live_app.base_url + "/v1/completions", json=body, headers=headers)
                    for _ in range(48)
                )
            )

    responses = asyncio.run(fire())
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) == {200, 429}, statuses
    rejected = next(r for r in responses if r.status_code == 429)
    assert int(rejected.headers["retry-after"]) >= 1
    assert_error(rejected, 429, "rate_limit_error", "requests are waiting (limit 16)")


def test_client_disconnect_aborts_and_frees_pages(live_app) -> None:
    body = {"model": MODEL, "prompt": "disconnect", "max_tokens": 400, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", live_app.base_url + "/v1/completions", json=body, headers=headers) as r:
        lines = r.iter_lines()
        received = [next(lines) for _ in range(6)]
        during = live_app.engine_stats()
    assert any(line.startswith("data: {") for line in received)
    assert during.num_running == 1 and during.num_free_pages < during.num_total_pages
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        after = live_app.engine_stats()
        if after.num_running == 0 and after.num_free_pages == after.num_total_pages:
            break
        time.sleep(0.2)
    assert after.num_running == 0 and after.num_waiting == 0
    assert after.num_free_pages == after.num_total_pages


def test_metric_names_on_the_metrics_endpoint(live_app, client) -> None:
    client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4)
    # Recorded by the gateway and model replica; the KV cache, router and preprocess metrics are
    # recorded by those parts, which this text-only, single-replica app does not run (and no
    # stream fails here: stream_errors is tested by tests/reliability's replica kill).
    not_here = ("index_load", "page_fetch", "router", "preprocess", "stream_errors")
    expected = ["ray_" + name for name in METRIC_NAMES if not any(part in name for part in not_here)]
    deadline = time.monotonic() + 60
    missing = expected
    while time.monotonic() < deadline and missing:
        text = httpx.get(live_app.metrics_url, timeout=10).text
        missing = [name for name in expected if name not in text]
        time.sleep(1.0)
    assert not missing, f"not exported: {missing}"


def test_a_long_prompt_decodes_sparse_resident_with_the_pools_tokens(live_app, client) -> None:
    """engine.sparse_residency_*: a 300-token prompt leaves the replica's KV pool after its prefill
    and decodes with its index and a working set of K/V; the text equals a pool-only engine's."""
    from msaserve.engine.llm_engine import LLMEngine
    from msaserve.engine.types import GenerateRequest, SamplingParams
    from msaserve.platform.config import ServeConfig
    from msaserve.platform.model_deployment import engine_config_from

    handle = live_app.model_handle()
    before = handle.stats.remote().result(timeout_s=30).sparse_resident_total
    ids = [3 + (i * 37) % 250 for i in range(300)]
    reply = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert handle.stats.remote().result(timeout_s=30).sparse_resident_total == before + 1
    pool_only = {**SERVE_CONFIG["engine"], "sparse_residency_sessions": 0}
    engine = LLMEngine(engine_config_from(ServeConfig.model_validate({**SERVE_CONFIG, "engine": pool_only})))
    engine.add_request(GenerateRequest("ref", ids, SamplingParams(max_tokens=12, temperature=0.0)))
    tokens = []
    while engine.has_unfinished():
        tokens += [t for output in engine.step() for t in output.token_ids]
    assert reply.choices[0].text == engine.tokenizer.decode(tokens)
