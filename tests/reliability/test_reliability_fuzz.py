"""Hostile input: schemathesis generates requests from the app's own served OpenAPI schema (every
operation, schema-valid and schema-violating cases) against a live `tiny` app. No response may be a
5xx, and every response must conform to the schema (documented status, content type, headers,
body); a schema-violating request must be refused with a 4xx. Seeded, so CI is deterministic; the
>= 1,000-case run is benchmarks/reliability/fuzz.py."""

import time

import pytest
from local_serve_app import start_live_app
from reliability_fuzzing import fuzz, fuzz_serve_config

pytestmark = pytest.mark.slow

API_KEY = "fuzz-key"
SERVE_CONFIG = fuzz_serve_config(API_KEY)
EXAMPLES_PER_OPERATION = 10  # 7 operations x 2-3 kinds of case: at most 160 cases


def test_generated_requests_get_no_5xx_and_match_the_schema() -> None:
    with start_live_app(SERVE_CONFIG) as app:
        start = time.monotonic()
        report = fuzz(app.base_url, API_KEY, "msaserve/tiny", EXAMPLES_PER_OPERATION, rng_seed=20261129)
        elapsed = time.monotonic() - start
    print(f"fuzz: {report.summary()} in {elapsed:.1f}s")
    assert report.num_cases >= 50, report.summary()  # the generator really ran on every operation
    assert not report.server_errors, "\n".join(report.server_errors[:20])
    assert not report.violations, "\n".join(report.violations[:20])
