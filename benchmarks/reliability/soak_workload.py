"""The soak's requests: one /v1/completions call, streamed or not, and what the client saw."""

import json
import time
from dataclasses import dataclass

import httpx


@dataclass
class Outcome:
    kind: str
    """"session" (a turn) or "oneshot"."""
    stream: bool
    started: float
    ended: float = 0.0
    status: int = 0
    ttft_s: float | None = None
    done: bool = False
    """Non-streaming: a 2xx with a body; streaming: the stream ended with [DONE] and no error event."""
    error: str = ""
    """Empty when ok; otherwise the status/code (e.g. "503 replica_unavailable") or transport error."""
    retryable: bool = False
    """The documented retryable answer to a lost replica: 503 replica_unavailable (status or SSE event)."""

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300 and self.done and not self.error


def _error_of(payload: dict, status: int | str) -> tuple[str, bool]:
    err = payload.get("error", {}) if isinstance(payload, dict) else {}
    code = err.get("code") or err.get("type") or "?"
    return f"{status} {code}", code == "replica_unavailable"


async def send(
    http: httpx.AsyncClient, url: str, body: dict, kind: str, session_id: str | None = None
) -> Outcome:
    """One /v1/completions request; never raises (transport failures become the outcome's error)."""
    out = Outcome(kind=kind, stream=bool(body.get("stream")), started=time.monotonic())
    headers = {"X-Session-Id": session_id} if session_id else {}
    try:
        if out.stream:
            await _stream(http, url, body, headers, out)
        else:
            response = await http.post(url + "/v1/completions", json=body, headers=headers)
            out.status = response.status_code
            if response.status_code == 200:
                out.done = "choices" in response.json()
            else:
                out.error, out.retryable = _error_of(_json(response.text), response.status_code)
    except httpx.HTTPError as e:
        out.error = f"transport {type(e).__name__}"
    out.ended = time.monotonic()
    return out


async def _stream(http: httpx.AsyncClient, url: str, body: dict, headers: dict, out: Outcome) -> None:
    async with http.stream("POST", url + "/v1/completions", json=body, headers=headers) as response:
        out.status = response.status_code
        if response.status_code != 200:
            out.error, out.retryable = _error_of(_json((await response.aread()).decode()), out.status)
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out.done = not out.error
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                out.error, out.retryable = _error_of(event, "SSE error event")
                continue
            if out.ttft_s is None and event.get("choices"):
                out.ttft_s = time.monotonic() - out.started
        if not out.done and not out.error:
            out.error = "stream ended without [DONE]"


def _json(text: str) -> dict:
    try:
        return json.loads(text)
    except ValueError:
        return {}
