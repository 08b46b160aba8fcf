"""msaserve's metrics (docs/design.md §4) through `ray.util.metrics`.

Ray exports each one on its metrics port as `ray_<name>` (so `ray_msaserve_ttft_seconds_bucket`, ...),
which Prometheus scrapes and the Ray dashboard / Grafana plot. Metrics are created lazily, inside the
process that records them (a Serve replica), via `get_metrics()`; other parts (router, preprocess,
KV cache) record through the same object so that names stay in one place.
"""

from collections import Counter
from functools import cache

from ray.util import metrics as ray_metrics

PREFIX = "msaserve_"

_LATENCY_BUCKETS_S = [
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
]
_FAST_BUCKETS_S = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0]

# name → (kind, description, tag keys); kind is "counter", "gauge", "histogram" or "histogram_fast".
METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "requests": (
        "counter",
        "HTTP requests finished, by route and status code.",
        ("model", "route", "status"),
    ),
    "server_errors": (
        "counter",
        "5xx answers by route, status and cause (an error code such as replica_unavailable, or the "
        "exception's type for an internal error).",
        ("model", "route", "status", "cause"),
    ),
    "stream_errors": (
        "counter",
        "Streams ended by an error event after their 200 was sent (e.g. a replica lost mid-stream).",
        ("model", "route", "code"),
    ),
    "ttft_seconds": ("histogram", "Time to first token.", ("model",)),
    "tpot_seconds": ("histogram_fast", "Mean time per output token after the first.", ("model",)),
    "e2e_latency_seconds": ("histogram", "End-to-end request latency at the gateway.", ("model", "route")),
    "prompt_tokens": ("counter", "Prompt tokens processed.", ("model",)),
    "output_tokens": ("counter", "Output tokens generated (rate() gives tokens/s).", ("model",)),
    "tokens_per_second": ("gauge", "Output tokens/s of one replica over its last stats period.", ("model",)),
    "running_requests": ("gauge", "Sequences running on one model replica.", ("model",)),
    "sparse_resident_requests": (
        "gauge", "Requests decoding sparse-resident (off the KV pool) on one model replica.", ("model",)),
    "waiting_requests": ("gauge", "Requests waiting on one model replica.", ("model",)),
    "pages_used": ("gauge", "KV pages in use on one model replica.", ("model",)),
    "pages_free": ("gauge", "Free KV pages on one model replica.", ("model",)),
    "prefix_hit_rate": ("gauge", "Share of prompt tokens served from the prefix cache.", ("model",)),
    "index_load_latency_seconds": ("histogram", "Time to load a session's index pages.", ("model",)),
    "page_fetch_latency_seconds": (
        "histogram_fast",
        "Time to fetch one KV page from the KV cache service.",
        ("model",),
    ),
    "router_decisions": (
        "counter",
        "Replica choices by policy and reason (affinity, prefix, cost, pow2).",
        ("policy", "reason"),
    ),
    "preprocess_latency_seconds": ("histogram", "Media preprocessing time per request.", ("kind",)),
}
METRIC_NAMES = [PREFIX + name for name in METRICS]


class PlatformMetrics:
    """Holds one Ray metric object per entry of METRICS; record with `m.observe/inc/set(name, ...)`."""

    def __init__(self) -> None:
        self._metrics: dict[str, object] = {}
        self._counts: Counter[tuple[str, tuple[tuple[str, str], ...]]] = Counter()
        """This process's counter totals (Ray exports them; `count` reads them back here)."""
        for name, (kind, description, tags) in METRICS.items():
            full = PREFIX + name
            if kind == "counter":
                metric: object = ray_metrics.Counter(full, description=description, tag_keys=tags)
            elif kind == "gauge":
                metric = ray_metrics.Gauge(full, description=description, tag_keys=tags)
            else:
                buckets = _FAST_BUCKETS_S if kind == "histogram_fast" else _LATENCY_BUCKETS_S
                metric = ray_metrics.Histogram(
                    full, description=description, boundaries=buckets, tag_keys=tags
                )
            self._metrics[name] = metric

    def inc(self, name: str, value: float = 1.0, **tags: str) -> None:
        if value > 0:
            self._metrics[name].inc(value, tags=tags)  # type: ignore[attr-defined]
            self._counts[(name, tuple(sorted(tags.items())))] += value

    def count(self, name: str, **tags: str) -> float:
        """This process's total of counter `name` over the series whose tags include `tags`."""
        wanted = set(tags.items())
        return sum(v for (n, series), v in self._counts.items() if n == name and wanted <= set(series))

    def set(self, name: str, value: float, **tags: str) -> None:
        self._metrics[name].set(value, tags=tags)  # type: ignore[attr-defined]

    def observe(self, name: str, value: float, **tags: str) -> None:
        self._metrics[name].observe(value, tags=tags)  # type: ignore[attr-defined]


@cache
def get_metrics() -> PlatformMetrics:
    """The process's metrics (created on first use, so importing this module needs no Ray worker)."""
    return PlatformMetrics()
