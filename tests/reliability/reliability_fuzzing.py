"""Schemathesis against a live app's served OpenAPI schema: every operation, positive (schema-valid)
and negative (schema-violating) cases, seeded so that a run is reproducible.

Used by tests/reliability/test_reliability_fuzz.py (a small run in CI) and by
benchmarks/reliability/fuzz.py (the >= 1,000-case run). schemathesis's own pytest plugin does not
work with pytest 9 (`from_fixture` fails on `Function._nodeid`), so the cases are driven through
hypothesis directly.
"""

from collections import Counter
from dataclasses import dataclass, field

import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import positive_data_acceptance
from schemathesis.core.failures import Failure, FailureGroup


def fuzz_serve_config(api_key: str) -> dict:
    """The live app every fuzz run targets (the CI test and the benchmark): API key on, a body
    limit, and the KV cache service on so that session moves are real (404/200) instead of a
    deliberate 501."""
    return {
        "model": {"spec": "tiny"},
        "engine": {"max_num_seqs": 8, "max_waiting": 32, "max_model_len": 512},
        "auth": {"api_keys": [api_key]},
        "http": {"max_body_bytes": 65536},
        "kvcache": {"enabled": True, "memory_bytes": 32 << 20},
    }


@dataclass
class FuzzReport:
    num_cases: int = 0
    statuses: Counter = field(default_factory=Counter)
    per_operation: Counter = field(default_factory=Counter)
    server_errors: list[str] = field(default_factory=list)
    """One line per 5xx: operation, status, the start of the body."""
    violations: list[str] = field(default_factory=list)
    """One line per response that broke the schema (or a negative case the server accepted)."""

    def summary(self) -> str:
        return (
            f"{self.num_cases} cases, statuses {dict(sorted(self.statuses.items()))}, "
            f"{len(self.server_errors)} 5xx, {len(self.violations)} schema violations"
        )


def _failures_of(exc: BaseException) -> list[str]:
    if isinstance(exc, FailureGroup):
        return [f.title for f in exc.exceptions]
    return [getattr(exc, "title", repr(exc))]


def _run_operation(
    operation,
    mode: GenerationMode,
    served_model: str | None,
    base_url: str,
    headers: dict,
    examples: int,
    rng_seed: int,
    report: FuzzReport,
) -> None:
    """`served_model` replaces a generated body's `model`, so that cases get past the 404 for an
    unknown model and reach validation, the engine and the streaming paths."""
    kind = mode.value + (", served model" if served_model else "")
    label = f"{operation.method.upper()} {operation.path} [{kind}]"

    @seed(rng_seed)
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=False,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def one_case(case) -> None:
        if served_model and isinstance(case.body, dict):
            case.body["model"] = served_model
        response = case.call(base_url=base_url, headers=headers, timeout=60)
        report.num_cases += 1
        report.statuses[response.status_code] += 1
        report.per_operation[label] += 1
        if response.status_code >= 500:
            report.server_errors.append(f"{label} → {response.status_code}: {response.text[:300]}")
        try:
            # The API refuses some schema-valid bodies by design (a 400 naming the parameter):
            # penalties other than 0, an empty prompt, more tokens than the context holds. So the
            # check that schema-valid data is accepted is off; every response check stays on.
            case.validate_response(response, headers=headers, excluded_checks=[positive_data_acceptance])
        except (Failure, FailureGroup) as exc:
            for title in _failures_of(exc):
                report.violations.append(
                    f"{label} → {response.status_code}: {title}: "
                    f"{response.text[:200]} (sent {case.body!r:.200})"
                )

    try:
        one_case()
    except Unsatisfiable:
        # An operation without parameters or body (GET /health) has no schema-violating request.
        assert mode is GenerationMode.NEGATIVE, label


def fuzz(
    base_url: str, api_key: str, served_model: str, examples_per_operation: int, rng_seed: int = 0
) -> FuzzReport:
    """Against every operation: `examples_per_operation` positive and as many negative cases, and
    for operations with a body as many positive cases naming the served model."""
    schema = schemathesis.openapi.from_url(base_url + "/openapi.json")
    headers = {"Authorization": f"Bearer {api_key}"}
    report = FuzzReport()
    for result in schema.get_all_operations():
        operation = result.ok()
        runs = [(GenerationMode.POSITIVE, None), (GenerationMode.NEGATIVE, None)]
        if operation.body:
            runs.append((GenerationMode.POSITIVE, served_model))
        for mode, model in runs:
            _run_operation(
                operation, mode, model, base_url, headers, examples_per_operation, rng_seed, report
            )
    return report
