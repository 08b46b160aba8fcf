"""The service's settings: `KVCacheConfig`, the user-facing `kvcache:` section of `ServeConfig`
(pydantic at the edge), and `ServiceConfig`, the checked dataclass the shards and the client use,
which takes the defaults it shares with it from there."""

from dataclasses import dataclass
from pathlib import Path
from typing import Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

GiB = 1 << 30
MiB = 1 << 20


class KVCacheConfig(BaseModel):
    """The `kvcache:` section of `ServeConfig`. `ServiceConfig` takes its defaults from here."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    enabled: bool = Field(False, description="Run the disaggregated KV cache service.")
    num_shards: int = Field(1, ge=1, le=1024, description="Actors the pages are sharded over by hash.")
    memory_bytes: int = Field(4 * GiB, ge=MiB, le=1 << 44, description="Host-memory bytes across all shards.")
    disk_path: str | None = Field(None, description="Directory of the disk tier; unset disables it.")
    disk_bytes: int = Field(
        0, ge=0, le=1 << 50, description="Disk-tier capacity in bytes (0 = no disk tier)."
    )
    max_sessions: int = Field(
        100_000, ge=1, le=1 << 32,
        description="Session records kept across all shards; past it the least recently updated "
        "unpinned records are evicted (pinned, live sessions never are).",
    )
    session_idle_unpin_s: float = Field(
        3600.0, ge=60.0, le=30 * 86400.0,
        description="A persisted session not updated for this long loses its pins: its record and pages "
        "become evictable; if it comes back it is pinned again and recomputes what was evicted.",
    )

    @model_validator(mode="after")
    def _disk_needs_path(self) -> Self:
        if self.disk_bytes > 0 and not self.disk_path:
            raise ValueError("kvcache.disk_bytes > 0 needs kvcache.disk_path")
        return self


def _default(name: str):
    return KVCacheConfig.model_fields[name].default


@dataclass(frozen=True)
class ServiceConfig:
    """Capacities are totals over all shards; each shard gets an equal share, split between its
    index store (`index_fraction`) and block store (the rest)."""

    num_shards: int = _default("num_shards")
    memory_bytes: int = _default("memory_bytes")
    disk_path: str | None = None
    """Directory of the disk tier (a PersistentVolume mount on Kubernetes); None = memory only."""
    disk_bytes: int = _default("disk_bytes")
    index_fraction: float = 0.125
    """Share of each tier for index-K pages: M3's index is 1/16 of its KV per page."""
    write_through: bool = True
    """Write every page and session to disk at once, so a restart keeps everything."""
    fsync: bool = False
    """fsync page and manifest files (survive a machine crash, not just a process restart)."""
    max_sessions: int = _default("max_sessions")
    """Session records kept over all shards; past it the least recently updated unpinned ones go."""
    actor_name_prefix: str = "msaserve_kvcache_shard"
    namespace: str = "msaserve"
    shared_index_arena: bool = False
    """Keep the index store's pages in shared-memory segment files (`shared_segments.py`), so that
    an engine in another process on the node leases them zero-copy (`lease_index_shared`); shards
    run as Ray actors (`start_shards`) turn it on."""
    shared_directory: str | None = None
    """Where those files go (None: /dev/shm, else the temp directory)."""
    lease_ttl_s: float = 120.0
    """A lease not ended within this long is ended by the shard (a reader that died mid-read)."""

    def __post_init__(self) -> None:
        if not 1 <= self.num_shards <= 1024:
            raise ValueError(f"kvcache num_shards={self.num_shards} must be 1 to 1024")
        if self.memory_bytes < self.num_shards:
            raise ValueError(f"kvcache memory_bytes={self.memory_bytes} must be ≥ num_shards")
        if self.disk_bytes < 0:
            raise ValueError(f"kvcache disk_bytes={self.disk_bytes} must be ≥ 0")
        if self.disk_bytes > 0 and not self.disk_path:
            raise ValueError("kvcache disk_bytes > 0 needs disk_path")
        if self.max_sessions < self.num_shards:
            raise ValueError(
                f"kvcache max_sessions={self.max_sessions} must be ≥ num_shards={self.num_shards}"
            )
        if not 0.0 < self.index_fraction < 1.0:
            raise ValueError(f"kvcache index_fraction={self.index_fraction} must be in (0, 1)")
        if not self.lease_ttl_s > 0:
            raise ValueError(f"kvcache lease_ttl_s={self.lease_ttl_s} must be > 0")

    @classmethod
    def from_settings(cls, kvcache_config: KVCacheConfig, **overrides) -> "ServiceConfig":
        """From the user-facing `KVCacheConfig` (num_shards, memory_bytes, disk_path, disk_bytes,
        max_sessions); overrides set the fields it does not have."""
        fields = dict(
            num_shards=kvcache_config.num_shards, memory_bytes=kvcache_config.memory_bytes,
            disk_path=kvcache_config.disk_path, disk_bytes=kvcache_config.disk_bytes,
            max_sessions=max(kvcache_config.max_sessions, kvcache_config.num_shards),
        )
        return cls(**{**fields, **overrides})

    def shard_dir(self, shard_id: int) -> Path | None:
        if self.disk_path is None or self.disk_bytes == 0:
            return None
        return Path(self.disk_path) / f"shard-{shard_id:04d}-of-{self.num_shards:04d}"

    def actor_name(self, shard_id: int) -> str:
        return f"{self.actor_name_prefix}_{shard_id}_of_{self.num_shards}"

    @property
    def max_sessions_per_shard(self) -> int:
        return -(-self.max_sessions // self.num_shards)

    def split(self, total: int, index: bool) -> int:
        """One shard's share of `total` bytes for the index store (index=True) or block store."""
        per_shard = total // self.num_shards
        index_share = int(per_shard * self.index_fraction)
        return index_share if index else per_shard - index_share
