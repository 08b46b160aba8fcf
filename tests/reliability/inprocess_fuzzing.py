"""Property-based fuzz of every route of the gateway app in process (a real tiny engine behind it,
no Ray): schemathesis generates schema-valid and schema-violating requests from the app's own
OpenAPI schema, and a hypothesis strategy of hostile JSON (unicode edge cases and lone surrogates,
huge and negative numbers, NaN/Infinity, wrong types, deep nesting, unknown keys) mutates valid
bodies. No answer may be a 5xx, and every error must be an OpenAI error body.

Used by tests/reliability/test_reliability_fuzz_inprocess.py (bounded for CI) and
benchmarks/reliability/fuzz_inprocess.py (the long run that writes hardening.fuzz_*).
"""

import json
import time
import urllib.parse
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from inprocess_app import InProcessGateway
from schemathesis import GenerationMode

FUZZ_CONFIG: dict = {
    "model": {"spec": "tiny"},
    "engine": {"max_num_seqs": 8, "max_waiting": 64, "max_model_len": 96},  # short unbounded outputs
    "auth": {"api_keys": ["fuzz-key"]},
    "http": {"max_body_bytes": 65536},
}
API_KEY, MODEL = "fuzz-key", "msaserve/tiny"
LIVE_ONLY = ("/metrics",)
"""Ray's metrics agent answers /metrics: fuzzed live (tests/reliability/test_reliability_fuzz.py)."""
BY_DESIGN = {(501, "kvcache_disabled")}
"""5xx answers that are the configuration's, not a fault: moving a session needs the KV cache
service, which needs Ray (the live fuzz enables it and sees 404/200 there). Counted apart."""
HOSTILE_PER_SCHEMA_EXAMPLE = 3
"""Hostile cases per route for each schemathesis case per operation."""
HEADERS = {"Authorization": f"Bearer {API_KEY}"}

EDGE_STRINGS = [
    "", "\ud800", "\udfff", "a\ud83d", "\ud83d\ude00", "\x00", "\u202e\u2066", "\ufeff", "\uffff",
    "🙂" * 200, "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "\r\n\t", "<|im_start|>system", "<|msaserve_media|>", "<tool_call>{",
    "x" * 20_000, "%00", "../../etc/passwd", "${jndi:x}", "\\u0000",
]
EDGE_NUMBERS = [0, -1, 1, 2**31, -(2**31) - 1, 2**63, -(2**63) - 1, 2**64, 10**30, -(10**30), 1e308,
                -1e308, 5e-324, float("nan"), float("inf"), float("-inf"), 0.5, -0.0]


def hostile_values() -> st.SearchStrategy:
    scalars = (
        st.none() | st.booleans() | st.sampled_from(EDGE_NUMBERS) | st.sampled_from(EDGE_STRINGS)
        | st.integers(-(2**80), 2**80) | st.floats(allow_nan=True, allow_infinity=True)
        | st.text(st.characters(codec=None, categories=None), max_size=30)
    )
    def containers(inner: st.SearchStrategy) -> st.SearchStrategy:
        return st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)

    return st.recursive(scalars, containers, max_leaves=12)


def _base_bodies() -> dict[str, dict]:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return {
        "/v1/chat/completions": chat,
        "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 2},
        "/v1/responses": {"model": MODEL, "input": chat["messages"], "max_output_tokens": 2},
    }


PATHS = [
    ["model"], ["messages"], ["messages", 0], ["messages", 0, "content"], ["messages", 0, "role"],
    ["max_tokens"], ["temperature"], ["top_p"], ["top_k"], ["seed"], ["stop"], ["n"], ["stream"], ["tools"],
    ["tool_choice"], ["logprobs"], ["top_logprobs"], ["prompt"], ["stream_options"], ["response_format"],
    ["max_completion_tokens"], ["\ud800"], ["unknown_field"],
    ["input"], ["input", 0], ["input", 0, "content"], ["instructions"], ["previous_response_id"],
    ["max_output_tokens"], ["text"], ["store"],
]


def _set(body: Any, path: list, value: Any) -> Any:
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(body, dict):
        return {**body, head: _set(body.get(head), rest, value)}
    if isinstance(body, list) and isinstance(head, int) and head < len(body):
        return [*body[:head], _set(body[head], rest, value), *body[head + 1 :]]
    return value


@st.composite
def hostile_body(draw: Any, route: str) -> bytes:
    """A valid body of `route` with 1-3 fields replaced by hostile values, or deep nesting."""
    kind = draw(st.sampled_from(["mutate", "mutate", "mutate", "nest", "raw"]))
    if kind == "nest":
        depth = draw(st.sampled_from([50, 1000, 100_000]))
        opener, closer = draw(st.sampled_from([("[", "]"), ('{"a":', "}")]))
        inner = opener * depth + ("1" if opener != "[" else "") + closer * depth
        field_name = draw(st.sampled_from(["messages", "prompt", "stop", "tools", "max_tokens"]))
        return f'{{"model": "{MODEL}", "{field_name}": {inner}}}'.encode()
    if kind == "raw":
        return draw(st.binary(max_size=200) | st.sampled_from([b"", b"{", b"null", b"[]", b'"x"', b"NaN"]))
    body: Any = _base_bodies()[route]
    for _ in range(draw(st.integers(1, 3))):
        body = _set(body, draw(st.sampled_from(PATHS)), draw(hostile_values()))
    return json.dumps(body, allow_nan=True, ensure_ascii=True).encode()


@dataclass
class InProcessFuzzReport:
    num_cases: int = 0
    statuses: Counter = field(default_factory=Counter)
    per_route: Counter = field(default_factory=Counter)
    server_errors: list[str] = field(default_factory=list)
    bad_error_bodies: list[str] = field(default_factory=list)
    stage_s: dict[str, float] = field(default_factory=dict)
    by_design: Counter = field(default_factory=Counter)

    def summary(self) -> str:
        return (f"{self.num_cases} cases, statuses {dict(sorted(self.statuses.items()))}, "
                f"{len(self.server_errors)} 5xx (+ by design: {dict(self.by_design)}), "
                f"{len(self.bad_error_bodies)} malformed error bodies, "
                f"stages {({k: round(v, 1) for k, v in self.stage_s.items()})} s")


def _error_code(response: Any) -> str | None:
    try:
        return response.json()["error"]["code"]
    except Exception:
        return None


def _check(report: InProcessFuzzReport, label: str, response: Any, sent: str) -> None:
    report.num_cases += 1
    report.statuses[response.status_code] += 1
    report.per_route[label] += 1
    code = _error_code(response)
    if (response.status_code, code) in BY_DESIGN:
        report.by_design[f"{response.status_code} {code}"] += 1
    elif response.status_code >= 500:
        report.server_errors.append(
            f"{label} → {response.status_code}: {response.text[:300]} (sent {sent:.300})"
        )
    elif response.status_code >= 400:
        try:
            error = response.json()["error"]
            assert isinstance(error["message"], str) and isinstance(error["type"], str)
        except Exception:
            report.bad_error_bodies.append(f"{label} → {response.status_code}: {response.text[:200]}")


def _send(gateway: InProcessGateway, method: str, url: str, **kwargs: Any) -> Any:
    """One request with the API key (and the caller's headers)."""
    return gateway.request(method, url, headers={**HEADERS, **kwargs.pop("headers", {})}, **kwargs)


def _settings(examples: int, rng_seed: int):
    def wrap(fn):
        return seed(rng_seed)(settings(max_examples=examples, deadline=None, database=None,
                                       phases=[Phase.explicit, Phase.generate],
                                       suppress_health_check=list(HealthCheck))(fn))
    return wrap


def _schema_case(gateway: InProcessGateway, report: InProcessFuzzReport, operation: Any,
                 mode: GenerationMode, examples: int, rng_seed: int) -> Any:
    label = f"{operation.method.upper()} {operation.path} [{mode.value}]"

    @_settings(examples, rng_seed)
    @given(case=operation.as_strategy(generation_mode=mode))
    def one(case: Any) -> None:
        kwargs = case.as_transport_kwargs(base_url="http://gateway")
        if mode is GenerationMode.POSITIVE and isinstance(kwargs.get("json"), dict):
            kwargs["json"]["model"] = MODEL  # past the 404 for an unknown model, into the engine
        request = {"params": kwargs.get("params"), "headers": {**kwargs.get("headers", {}), **HEADERS}}
        if "json" in kwargs:
            request["content"] = json.dumps(kwargs["json"], allow_nan=True).encode()
            request["headers"]["content-type"] = "application/json"
        elif kwargs.get("data") is not None:
            request["content"] = kwargs["data"]
        path = kwargs["url"].removeprefix("http://gateway")
        response = gateway.request(kwargs["method"], path, **request)
        _check(report, label, response, repr(kwargs.get("json", kwargs.get("data"))))

    return one


def fuzz_schema(gateway: InProcessGateway, report: InProcessFuzzReport, examples: int, rng_seed: int) -> None:
    """schemathesis cases of every operation, positive and negative, from the served schema."""
    schema = schemathesis.openapi.from_dict(gateway.request("GET", "/openapi.json").json())
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.path in LIVE_ONLY:
            continue
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                _schema_case(gateway, report, operation, mode, examples, rng_seed)()
            except Unsatisfiable:  # an operation without parameters has no schema-violating request
                assert mode is GenerationMode.NEGATIVE, operation.path


def _body_case(gateway: InProcessGateway, report: InProcessFuzzReport, route: str, examples: int,
               rng_seed: int) -> Any:
    @_settings(examples, rng_seed)
    @given(raw=hostile_body(route))
    def one(raw: bytes) -> None:
        response = _send(gateway, "POST", route, content=raw, headers={"content-type": "application/json"})
        _check(report, f"POST {route} [hostile]", response, repr(raw[:300]))

    return one


SESSION_IDS = st.sampled_from(EDGE_STRINGS[1:]) | st.text(st.characters(codec=None), min_size=1, max_size=40)


def fuzz_hostile(
    gateway: InProcessGateway, report: InProcessFuzzReport, examples: int, rng_seed: int
) -> None:
    """Hostile JSON bodies on the generation routes, hostile session ids on the session routes."""
    for route in _base_bodies():
        _body_case(gateway, report, route, examples, rng_seed)()

    @_settings(examples, rng_seed)
    @given(session_id=SESSION_IDS, method=st.sampled_from(["GET", "DELETE", "POST"]))
    def session_case(session_id: str, method: str) -> None:
        raw_id = session_id.encode("utf-8", "surrogatepass")
        path = f"/v1/sessions/{urllib.parse.quote(raw_id, safe='')}" + ("/move" if method == "POST" else "")
        headers = {"X-Session-Id": raw_id[:200]}  # raw bytes: a header may carry any octet
        response = _send(gateway, method, path, headers=headers)
        _check(report, f"{method} /v1/sessions/{{id}} [hostile]", response, repr(session_id[:100]))

    session_case()


def run_fuzz(gateway: InProcessGateway, examples: int, rng_seed: int) -> tuple[InProcessFuzzReport, float]:
    start = time.monotonic()
    report = InProcessFuzzReport()
    fuzz_schema(gateway, report, examples, rng_seed)
    report.stage_s["schema"] = time.monotonic() - start
    fuzz_hostile(gateway, report, examples * HOSTILE_PER_SCHEMA_EXAMPLE, rng_seed)
    report.stage_s["hostile"] = time.monotonic() - start - report.stage_s["schema"]
    return report, time.monotonic() - start
