"""`ray.util.metrics` for the KV cache service, all prefixed `msaserve_kvcache_` (exported as
`ray_msaserve_kvcache_*`): bytes, capacity_bytes and pages per store and tier; hits (by tier),
misses, corruptions, evictions (to disk / dropped), bytes_written, bytes_read; fetch_latency_seconds;
sessions. Replica-side latencies (index load, page fetch) are the platform's
`msaserve_index_load_latency_seconds` / `msaserve_page_fetch_latency_seconds`, fed from
`LazyPageFetcher.stats`.

Stores count in plain integers (they run without Ray); a shard publishes the change since its
last publish after every call, so Prometheus sees counters and current bytes per tier.
"""

from ray.util import metrics

from msaserve.kvcache.store import PageStore


def _counter_of(stat: str) -> tuple[str, dict[str, str]]:
    """A `StoreStats` field → (metric, extra tags): hits and evictions are tagged by tier."""
    if stat.startswith("hits_"):
        return "hits", {"tier": stat.removeprefix("hits_")}
    if stat.startswith("evictions_to_"):
        return "evictions", {"to": stat.removeprefix("evictions_to_")}
    if stat == "evictions_dropped":
        return "evictions", {"to": "dropped"}
    return stat, {}


class ShardMetrics:
    """Metrics of one shard; tags name the shard and the store (`kv`, `index`)."""

    def __init__(self, shard_id: int) -> None:
        self.shard = str(shard_id)
        store_tags = ("shard", "store")
        self.bytes = metrics.Gauge(
            "msaserve_kvcache_bytes", "Bytes held per store and tier.", tag_keys=(*store_tags, "tier")
        )
        self.capacity = metrics.Gauge(
            "msaserve_kvcache_capacity_bytes", "Capacity per store and tier.", tag_keys=(*store_tags, "tier")
        )
        self.pages = metrics.Gauge("msaserve_kvcache_pages", "Pages held per store and tier.",
                                   tag_keys=(*store_tags, "tier"))
        self.counters = {
            # No `_total` suffix: the exporter adds it to counters (as for the platform's metrics).
            name: metrics.Counter(f"msaserve_kvcache_{name}", f"KV cache service {name}.",
                                  tag_keys=(*store_tags, *tags))
            for name, tags in {
                "hits": ("tier",), "misses": (), "corruptions": (), "evictions": ("to",),
                "bytes_written": (), "bytes_read": (),
            }.items()
        }
        self.fetch_latency = metrics.Histogram(
            "msaserve_kvcache_fetch_latency_seconds", "Time a shard spends serving one batched read.",
            boundaries=[1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0], tag_keys=store_tags,
        )
        self.sessions = metrics.Gauge("msaserve_kvcache_sessions", "Sessions held.", tag_keys=("shard",))
        self._last: dict[str, dict[str, int]] = {}

    def observe_fetch(self, store_name: str, seconds: float) -> None:
        self.fetch_latency.observe(seconds, tags={"shard": self.shard, "store": store_name})

    def publish(self, store_name: str, store: PageStore) -> None:
        tags = {"shard": self.shard, "store": store_name}
        for tier in store.tiers:
            self.bytes.set(tier.bytes_used, tags={**tags, "tier": tier.kind})
            self.capacity.set(tier.capacity_bytes, tags={**tags, "tier": tier.kind})
            self.pages.set(len(tier), tags={**tags, "tier": tier.kind})
        now = store.stats.as_dict()
        last = self._last.get(store_name, {})
        for field_name, value in now.items():
            metric, extra_tags = _counter_of(field_name)
            delta = value - last.get(field_name, 0)
            if delta > 0 and metric in self.counters:
                self.counters[metric].inc(delta, tags={**tags, **extra_tags})
        self._last[store_name] = now

    def publish_sessions(self, count: int, corruptions: int) -> None:
        """Sessions held, and session manifests dropped for a checksum mismatch (store="sessions")."""
        self.sessions.set(count, tags={"shard": self.shard})
        delta = corruptions - self._last.get("sessions", {}).get("corruptions", 0)
        if delta > 0:
            self.counters["corruptions"].inc(delta, tags={"shard": self.shard, "store": "sessions"})
        self._last["sessions"] = {"corruptions": corruptions}
