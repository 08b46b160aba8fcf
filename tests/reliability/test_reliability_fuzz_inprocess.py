"""Issue 26: property-based fuzz of every route, in process (see inprocess_fuzzing.py): 0 5xx and
every error an OpenAI error body. Seeded and bounded (about a minute on the CI-class machine); the
long run is benchmarks/reliability/fuzz_inprocess.py."""

from collections.abc import Iterator

import pytest
from inprocess_app import InProcessGateway, inprocess_gateway
from inprocess_fuzzing import FUZZ_CONFIG, run_fuzz

pytestmark = pytest.mark.timeout(300)
EXAMPLES_PER_OPERATION = 8


@pytest.fixture(scope="module")
def gateway() -> Iterator[InProcessGateway]:
    with inprocess_gateway(FUZZ_CONFIG) as g:
        yield g


def test_fuzzed_requests_get_no_5xx(gateway) -> None:
    report, elapsed = run_fuzz(gateway, EXAMPLES_PER_OPERATION, rng_seed=20261203)
    print(f"in-process fuzz: {report.summary()} in {elapsed:.1f}s")
    assert report.num_cases >= 120, report.summary()
    assert not report.server_errors, "\n".join(report.server_errors[:10])
    assert not report.bad_error_bodies, "\n".join(report.bad_error_bodies[:10])
