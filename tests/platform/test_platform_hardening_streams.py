"""A client that leaves a stream frees what it held at once; API keys and session ids outside ASCII
mean the same thing in a header and in a path. In process (the gateway app in front of a real tiny
engine, no Ray)."""

import asyncio
import gc
import json
from collections.abc import Iterator

import pytest
from inprocess_app import TINY_CONFIG, InProcessGateway, inprocess_gateway

from msaserve.platform.config import AuthConfig, ConfigError, ServeConfig

MODEL = "msaserve/tiny"
KEY, OTHER, UNICODE_KEY = "key-a", "key-b", "clé-ünïcode"
CONFIG = {**TINY_CONFIG, "auth": {"api_keys": [KEY, OTHER, UNICODE_KEY], "max_concurrent_requests": 1}}
STREAMS = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 400},
    "/v1/completions": {"prompt": "hi", "max_tokens": 400},
    "/v1/responses": {"input": "hi", "max_output_tokens": 400},
}


@pytest.fixture(scope="module")
def gateway() -> Iterator[InProcessGateway]:
    with inprocess_gateway(CONFIG) as g:
        yield g


def bearer(key: str) -> list[tuple[bytes, bytes]]:
    """The header as a client sends it: the key's UTF-8 bytes."""
    return [(b"authorization", b"Bearer " + key.encode())]


async def leave_at_once(app, path: str, body: dict) -> list[dict]:
    """POST a streaming request over raw ASGI (as the Serve proxy does, spec 2.3) from a client that
    is gone as soon as its request is read (`http.disconnect`). Returns what the app sent."""
    sent: list[dict] = []
    request = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive() -> dict:
        return request.pop(0) if request else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        await asyncio.sleep(0)

    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "client": ("127.0.0.1", 5000), "server": ("gateway", 80),
        "headers": [(b"host", b"gateway"), (b"content-type", b"application/json"), *bearer(KEY)],
    }
    await app(scope, receive, send)
    return sent


@pytest.mark.parametrize("path", sorted(STREAMS))
def test_a_client_gone_mid_stream_frees_the_engine_and_its_slot_at_once(gateway, path: str) -> None:
    """The events generator was left suspended at a `yield` (chat: at the role chunk, outside its
    try/finally): the engine request ran on to max_tokens for nobody and the key's one concurrency
    slot stayed taken until the cyclic garbage collector came by (here it never does)."""
    body = {"model": MODEL, "stream": True, **STREAMS[path]}

    async def go(client, ctx):
        sent = await leave_at_once(client._transport.app, path, body)
        assert sent and sent[0]["status"] == 200, sent
        await asyncio.sleep(0.2)  # the engine's abort and the loop's callbacks
        return ctx.auth.limits._in_flight, gateway.deployment.engine.stats().num_running

    gc.disable()  # no collector pass may do the clean-up this test is about
    try:
        in_flight, running = gateway.run(go, CONFIG)
    finally:
        gc.enable()
        gc.collect()
    assert running == 0, f"the engine still generates for a client that left ({running} running)"
    assert sum(in_flight.values()) == 0, in_flight
    reply = gateway.request("POST", "/v1/chat/completions", headers=bearer(KEY), json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert reply.status_code == 200, reply.text  # max_concurrent_requests=1: the slot is free


def test_a_non_ascii_key_sent_as_utf8_is_accepted(gateway) -> None:
    """The header's bytes were decoded as Latin-1 and re-encoded as UTF-8 (two bytes for each),
    so a configured 'clé-ünïcode' never matched what a client sends: 401 'incorrect API key'."""
    response = gateway.request("GET", "/v1/models", headers=bearer(UNICODE_KEY))
    assert response.status_code == 200, response.text
    response = gateway.request("GET", "/v1/models", headers=bearer("clé-ünïcodf"))
    assert response.status_code == 401, response.text


def test_a_non_ascii_key_has_its_own_tenant(gateway) -> None:
    session = [(b"x-session-id", b"mine")]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert gateway.request("POST", "/v1/chat/completions", json=body,
                           headers=[*bearer(UNICODE_KEY), *session]).status_code == 200
    assert gateway.request("GET", "/v1/sessions/mine", headers=bearer(UNICODE_KEY)).status_code == 200
    assert gateway.request("GET", "/v1/sessions/mine", headers=bearer(KEY)).status_code == 404


def test_a_utf8_session_header_names_the_session_its_path_names(gateway) -> None:
    """`X-Session-Id: café` was stored as 'cafÃ©' (the header's bytes read as Latin-1): listed so,
    and /v1/sessions/caf%C3%A9 answered 404."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    headers = [*bearer(KEY), (b"x-session-id", "café".encode())]
    assert gateway.request("POST", "/v1/chat/completions", json=body, headers=headers).status_code == 200
    listed = gateway.request("GET", "/v1/sessions", headers=bearer(KEY)).json()["data"]
    assert "café" in [s["id"] for s in listed], listed
    response = gateway.request("GET", "/v1/sessions/caf%C3%A9", headers=bearer(KEY))
    assert response.status_code == 200 and response.json()["session_id"] == "café", response.text


@pytest.mark.parametrize("where", ["header", "path"])
def test_a_session_id_that_is_not_utf8_is_a_400(gateway, where: str) -> None:
    """Its bytes were decoded with U+FFFD for each bad one, so /v1/sessions/%ff and /v1/sessions/%fe
    named the same session."""
    if where == "header":
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        response = gateway.request("POST", "/v1/chat/completions", json=body,
                                   headers=[*bearer(KEY), (b"x-session-id", b"caf\xe9")])
        param = "X-Session-Id"
    else:
        response = gateway.request("GET", "/v1/sessions/caf%E9", headers=bearer(KEY))
        param = "session_id"
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, "invalid_value"), error
    assert "UTF-8" in error["message"], error


@pytest.mark.parametrize("key", ["", " padded", "padded\t", "line\nbreak"])
def test_a_key_no_client_can_send_is_a_config_error(key: str) -> None:
    """Such a key was accepted and left its owner at 401 'incorrect API key provided'."""
    for field in ("api_keys", "admin_api_keys"):
        with pytest.raises(ConfigError, match=rf"auth\.{field}: .*key \[1\]") as raised:
            ServeConfig.from_dict({"auth": {field: ["good-key-secret", key]}})
        assert "good-key-secret" not in str(raised.value)  # keys are never quoted
        if key.strip():
            assert key.strip() not in str(raised.value)


def test_a_config_error_in_the_keys_quotes_none_of_them() -> None:
    """`api_keys: "k1"` (a string, not a list) was answered `(got 'k1')`: the key, on the terminal."""
    with pytest.raises(ConfigError, match=r"auth\.api_keys: Input should be a valid list") as raised:
        ServeConfig.from_dict({"auth": {"api_keys": "the-only-secret"}})
    assert "the-only-secret" not in str(raised.value)


def test_a_keys_file_comment_may_be_indented(tmp_path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("k-one\n  # rotated out: k-old\nk-two\n")
    assert AuthConfig(api_keys_file=str(keys)).resolve_keys() == ["k-one", "k-two"]
