"""One shard of the service: an index store, a block store and the sessions routed to it.

`KVCacheShard` is a plain class (tests drive it without Ray); `actor_class()` is the same class
as a Ray actor. Pages live on shard `page_hash % num_shards`, sessions on
`xxh3(session_id) % num_shards`. Methods take and return plain data and uint8 arrays, which
Ray moves through its object store (readers on the node map them zero-copy).
"""

import dataclasses
import functools
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from msaserve.kvcache.arena import SegmentAllocator
from msaserve.kvcache.codec import Payload, as_payload
from msaserve.kvcache.config import ServiceConfig
from msaserve.kvcache.keys import (
    INDEX_GROUPS,
    KV_GROUPS,
    index_key,
    index_namespace,
    kv_key,
    kv_keys,
    kv_namespace,
)
from msaserve.kvcache.session_records import SessionRecord, SessionStore
from msaserve.kvcache.shared_segments import SharedSegments
from msaserve.kvcache.store import GroupLease, PageStore
from msaserve.kvcache.tiers import StoredPage
from msaserve.kvcache.views import PageViews, SharedPageViews

PageUpload = tuple[int, Sequence[Payload] | None, Payload | None]
"""(page hash, K+V payload per layer or None, index-K payload for all layers or None)."""


class KVCacheShard:
    def __init__(self, config: ServiceConfig, shard_id: int, publish_metrics: bool = True,
                 segment_allocators: Mapping[str, SegmentAllocator] | None = None) -> None:
        """segment_allocators: store name ("index", "kv") → allocator of its memory tier's arena
        segments (pinned host memory from an engine in this process: `lease_index` readers then
        copy pages to the GPU straight from there); a store without one keeps plain arrays."""
        allocators = dict(segment_allocators or {})
        if not set(allocators) <= {"index", "kv"}:
            raise ValueError(f"segment_allocators for stores {sorted(allocators)}: allowed 'index', 'kv'")
        self.config = config
        self.shard_id = shard_id
        root = config.shard_dir(shard_id)
        self.shared_segments: SharedSegments | None = None
        if config.shared_index_arena and "index" not in allocators:
            directory = None if config.shared_directory is None else Path(config.shared_directory)
            prefix = f"msaserve-{config.namespace}-{config.actor_name(shard_id)}"
            self.shared_segments = SharedSegments(prefix, directory)
            allocators["index"] = self.shared_segments

        def store(name: str, index: bool) -> PageStore:
            return PageStore(
                memory_bytes=config.split(config.memory_bytes, index),
                disk_path=None if root is None else root / name,
                disk_bytes=config.split(config.disk_bytes, index),
                write_through=config.write_through, fsync=config.fsync,
                segment_allocator=allocators.get(name),
                key_groups=KV_GROUPS if name == "kv" else INDEX_GROUPS,
            )

        self.stores = {"kv": store("kv", index=False), "index": store("index", index=True)}
        self.arena_stores = frozenset(allocators)
        """Stores whose memory tier keeps its pages in an arena (`arena.py`)."""
        self._leases: dict[int, tuple[str, list[str], list[StoredPage | None]] | GroupLease] = {}
        """Open leases: (store, keys, pages) by key (`_lease`), or a lease of whole pages by group
        (`PageStore.lease_groups`: K/V pages of every layer, index pages)."""
        self._lease_started: dict[int, float] = {}
        self._next_lease = 0
        self.expired_leases = 0
        self.sessions = SessionStore(None if root is None else root / "sessions", fsync=config.fsync,
                                     max_sessions=config.max_sessions_per_shard)
        self.metrics = None
        if publish_metrics:
            from msaserve.kvcache.metrics import ShardMetrics

            self.metrics = ShardMetrics(shard_id)
            self._publish()

    # ---- pages -------------------------------------------------------------------------------
    def put_pages(self, model_key: str, pages: Sequence[PageUpload], pin: bool = False) -> int:
        """Store pages; returns the bytes stored. Raises CapacityError when pinned pages fill it."""
        stored = 0
        for page_hash, kv_per_layer, index in pages:
            if index is not None:
                self.stores["index"].put(index_key(model_key, page_hash), index, pin)
                stored += as_payload(index).nbytes
            for layer, payload in enumerate(kv_per_layer or ()):
                self.stores["kv"].put(kv_key(model_key, page_hash, layer), payload, pin)
                stored += as_payload(payload).nbytes
        self._publish()
        return stored

    def get_kv(self, model_key: str, requests: Sequence[tuple[int, int]]) -> list[Payload | None]:
        """K+V payloads for (page hash, layer) pairs; None where missing or corrupt."""
        return self._get("kv", [kv_key(model_key, h, layer) for h, layer in requests])

    def get_index(self, model_key: str, page_hashes: Sequence[int]) -> list[Payload | None]:
        return self._get("index", [index_key(model_key, h) for h in page_hashes])

    def get_index_packed(
        self, model_key: str, page_hashes: Sequence[int], row_bytes: int,
        out: np.ndarray | None = None,
    ) -> tuple[np.ndarray | None, list[bool]]:
        """Index payloads packed as rows (`_get_packed`)."""
        keys = [index_key(model_key, h) for h in page_hashes]
        return self._get_packed("index", keys, row_bytes, out)

    def get_kv_packed(
        self, model_key: str, requests: Sequence[tuple[int, int]], row_bytes: int,
        out: np.ndarray | None = None,
    ) -> tuple[np.ndarray | None, list[bool]]:
        """K+V payloads of (page hash, layer) pairs packed as rows (`_get_packed`)."""
        keys = [kv_key(model_key, h, layer) for h, layer in requests]
        return self._get_packed("kv", keys, row_bytes, out)

    def has_pages(self, model_key: str, page_hashes: Sequence[int], num_layers: int) -> list[bool]:
        """Whether index-K and K+V of every layer are held for each page (unverified)."""
        out = []
        for h in page_hashes:
            keys = [kv_key(model_key, h, layer) for layer in range(num_layers)]
            has_index = self.stores["index"].contains([index_key(model_key, h)])[0]
            out.append(has_index and all(self.stores["kv"].contains(keys)))
        return out

    def delete_pages(self, model_key: str, page_hashes: Sequence[int], num_layers: int) -> None:
        """Remove pages (index and every layer's K+V) and any pins on them."""
        self.stores["kv"].delete(kv_keys(model_key, page_hashes, num_layers))
        self.stores["index"].delete([index_key(model_key, h) for h in page_hashes])
        self._publish()

    def pin_pages(
        self, model_key: str, page_hashes: Sequence[int], num_layers: int, pin: bool = True
    ) -> None:
        """Take (pin=True) or release one pin on the index and every layer's K+V of each page."""
        ix_keys = [index_key(model_key, h) for h in page_hashes]
        for name, keys in (("kv", kv_keys(model_key, page_hashes, num_layers)), ("index", ix_keys)):
            (self.stores[name].pin if pin else self.stores[name].unpin)(keys)

    def _get_packed(
        self, store_name: str, keys: list[str], row_bytes: int, out: np.ndarray | None,
    ) -> tuple[np.ndarray | None, list[bool]]:
        """Verified payloads written as consecutive rows: into `out` [len(keys), row_bytes] (a
        caller in this process hands its buffer) or, without out, into a new array that is returned
        (through Ray: one object per call instead of one per page). Each page is copied into its
        row and the copy verified there (`PageStore.read_into`). Returns (the new array or None, ok
        per key); the row of a missing or corrupt page is zeros."""
        packed = np.empty((len(keys), row_bytes), dtype=np.uint8) if out is None else None
        ok = self._read_into(store_name, keys, packed if out is None else out, range(len(keys)))
        return packed, ok

    def lease_index(self, model_key: str, page_hashes: Sequence[int]) -> PageViews:
        """Zero-copy index reads for a caller in this process (`views.py`): the stored pages
        themselves, unverified, held until `release_lease`. Where the index memory tier has an
        arena, one lookup per page (its slot is kept under `keys.INDEX_GROUPS`), no key built."""
        if getattr(self.stores["index"].memory, "groups", None) is None:
            return self._lease("index", [index_key(model_key, h) for h in page_hashes])
        return self._lease_groups("index", index_namespace(model_key), page_hashes, 1)

    def lease_kv(self, model_key: str, page_hashes: Sequence[int], num_layers: int) -> PageViews:
        """Zero-copy K+V reads of every layer of these pages for a caller in this process (item
        i · num_layers + layer: page i's K+V of that layer): a sparse-resident session's GPU kernels
        read the leased pages where they lie (pinned arena segments, through UVA) and check each at
        first use. Held until `release_lease`; a lease older than `lease_ttl_s` ends unless
        `renew_leases` refreshed it. Where the K/V memory tier has an arena, one lookup per page
        (its layers' slots are kept under `keys.kv_page_group`), not one per layer."""
        if getattr(self.stores["kv"].memory, "groups", None) is None:
            return self._lease("kv", kv_keys(model_key, page_hashes, num_layers))
        return self._lease_groups("kv", kv_namespace(model_key), page_hashes, num_layers)

    def _lease_groups(self, store_name: str, namespace: str, page_hashes: Sequence[int],
                      members: int) -> PageViews:
        """A lease of members 0..members-1 of each page's group (namespace, hash) in a store whose
        memory tier keeps groups (`PageStore.lease_groups`)."""
        start = time.perf_counter()
        lease = self.stores[store_name].lease_groups([(namespace, h) for h in page_hashes], members)
        lease.store = store_name
        return self._answer(store_name, lease, lease.ids, lease.loose, start)

    def _answer(self, store_name: str, lease: "tuple[str, list[str], list[StoredPage | None]] | GroupLease",
                ids: np.ndarray, loose: dict[int, StoredPage], start: float) -> PageViews:
        """Open `lease` (the expired ones end first) and describe its items: those in the memory
        tier's arena by slot id (-1: not there), the others (`loose`: pages outside the arena) by
        their bytes. `start`: when the lease was asked for (the fetch metric)."""
        self._expire_leases()
        lease_id, self._next_lease = self._next_lease, self._next_lease + 1
        self._leases[lease_id] = lease
        self._lease_started[lease_id] = time.monotonic()
        store = self.stores[store_name]
        n, held = len(ids), ids >= 0
        checksums, nbytes = np.zeros(n, np.uint64), np.full(n, -1, np.int64)
        segment_of, offsets = np.full(n, -1, np.int64), np.zeros(n, np.int64)
        arena = getattr(store.memory, "arena", None)
        if held.any():
            segment_of[held], offsets[held], nbytes[held] = arena.where(ids[held])
            checksums[held] = store.memory.checksums_of(ids[held])
        for i, page in loose.items():
            checksums[i], nbytes[i] = page.checksum, page.payload.nbytes
        segments = [] if arena is None else arena.segments
        out = PageViews(lease_id, checksums, segments, segment_of, offsets, nbytes,
                        {i: page.payload for i, page in loose.items()})
        if self.metrics is not None:
            self.metrics.observe_fetch(store_name, time.perf_counter() - start)
        return out

    def open_lease_stores(self) -> list[str]:
        """The store ("index" or "kv") of each open lease, oldest first."""
        return [lease.store if isinstance(lease, GroupLease) else lease[0] for lease in self._leases.values()]

    def renew_leases(self, lease_ids: Sequence[int]) -> int:
        """Restart the TTL clock of these leases (a reader that holds pages for longer than
        `lease_ttl_s`: an adopted session decoding for minutes) → how many were still held (an
        expired one is gone: its reader must not read its pages any more)."""
        now, held = time.monotonic(), 0
        for lease_id in lease_ids:
            if lease_id in self._lease_started:
                self._lease_started[lease_id] = now
                held += 1
        return held

    def lease_index_shared(self, model_key: str, page_hashes: Sequence[int]) -> SharedPageViews:
        """`lease_index` for a reader in another process on the node: where the pages lie in this
        shard's shared segment files (`shared_segments.py`), which the reader maps; held until
        `release_lease` (or `ServiceConfig.lease_ttl_s`). Needs `shared_index_arena`."""
        if self.shared_segments is None:
            raise ValueError(f"shard {self.shard_id}: lease_index_shared needs "
                             "ServiceConfig.shared_index_arena")
        views = self.lease_index(model_key, page_hashes)
        loose = {i: np.array(v) for i, v in views.loose.items()}  # copied: no file holds them
        return SharedPageViews(views.lease_id, views.checksums, str(self.shared_segments.directory),
                               list(self.shared_segments.names), views.segment_of, views.offsets,
                               views.nbytes, loose)

    def shared_arena_stores(self) -> frozenset[str]:
        """The stores a reader in another process can lease from (`lease_index_shared`)."""
        return frozenset({"index"}) if self.shared_segments is not None else frozenset()

    def release_lease(self, lease_id: int, corrupt: Sequence[int] = ()) -> None:
        """End a lease; `corrupt`: positions whose bytes failed the reader's check (dropped, counted).
        A lease the shard already ended (expired) is a no-op."""
        if lease_id not in self._leases:
            return
        self._lease_started.pop(lease_id, None)
        lease = self._leases.pop(lease_id)
        if isinstance(lease, GroupLease):
            self.stores[lease.store].release_groups(lease, corrupt)
        else:
            store_name, keys, pages = lease
            store = self.stores[store_name]
            for i in corrupt:
                if pages[i] is not None:
                    store.drop_corrupt(keys[i], pages[i])
            store.release(pages)
        self._publish()

    def _expire_leases(self) -> None:
        """End the leases older than `lease_ttl_s` (their readers died or forgot them)."""
        deadline = time.monotonic() - self.config.lease_ttl_s
        for lease_id in [i for i, started in self._lease_started.items() if started < deadline]:
            self.release_lease(lease_id)
            self.expired_leases += 1

    def _lease(self, store_name: str, keys: list[str]) -> PageViews:
        start = time.perf_counter()
        pages = self.stores[store_name].lease(keys)
        ids = np.fromiter((-1 if page is None or page.slot is None else page.slot.id for page in pages),
                          np.int64, len(pages))
        loose = {i: page for i, page in enumerate(pages) if page is not None and page.slot is None}
        return self._answer(store_name, (store_name, keys, pages), ids, loose, start)

    def get_kv_into(
        self, model_key: str, requests: Sequence[tuple[int, int]], dest: np.ndarray, rows: Sequence[int],
    ) -> list[bool]:
        """K+V payloads of (page hash, layer) pairs verified into rows `rows[i]` of `dest` [R, row
        bytes], a buffer of a caller in this process (a sparse-resident session's pinned host
        tier: no staging copy between the service and it). ok per request; bad rows are zeros."""
        keys = [kv_key(model_key, h, layer) for h, layer in requests]
        return self._read_into("kv", keys, dest, rows)

    def _read_into(
        self, store_name: str, keys: list[str], dest: np.ndarray, rows: Sequence[int]
    ) -> list[bool]:
        start = time.perf_counter()
        ok = self.stores[store_name].read_into(keys, dest, rows)
        if self.metrics is not None:
            self.metrics.observe_fetch(store_name, time.perf_counter() - start)
        self._publish()
        return ok

    def _get(self, store_name: str, keys: list[str]) -> list[Payload | None]:
        start = time.perf_counter()
        out = self.stores[store_name].get_many(keys)
        if self.metrics is not None:
            self.metrics.observe_fetch(store_name, time.perf_counter() - start)
        self._publish()
        return out

    # ---- sessions ----------------------------------------------------------------------------
    def session_put(self, record: SessionRecord) -> None:
        self.sessions.put(record)
        self._publish()

    def session_append(
        self, session_id: str, token_ids: list[int], page_hashes: list[int], sampling_state: dict | None,
        tail: tuple[int | None, int] | None = None,
    ) -> int:
        """Returns the session's token count after the append."""
        return len(self.sessions.append(session_id, token_ids, page_hashes, sampling_state, tail).token_ids)

    def session_get(self, session_id: str) -> SessionRecord:
        return self.sessions.get(session_id)

    def session_head(self, session_id: str) -> SessionRecord:
        """The record without its token ids (tokens_omitted=True): page hashes, tail, state."""
        return dataclasses.replace(self.sessions.get(session_id), token_ids=[], tokens_omitted=True)

    def session_tokens(self, session_id: str) -> np.ndarray:
        """The session's token ids as one int64 array (a copy: callers in this process may keep it)."""
        return self.sessions.tokens(session_id).copy()

    def session_set_pinned(self, session_id: str, pinned: bool) -> SessionRecord:
        return self.sessions.set_pinned(session_id, pinned)

    def session_unpin_idle(self, model_key: str, older_than: float) -> list[SessionRecord]:
        return self.sessions.unpin_idle(older_than, model_key)

    def session_delete(self, session_id: str) -> SessionRecord | None:
        record = self.sessions.delete(session_id)
        self._publish()
        return record

    def session_list(self) -> list[str]:
        return self.sessions.session_ids()

    # ---- observability -----------------------------------------------------------------------
    def stats(self) -> dict[str, object]:
        out: dict[str, object] = {"shard": self.shard_id, "sessions": len(self.sessions),
                                  "session_corruptions": self.sessions.corruptions,
                                  "session_evictions": self.sessions.evictions}
        for name, store in self.stores.items():
            out[name] = {
                **store.stats.as_dict(),
                "memory_bytes": store.memory.bytes_used, "memory_capacity": store.memory.capacity_bytes,
                "memory_pages": len(store.memory),
                "disk_bytes": store.disk.bytes_used if store.disk else 0,
                "disk_capacity": store.disk.capacity_bytes if store.disk else 0,
                "disk_pages": len(store.disk) if store.disk else 0,
            }
            arena = getattr(store.memory, "arena", None)
            if arena is not None:  # page memory: segments reserved, slots a reader still holds
                out[name].update(arena_reserved_bytes=arena.stats.reserved_bytes,
                                 arena_segments=arena.stats.segments,
                                 arena_retired_slots=arena.stats.retired_slots,
                                 arena_failed_segments=arena.stats.failed_segments)
        out["open_leases"] = len(self._leases)
        out["expired_leases"] = self.expired_leases
        return out

    def ping(self) -> int:
        return self.shard_id

    def _publish(self) -> None:
        if self.metrics is None:
            return
        for name, store in self.stores.items():
            self.metrics.publish(name, store)
        self.metrics.publish_sessions(len(self.sessions), self.sessions.corruptions)


@functools.cache
def actor_class():
    """KVCacheShard as a Ray actor class (Ray is imported only when the service runs on it).
    Shards are I/O- and memcpy-bound: no CPU reservation, so they co-locate with anything."""
    import ray

    return ray.remote(num_cpus=0)(KVCacheShard)
