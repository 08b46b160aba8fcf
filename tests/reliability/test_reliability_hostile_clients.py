"""Issue 26, item 3: hostile clients on raw sockets against a real local Ray Serve app (`tiny`),
with the proxy's limits as `msaserve serve` sets them. A slowloris (headers or body) is cut within
its timeout + 1 s, idle connections are closed, an oversized chunked body is refused while it
streams in, a client that aborts mid-stream frees its sequence, and through all of it the service
answers normal requests: no 5xx."""

import time
from collections.abc import Iterator

import pytest
from hostile_clients import (
    abort_mid_stream,
    closed_within,
    idle_connections,
    normal_request,
    oversized_chunked_body,
    slowloris_body,
    slowloris_headers,
    stalled_bodies,
)
from local_serve_app import LiveApp, start_live_app

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

KEY, MODEL = "hostile-key", "msaserve/tiny"
HEADER_TIMEOUT_S, BODY_TIMEOUT_S, MAX_BODY, PER_CLIENT = 3.0, 3.0, 65536, 6
SERVE_CONFIG = {
    "model": {"spec": "tiny"},
    "engine": {"max_num_seqs": 4, "max_waiting": 16, "max_model_len": 512},
    "auth": {"api_keys": [KEY]},
    "http": {"header_timeout_s": HEADER_TIMEOUT_S, "body_read_timeout_s": BODY_TIMEOUT_S,
             "max_body_bytes": MAX_BODY, "keep_alive_timeout_s": 2, "max_requests_per_client": PER_CLIENT},
}  # fmt: skip


@pytest.fixture(scope="module")
def app() -> Iterator[LiveApp]:
    with start_live_app(SERVE_CONFIG, num_cpus=2) as running:
        yield running


def test_slowloris_headers_are_cut_at_the_header_timeout(app: LiveApp) -> None:
    held = slowloris_headers(app.base_url, bound_s=HEADER_TIMEOUT_S + 30)
    assert held.closed and held.seconds <= HEADER_TIMEOUT_S + 1, held
    assert held.response.startswith(b"HTTP/1.1 408"), held.response[:200]


def test_slowloris_body_is_cut_at_the_body_timeout(app: LiveApp) -> None:
    held = slowloris_body(app.base_url, KEY, bound_s=BODY_TIMEOUT_S + 30)
    assert held.closed and held.seconds <= BODY_TIMEOUT_S + 1, held
    assert held.response.startswith(b"HTTP/1.1 408"), held.response[:300]
    assert b"body_read_timeout_s" in held.response


def test_idle_connections_are_closed_and_do_not_block_others(app: LiveApp) -> None:
    socks = idle_connections(app.base_url, 50)
    assert normal_request(app.base_url, KEY, MODEL) == 200  # served while 50 sockets sit idle
    assert closed_within(socks, HEADER_TIMEOUT_S + 1) == 50


def test_oversized_streamed_body_is_refused_while_it_streams(app: LiveApp) -> None:
    status, sent = oversized_chunked_body(app.base_url, KEY, MAX_BODY)
    assert status == 413, (status, sent)
    assert sent < 4 * MAX_BODY  # answered before the client finished (it never would)


def test_abort_mid_stream_frees_the_sequence(app: LiveApp) -> None:
    for _ in range(3):
        assert abort_mid_stream(app.base_url, KEY, MODEL)
    deadline = time.monotonic() + 30
    while (stats := app.engine_stats()).num_running + stats.num_waiting and time.monotonic() < deadline:
        time.sleep(0.2)
    assert stats.num_running == 0 and stats.num_waiting == 0, stats
    assert normal_request(app.base_url, KEY, MODEL) == 200


def test_a_forged_x_forwarded_for_does_not_lift_the_per_client_cap(app: LiveApp) -> None:
    """uvicorn in Serve's proxy applied X-Forwarded-For from 127.0.0.1 by default, so a local client
    that forged a new address per request was a new client each time and never met the cap."""
    import httpx

    # in flight until the body timeout: headers, 10 of 1000 bytes, a new forged address each
    stalled = stalled_bodies(app.base_url, KEY, [f"203.0.113.{i}" for i in range(PER_CLIENT)])
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        headers = {"Authorization": f"Bearer {KEY}", "X-Forwarded-For": "198.51.100.1"}
        deadline, status = time.monotonic() + BODY_TIMEOUT_S - 0.8, 0  # stalls sent 0.3 s ago
        while status != 429 and time.monotonic() < deadline:  # until the proxy counted all stalled
            status = httpx.post(app.base_url + "/v1/chat/completions", json=body, headers=headers,
                                timeout=30).status_code  # fmt: skip
    finally:
        for sock in stalled:
            sock.close()
    assert status == 429
    time.sleep(0.5)  # the closed connections leave the count
    assert normal_request(app.base_url, KEY, MODEL) == 200
