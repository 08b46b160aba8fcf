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

_COUNTERS = {
    "hits_memory": ("hits", {"tier": "memory"}),
    "hits_disk": ("hits", {"tier": "disk"}),
    "misses": ("misses", {}),
    "corruptions": ("corruptions", {}),
    "evictions_to_disk": ("evictions", {"to": "disk"}),
    "evictions_dropped": ("evictions", {"to": "dropped"}),
    "bytes_written": ("bytes_written", {}),
    "bytes_read": ("bytes_read", {}),
}


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
        tiers = [("memory", store.memory)] + ([("disk", store.disk)] if store.disk is not None else [])
        for tier_name, tier in tiers:
            self.bytes.set(tier.bytes_used, tags={**tags, "tier": tier_name})
            self.capacity.set(tier.capacity_bytes, tags={**tags, "tier": tier_name})
            self.pages.set(len(tier), tags={**tags, "tier": tier_name})
        now = store.stats.as_dict()
        last = self._last.get(store_name, {})
        for field_name, (metric, extra_tags) in _COUNTERS.items():
            delta = now[field_name] - last.get(field_name, 0)
            if delta > 0:
                self.counters[metric].inc(delta, tags={**tags, **extra_tags})
        self._last[store_name] = now

    def publish_sessions(self, count: int, corruptions: int) -> None:
        """Sessions held, and session manifests dropped for a checksum mismatch (store="sessions")."""
        self.sessions.set(count, tags={"shard": self.shard})
        delta = corruptions - self._last.get("sessions", {}).get("corruptions", 0)
        if delta > 0:
            self.counters["corruptions"].inc(delta, tags={"shard": self.shard, "store": "sessions"})
        self._last["sessions"] = {"corruptions": corruptions}
