"""A real local Ray Serve app per test module (loopback only), driven over HTTP."""

from collections.abc import Iterator

import pytest
from local_serve_app import LiveApp, start_live_app


@pytest.fixture(scope="module")
def live_app(request) -> Iterator[LiveApp]:
    """Parametrise with `@pytest.mark.parametrize("live_app", [config_dict], indirect=True)` or set
    `SERVE_CONFIG` (a dict) in the test module."""
    data = getattr(request, "param", None) or request.module.SERVE_CONFIG
    with start_live_app(data) as app:
        yield app
