"""A real local Ray Serve app (loopback only) for the live tests and the reliability benchmark.

One starter for every test folder (tests/ has no packages; pytest puts this folder on sys.path
through tests/conftest.py, and benchmarks add it themselves).
"""

import random
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import ray
from ray import serve

from msaserve.platform.app import APP_NAME, build_app
from msaserve.platform.config import ServeConfig
from msaserve.platform.http_limits import apply_proxy_limits, proxy_http_options
from msaserve.platform.ray_defaults import apply_local_loopback, apply_ray_defaults

# Below Linux's ephemeral range (32768-60999), where Ray's own processes take their random ports,
# and above Ray's worker-port range (10002-19999): a port picked here and bound a few seconds later
# by the Serve proxy is not taken meanwhile by Ray's startup (a clean-clone run once lost four tests
# to "Failed to bind to address '127.0.0.1:44217'").
_PORTS = range(20000, 32768)


def free_port() -> int:
    rng = random.Random()
    for _ in range(200):
        port = rng.choice(_PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in {_PORTS.start}-{_PORTS.stop - 1} after 200 tries")


@dataclass
class LiveApp:
    base_url: str
    metrics_url: str
    config: ServeConfig
    first_ready: httpx.Response
    """The /ready answer right after serve.run returned (before the engine finished loading)."""
    logs_dir: str
    """The Ray session's log folder (every replica's stdout/stderr and Serve logs)."""

    def model_handle(self):
        return serve.get_deployment_handle("Model", app_name=APP_NAME)

    def engine_stats(self):
        return self.model_handle().stats.remote().result(timeout_s=30)


def wait_healthy(base_url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(base_url + "/ready", timeout=30).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{base_url}/ready not 200 after {timeout_s}s")


@contextmanager
def start_live_app(data: dict[str, Any], num_cpus: int = 4, timeout_s: float = 120) -> Iterator[LiveApp]:
    """Start Ray + the msaserve app for `data` (a ServeConfig dict) on free loopback ports, wait
    until /ready is 200 (a model replica answered), and always shut both down."""
    http_port, metrics_port = free_port(), free_port()
    config = ServeConfig.from_dict({**data, "http": {**data.get("http", {}), "port": http_port}})
    apply_ray_defaults()  # as `msaserve serve` does, before the GCS starts
    apply_local_loopback()
    apply_proxy_limits(config.http)
    context = ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        _metrics_export_port=metrics_port,
        _system_config={"metrics_report_interval_ms": 1000},
        configure_logging=False,
    )
    try:
        serve.start(http_options=proxy_http_options(config.http))  # as `msaserve serve` does
        serve.run(build_app(config), name=APP_NAME, route_prefix="/", blocking=False)
        base_url = f"http://127.0.0.1:{http_port}"
        first = httpx.get(base_url + "/ready", timeout=30)
        wait_healthy(base_url, timeout_s)
        logs_dir = context.address_info["session_dir"] + "/logs"
        yield LiveApp(base_url, f"http://127.0.0.1:{metrics_port}/metrics", config, first, logs_dir)
    finally:
        serve.shutdown()
        ray.shutdown()
