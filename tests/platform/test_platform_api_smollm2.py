"""The real SmolLM2-135M-Instruct behind the API: warm-up answers 503, then real answers."""

import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "msaserve/smollm2"
# With the KV cache service behind the engine (one shard), as on a cluster.
SERVE_CONFIG = {
    "model": {"spec": "smollm2"},
    "engine": {"max_model_len": 2048},
    "kvcache": {"enabled": True, "num_shards": 1, "memory_bytes": 1 << 26},
}


@pytest.fixture(scope="module")
def client(live_app) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_app.base_url + "/v1", api_key="unused", max_retries=0)


def test_warming_up_is_503_with_retry_after(live_app) -> None:
    # serve.run returns as soon as the replicas are constructed; SmolLM2 then loads in the background
    # (seconds), so the /health call made right after it must have been answered 503.
    first = live_app.first_health
    assert first.status_code == 503, first.text
    assert first.headers["retry-after"] == "5"
    error = first.json()["error"]
    assert error["type"] == "service_unavailable" and error["code"] == "warming_up"


def test_capital_of_france(client) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24, temperature=0,
    )  # fmt: skip
    assert "Paris" in reply.choices[0].message.content


def test_streamed_answer_is_the_same(client) -> None:
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
                  max_tokens=24, temperature=0)  # fmt: skip
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = client.chat.completions.create(**kwargs, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole


def test_moving_an_unknown_session_is_a_clear_404(live_app) -> None:
    import httpx

    r = httpx.post(live_app.base_url + "/v1/sessions/s1/move")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "session_not_found"


def test_kvcache_shard_is_running(live_app) -> None:
    import ray

    from msaserve.kvcache.config import ServiceConfig

    service = ServiceConfig.from_settings(live_app.config.kvcache)
    shard = ray.get_actor(service.actor_name(0), namespace=service.namespace)
    assert ray.get(shard.ping.remote(), timeout=30) == 0
