"""OpenAI error shapes, engine error mapping and API-key checks (pure, no Ray)."""

import json

import pytest

from msaserve.engine.types import ContextTooLong, InvalidParameter, QueueFull
from msaserve.platform.auth import Authenticator, KeyLimits
from msaserve.platform.config import AuthConfig
from msaserve.platform.errors import APIError, bad_parameter, error_response, from_engine_error


def body_of(response) -> dict:
    return json.loads(response.body)


def test_error_body_shape_and_request_id() -> None:
    response = error_response(APIError(400, "temperature=3 is invalid", param="temperature"), "rid-1")
    assert response.status_code == 400
    assert body_of(response) == {
        "error": {
            "message": "temperature=3 is invalid (request id rid-1)",
            "type": "invalid_request_error",
            "param": "temperature",
            "code": None,
        }
    }


@pytest.mark.parametrize(
    ("error", "status", "param", "code"),
    [
        (InvalidParameter("top_p", 0.0, "greater than 0.0"), 400, "top_p", "invalid_value"),
        (ContextTooLong(9000, 10, 8192), 400, "messages", "context_length_exceeded"),
        (QueueFull(64, 64, retry_after_s=2.5), 429, None, "queue_full"),
    ],
)
def test_engine_errors_map_to_statuses(error, status: int, param, code: str) -> None:
    api = from_engine_error(error)
    assert (api.status, api.param, api.code) == (status, param, code)


def test_retry_after_is_whole_seconds_rounded_up() -> None:
    response = error_response(from_engine_error(QueueFull(64, 64, retry_after_s=2.5)), None)
    assert response.headers["retry-after"] == "3"
    assert body_of(response)["error"]["type"] == "rate_limit_error"


def test_a_long_rejected_value_is_quoted_by_its_start_and_length() -> None:
    """A 100 KB stop string (or 1,000 of them) is named, not echoed back whole in the error."""
    long_stop = ["a" * 100_000]
    for message in (str(InvalidParameter("stop", long_stop, "at most 256 characters")),
                    bad_parameter("stop", long_stop, "at most 256 characters").message):
        assert message.startswith("stop=['aaaa")
        assert len(message) < 300
        assert f"({len(repr(long_stop)):,} characters)" in message
        assert message.endswith("is invalid: allowed at most 256 characters")
    short = str(InvalidParameter("top_p", 0.0, "greater than 0.0"))
    assert short == "top_p=0.0 is invalid: allowed greater than 0.0"


def test_context_too_long_message_has_token_counts() -> None:
    assert "9000 prompt tokens" in from_engine_error(ContextTooLong(9000, 10, 8192)).message


def test_authenticator() -> None:
    auth = Authenticator(AuthConfig(api_keys=["k1", "k2"]))
    assert auth.authenticate("Bearer k2") == "k2"
    for header, fragment in [
        (None, "missing API key"),
        ("Basic k1", "malformed"),
        ("Bearer k3", "incorrect"),
    ]:
        with pytest.raises(APIError, match=fragment) as info:
            auth.authenticate(header)
        assert info.value.status == 401
    assert Authenticator(AuthConfig()).authenticate(None) == "anonymous"


def test_rate_and_concurrency_limits() -> None:
    now = [0.0]
    limits = KeyLimits(requests_per_minute=2, max_concurrent=1, clock=lambda: now[0])
    limits.check_rate("k")
    limits.check_rate("k")
    with pytest.raises(APIError, match="2 requests per minute") as info:
        limits.check_rate("k")
    assert info.value.status == 429 and info.value.retry_after_s == pytest.approx(60.0)
    now[0] = 61.0
    limits.check_rate("k")
    limits.acquire("k")
    with pytest.raises(APIError, match="limit 1"):
        limits.acquire("k")
    limits.release("k")
    limits.acquire("k")
