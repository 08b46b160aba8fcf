"""Cheap, real security checks on the gateway. Already covered elsewhere and not repeated here: 401
for a missing/wrong key, per-key rate and concurrency limits, the Content-Length 413
(tests/platform/test_platform_api_tiny.py, test_platform_errors.py), the SSRF guard
(tests/preprocess/test_preprocess_fetch.py) and the chart's non-root / read-only / NetworkPolicy
settings (tests/helm/).

Here: keys are compared with `hmac.compare_digest` against every configured key; no key (right or
wrong) reaches any Ray log file; CORS is off unless configured; a chunked body without
Content-Length is also cut off with a 413."""

import hmac
import os
import time
from collections.abc import Iterator

import httpx
import pytest
from local_serve_app import LiveApp, start_live_app
from starlette.testclient import TestClient

from msaserve.platform.auth import Authenticator
from msaserve.platform.config import AuthConfig, ServeConfig
from msaserve.platform.gateway import GatewayContext, create_api

pytestmark = pytest.mark.slow

SECRET_KEY = "sk-reliability-7f3a9c1e5b"
WRONG_KEY = "sk-not-the-key-0d2e4f6a8b"
SERVE_CONFIG = {
    "model": {"spec": "tiny"},
    "engine": {"max_num_seqs": 4, "max_waiting": 8, "max_model_len": 512},
    "auth": {"api_keys": [SECRET_KEY]},
    "http": {"max_body_bytes": 65536},
}
ORIGIN = "https://evil.example"


@pytest.fixture(scope="module")
def app() -> Iterator[LiveApp]:
    with start_live_app(SERVE_CONFIG) as running:
        yield running


def test_keys_are_compared_in_constant_time_against_every_key(monkeypatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    auth = Authenticator(AuthConfig(api_keys=["k-one", "k-two", "k-three"]))
    assert auth.authenticate("Bearer k-one") == "k-one"
    # A match on the first key still compares against the others: timing says nothing about which.
    assert [b for _, b in calls] == [b"k-one", b"k-two", b"k-three"]
    calls.clear()
    with pytest.raises(Exception, match="incorrect API key"):
        auth.authenticate("Bearer k-four")
    assert len(calls) == 3 and all(a == b"k-four" for a, _ in calls)


def _log_text(logs_dir: str) -> str:
    parts = []
    for folder, _, files in os.walk(logs_dir):
        for name in files:
            with open(os.path.join(folder, name), errors="replace") as f:
                parts.append(f.read())
    return "\n".join(parts)


def test_api_keys_never_reach_the_logs_and_cors_is_off(app: LiveApp) -> None:
    url = app.base_url + "/v1/chat/completions"
    body = {"model": "msaserve/tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    responses = [
        httpx.post(url, json=body, headers={"Authorization": f"Bearer {key}", "Origin": ORIGIN}, timeout=60)
        for key in (SECRET_KEY, WRONG_KEY, SECRET_KEY + "x")
    ]
    assert [r.status_code for r in responses] == [200, 401, 401], [r.text for r in responses]
    preflight = httpx.options(url, headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
    for response in [*responses, preflight]:
        assert "access-control-allow-origin" not in response.headers, response.headers  # CORS off
    request_id = responses[1].headers["x-request-id"]
    deadline = time.monotonic() + 20
    while request_id not in (logs := _log_text(app.logs_dir)):  # the access log line of the 401
        assert time.monotonic() < deadline, f"request {request_id} never reached {app.logs_dir}"
        time.sleep(0.5)
    for secret in (SECRET_KEY, WRONG_KEY):
        assert secret not in logs, f"an API key appears in the Ray logs under {app.logs_dir}"


def test_a_chunked_body_over_the_limit_is_413(app: LiveApp) -> None:
    def chunks() -> Iterator[bytes]:  # no Content-Length: the gateway has to count
        yield b'{"model": "msaserve/tiny", "messages": [{"role": "user", "content": "'
        for _ in range(20):
            yield b"x" * 4096
        yield b'"}]}'

    response = httpx.post(app.base_url + "/v1/chat/completions", content=chunks(), timeout=60,
                          headers={"Authorization": f"Bearer {SECRET_KEY}",
                                   "Content-Type": "application/json"})  # fmt: skip
    assert response.status_code == 413, response.text
    assert "http.max_body_bytes=65536" in response.json()["error"]["message"]


def test_cors_answers_only_configured_origins() -> None:
    """The positive control for 'off by default': configured, the same preflight is answered."""
    config = ServeConfig.from_dict(
        {"model": {"spec": "tiny"}, "http": {"cors_origins": ["https://app.example"]}}
    )
    api = create_api(GatewayContext(config, model=None))  # a preflight never reaches the model
    headers = {"Access-Control-Request-Method": "POST", "x-request-id": "cors-test"}
    with TestClient(api) as client:
        allowed = client.options("/v1/chat/completions", headers={**headers, "Origin": "https://app.example"})
        other = client.options("/v1/chat/completions", headers={**headers, "Origin": ORIGIN})
    assert allowed.headers.get("access-control-allow-origin") == "https://app.example"
    assert "access-control-allow-origin" not in other.headers
