"""Reading the platform's Prometheus export (Ray's metrics port) in the live reliability tests."""

import time
from collections.abc import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (every worker's series)."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def samples(text: str, name: str) -> list:
    return [s for family in text_string_to_metric_families(text) for s in family.samples if s.name == name]


def scrape(metrics_url: str) -> str:
    return httpx.get(metrics_url, timeout=10).text


def wait_for_metric(metrics_url: str, check: Callable[[str], bool], timeout_s: float = 30.0) -> str:
    """Scrape until check(text) holds (metrics reach the export about once a second) or time runs
    out; returns the last scrape either way, for the caller's asserts."""
    deadline = time.monotonic() + timeout_s
    while not check(text := scrape(metrics_url)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return text


def requests_counted(before: str, after: str, status: str, route: str = "/v1/completions") -> float:
    """Answers with `status` on `route` that the gateway counted between two scrapes."""
    name = "ray_msaserve_requests_total"
    return metric(after, name, status=status, route=route) - metric(before, name, status=status, route=route)
