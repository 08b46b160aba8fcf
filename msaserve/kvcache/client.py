"""What a replica holds to talk to the service: routes by hash, batches one call per shard.

Every method that touches several pages groups them by shard, sends one call per shard (all in
flight at once) and scatters the replies back into request order. Through Ray, reads come back
as read-only uint8 arrays mapped from the object store.

    shards = start_shards(ServiceConfig(num_shards=4, disk_path="/kv", disk_bytes=1 << 40))
    client = KVCacheClient(shards, model_identity)          # or KVCacheClient.connect(config, model)
    client.put_pages([(page_hash, kv_payload_per_layer, index_payload)])
    index = client.get_index(page_hashes)                   # adoption: the whole index first
    kv = client.get_kv([(page_hash, layer), ...])           # then the selected pages, per layer

Without Ray: `KVCacheClient.in_process(config, model)` runs the shards in this process.
"""

import contextlib
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from msaserve.kvcache.arena import SegmentAllocator
from msaserve.kvcache.codec import Payload, copy_rows
from msaserve.kvcache.config import ServiceConfig
from msaserve.kvcache.keys import ModelIdentity, shard_of_page, shard_of_session, shards_of_pages
from msaserve.kvcache.leases import LeaseFetch, PageLease
from msaserve.kvcache.session_records import SessionRecord
from msaserve.kvcache.shard import KVCacheShard, PageUpload
from msaserve.kvcache.store import CapacityError
from msaserve.kvcache.transport import LocalTransport, RayTransport, ServiceUnavailable, Transport

__all__ = [
    "CapacityError", "KVCacheClient", "LeaseFetch", "PackedFetch", "PageLease", "PendingFetch",
    "PendingReply", "RowsFetch", "ServiceUnavailable", "start_shards",
]


def start_shards(config: ServiceConfig, detached: bool = False) -> list[Any]:
    """Create the shard actors, or get them if they already run (names come from the config).
    detached=True lets them outlive the creating process (a Serve app's KV cache tier)."""
    import ray

    from msaserve.kvcache.shard import actor_class

    options: dict[str, Any] = {"namespace": config.namespace, "get_if_exists": True}
    if detached:
        options["lifetime"] = "detached"
    # A shard that dies is restarted by Ray; with a disk tier it comes back with its pages.
    shards = [
        actor_class().options(name=config.actor_name(i), max_restarts=3, **options).remote(config, i)
        for i in range(config.num_shards)
    ]
    ray.get([s.ping.remote() for s in shards])  # fail here, not on first use
    return shards


class PendingFetch:
    """Reads in flight (a background prefetch); `result()` waits and returns them in order."""

    def __init__(self, transport: Transport, futures: list[tuple[Any, list[int]]], size: int) -> None:
        self._transport, self._futures, self._size = transport, futures, size

    def done(self) -> bool:
        return self._transport.all_done([f for f, _ in self._futures])

    def replies(self, timeout_s: float | None = None) -> list[Any]:
        """One reply per shard called (for calls that return no per-item values)."""
        return self._transport.gather([f for f, _ in self._futures], timeout_s)

    def result(self, timeout_s: float | None = None) -> list[Any]:
        """The per-item replies, in request order."""
        out: list[Any] = [None] * self._size
        replies = self.replies(timeout_s)
        for (_, positions), reply in zip(self._futures, replies, strict=True):
            for pos, value in zip(positions, reply, strict=True):
                out[pos] = value
        return out


class PendingReply:
    """One call in flight; `result()` waits and returns its reply."""

    def __init__(self, transport: Transport, future: Any) -> None:
        self._transport, self._future = transport, future

    def done(self) -> bool:
        return self._transport.all_done([self._future])

    def result(self, timeout_s: float | None = None) -> Any:
        return self._transport.gather([self._future], timeout_s)[0]


class PackedFetch(PendingFetch):
    """Packed reads in flight. Each shard's items fill consecutive rows of `out` (shard by shard):
    `rows[i]` is the row of request item i. `result()` waits until every row is written and
    returns, per item in request order, whether the service had a valid copy."""

    def __init__(self, transport: Transport, futures: list[tuple[Any, list[int]]], size: int,
                 out: np.ndarray, segments: list[slice]) -> None:
        super().__init__(transport, futures, size)
        self.out, self._segments = out, segments
        self.rows = np.empty(size, dtype=np.int64)
        for (_, positions), segment in zip(futures, segments, strict=True):
            self.rows[positions] = np.arange(segment.start, segment.stop)
        self.items = np.empty(size, dtype=np.int64)
        """The request item in each row (the inverse of `rows`)."""
        self.items[self.rows] = np.arange(size)

    def result(self, timeout_s: float | None = None) -> list[bool]:  # type: ignore[override]
        ok = [False] * self._size
        copies = []
        replies = zip(self._futures, self._segments, self.replies(timeout_s), strict=True)
        for (_, positions), segment, (packed, flags) in replies:
            if packed is not None:  # a shard in another process: its rows come back as one array
                copies.append((packed, self.out[segment]))
            for pos, flag in zip(positions, flags, strict=True):
                ok[pos] = flag
        copy_rows(copies)
        return ok


class RowsFetch(PendingFetch):
    """Reads in flight into chosen rows of the caller's buffer (`get_kv_into_async`). `result()`
    waits until every row is written and returns, per item in request order, whether the
    service had a valid copy (a bad item's row is zeros)."""

    def __init__(self, transport: Transport, futures: list[tuple[Any, list[int]]], size: int,
                 dest: np.ndarray, rows: np.ndarray) -> None:
        super().__init__(transport, futures, size)
        self._dest, self._rows = dest, rows

    def result(self, timeout_s: float | None = None) -> list[bool]:  # type: ignore[override]
        ok = [False] * self._size
        for (_, positions), reply in zip(self._futures, self.replies(timeout_s), strict=True):
            if isinstance(reply, tuple):  # a shard in another process: its rows as one array
                packed, flags = reply
                self._dest[self._rows[positions]] = packed
            else:
                flags = reply
            for pos, flag in zip(positions, flags, strict=True):
                ok[pos] = flag
        return ok


class KVCacheClient:
    def __init__(
        self, shards: Sequence[Any], model: ModelIdentity, transport: Transport | None = None
    ) -> None:
        """shards: Ray actor handles (default transport) or, with a LocalTransport, KVCacheShards."""
        if not shards:
            raise ValueError("KVCacheClient needs at least one shard")
        self.shards = list(shards)
        self.model = model
        self.model_key = model.key
        self.transport = transport or RayTransport()
        self._shared_arena_stores: frozenset[str] | None = None

    @classmethod
    def connect(cls, config: ServiceConfig, model: ModelIdentity) -> "KVCacheClient":
        """Attach to running shards by name (how a model replica finds the service)."""
        import ray

        shards = [
            ray.get_actor(config.actor_name(i), namespace=config.namespace) for i in range(config.num_shards)
        ]
        return cls(shards, model)

    @classmethod
    def in_process(cls, config: ServiceConfig, model: ModelIdentity,
                   segment_allocators: Mapping[str, SegmentAllocator] | None = None) -> "KVCacheClient":
        """Shards in this process, one thread each (no Ray, no metrics). segment_allocators: store
        name → allocator of its memory arena's segments (`KVCacheShard`; pinned memory makes
        `lease_index_async` pages copyable straight to a GPU)."""
        shards = [KVCacheShard(config, i, publish_metrics=False, segment_allocators=segment_allocators)
                  for i in range(config.num_shards)]
        return cls(shards, model, LocalTransport(shards))

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    # ---- pages -------------------------------------------------------------------------------
    def put_pages(self, pages: Sequence[PageUpload], pin: bool = False) -> int:
        """Store pages (K+V per layer and/or index-K); returns the bytes stored."""
        return sum(self._per_shard("put_pages", [p[0] for p in pages], list(pages), pin).replies())

    def get_kv(self, requests: Sequence[tuple[int, int]]) -> list[Payload | None]:
        """K+V payload per (page hash, layer); None where the service has no valid copy."""
        return self.get_kv_async(requests).result()

    def get_kv_async(self, requests: Sequence[tuple[int, int]]) -> PendingFetch:
        return self._per_shard("get_kv", [h for h, _ in requests], list(requests))

    def get_index(self, page_hashes: Sequence[int]) -> list[Payload | None]:
        """Index-K payload (all layers) per page; None where missing or corrupt."""
        return self.get_index_async(page_hashes).result()

    def get_index_async(self, page_hashes: Sequence[int]) -> PendingFetch:
        return self._per_shard("get_index", list(page_hashes), list(page_hashes))

    def get_index_packed_async(self, page_hashes: Sequence[int], out: np.ndarray) -> PackedFetch:
        """Index payloads, verified, into the rows of out [n, index payload bytes] (page i in row
        `fetch.rows[i]`); the bulk path of adoption. Leave `out` alone until `result()` returned."""
        hashes = list(page_hashes)
        return self._packed("get_index_packed", hashes, hashes, out)

    def arena_stores(self) -> frozenset[str]:
        """The stores ("index", "kv") whose pages every shard keeps in an arena this process can
        read in place: shards in this process (leased pages then lie in segments the caller
        allocated, e.g. pinned memory), or shards in other processes whose shared segment files it
        maps (`shared_arena_stores`)."""
        if not self.transport.shares_memory:
            return self.shared_arena_stores()
        return frozenset.intersection(*(frozenset(getattr(s, "arena_stores", ())) for s in self.shards))

    def shared_arena_stores(self) -> frozenset[str]:
        """The stores every shard offers to readers in other processes (`lease_index_shared`:
        ServiceConfig.shared_index_arena), asked once."""
        if self._shared_arena_stores is None:
            try:
                answers = self._every_shard("shared_arena_stores")
            except Exception:  # shards from before the method: none offered
                answers = [frozenset()]
            self._shared_arena_stores = frozenset.intersection(*map(frozenset, answers))
        return self._shared_arena_stores

    def forget_shared_arenas(self) -> None:
        """Stop leasing from shards in other processes (their files could not be mapped here: the
        shards run on another node); packed reads from then on."""
        self._shared_arena_stores = frozenset()

    def lease_index_async(self, page_hashes: Sequence[int]) -> LeaseFetch:
        """Zero-copy index reads (`leases.py`): the shards' stored pages themselves, unverified —
        the reader checks each against its checksum and must `release()` the lease. Shards in this
        process answer with views of their memory; shards in other processes on the node with
        where the pages lie in their shared segment files, which this process maps
        (`shared_arena_stores`); others answer only `get_index_packed_async`."""
        shared = self.transport.shares_memory
        if not shared and "index" not in self.shared_arena_stores():
            raise ValueError("lease_index_async needs shards in this process (transport.shares_memory) or "
                             "shards offering shared index arenas (ServiceConfig.shared_index_arena); "
                             "others answer get_index_packed_async")
        method = "lease_index" if shared else "lease_index_shared"
        hashes = list(page_hashes)
        futures = [(s, pos, self.transport.submit(self.shards[s], method, self.model_key,
                                                  [hashes[i] for i in pos]))
                   for s, pos in self._by_shard(hashes).items()]
        return LeaseFetch(self.transport, self.shards, len(hashes), futures)

    def lease_kv_async(self, page_hashes: Sequence[int]) -> LeaseFetch:
        """Zero-copy K+V reads of every layer of these pages from shards in this process
        (`leases.py`; item i · num_layers + layer): the stored pages themselves, unverified, held
        unchanged until `release()` (renew with `PageLease.renew` within `lease_ttl_s`); the reader
        checks each against its checksum before it trusts it. Shards in other processes answer
        only `get_kv_into_async`."""
        if not self.transport.shares_memory:
            raise ValueError("lease_kv_async needs shards in this process (transport.shares_memory); "
                             "others answer get_kv_into_async")
        hashes, layers = list(page_hashes), self.model.num_layers
        futures = []
        for s, pos in self._by_shard(hashes).items():
            mine = [hashes[i] for i in pos]  # (before the items: the shard starts at once)
            future = self.transport.submit(self.shards[s], "lease_kv", self.model_key, mine, layers)
            items = (np.asarray(pos, np.int64)[:, None] * layers + np.arange(layers)).reshape(-1)
            futures.append((s, items, future))
        return LeaseFetch(self.transport, self.shards, len(hashes) * layers, futures)

    def get_kv_packed_async(self, requests: Sequence[tuple[int, int]], out: np.ndarray) -> PackedFetch:
        """K+V payloads of (page hash, layer) pairs into the rows of out, as `get_index_packed_async`."""
        return self._packed("get_kv_packed", [h for h, _ in requests], list(requests), out)

    def get_kv_into_async(self, requests: Sequence[tuple[int, int]], dest: np.ndarray,
                          rows: Sequence[int]) -> RowsFetch:
        """K+V payloads of (page hash, layer) pairs, verified, into rows `rows[i]` of dest [R, K+V
        payload bytes] (uint8, C-contiguous): shards in this process write them there (no
        staging copy), others return packed rows that `result()` scatters. Leave those rows
        alone until `result()` returned."""
        if dest.ndim != 2 or dest.dtype != np.uint8 or not dest.flags.c_contiguous:
            raise ValueError(f"dest must be a C-contiguous uint8 array [rows, row bytes], got {dest.dtype} "
                             f"{tuple(dest.shape)}")
        rows_ = np.asarray(rows, dtype=np.int64)
        if len(rows_) != len(requests) or (len(rows_) and not 0 <= rows_.min() <= rows_.max() < len(dest)):
            raise ValueError(f"rows must give each of the {len(requests)} requests a row of dest "
                             f"(0..{len(dest) - 1}), got {len(rows_)} rows")
        shared, items = self.transport.shares_memory, list(requests)
        futures = []
        for s, pos in self._by_shard([h for h, _ in items]).items():
            mine = [items[i] for i in pos]
            if shared:
                call = self.transport.submit(self.shards[s], "get_kv_into", self.model_key, mine, dest,
                                             rows_[pos].tolist())
            else:
                call = self.transport.submit(self.shards[s], "get_kv_packed", self.model_key, mine,
                                             dest.shape[1])
            futures.append((call, pos))
        return RowsFetch(self.transport, futures, len(items), dest, rows_)

    def has_pages(self, page_hashes: Sequence[int]) -> list[bool]:
        """Whether the service holds each page completely (index-K and every layer's K+V)."""
        hashes = list(page_hashes)
        return self._per_shard("has_pages", hashes, hashes, self.model.num_layers).result()

    def delete_pages(self, page_hashes: Sequence[int]) -> None:
        """Remove pages from the service (e.g. a superseded session tail)."""
        hashes = list(page_hashes)
        self._per_shard("delete_pages", hashes, hashes, self.model.num_layers).replies()

    def pin_pages(self, page_hashes: Sequence[int], pin: bool = True) -> None:
        """Take (or with pin=False release) one pin per page: pinned pages are never evicted."""
        hashes = list(page_hashes)
        self._per_shard("pin_pages", hashes, hashes, self.model.num_layers, pin).replies()

    # ---- sessions ----------------------------------------------------------------------------
    def put_session(self, record: SessionRecord) -> None:
        """Create or replace a session record (its pages must be put separately)."""
        self.model.check_compatible(record.model, f"session {record.session_id!r}")
        self._session_call(record.session_id, "session_put", record)
        if record.pinned:
            self.pin_pages(record.page_hashes)

    def append_session(
        self, session_id: str, token_ids: Sequence[int], page_hashes: Sequence[int],
        sampling_state: dict | None = None, tail: tuple[int | None, int] | None = None,
    ) -> int:
        """Record new tokens and newly filled pages (put their payloads, and pin them for a pinned
        session, first); tail = (hash, tokens) of a newly stored partial last page. Returns the
        session's token count."""
        return self._session_call(
            session_id, "session_append", session_id, list(token_ids), list(page_hashes), sampling_state, tail
        )

    def get_session(self, session_id: str) -> SessionRecord:
        """The record; raises SessionNotFound, or IncompatibleModel if another model wrote it.
        Its token ids travel as one int64 array (a list of a million ints pickles and unpickles
        in tens of ms), fetched beside the rest of the record."""
        tokens = self.get_session_tokens_async(session_id)
        try:
            record = self.get_session_head(session_id)
        except BaseException:
            with contextlib.suppress(Exception):  # the same error: collect it (Ray warns otherwise)
                tokens.result()
            raise
        record.token_ids, record.tokens_omitted = tokens.result().tolist(), False
        return record

    def get_session_head(self, session_id: str) -> SessionRecord:
        """The record without its token ids (token_ids empty, tokens_omitted=True): what adoption
        needs to start loading the index. Raises like `get_session`."""
        record = self._session_call(session_id, "session_head", session_id)
        self.model.check_compatible(record.model, f"session {session_id!r}")
        return record

    def get_session_tokens_async(self, session_id: str) -> "PendingReply":
        """The session's token ids, as an int64 array, read in the background."""
        shard = self.shards[shard_of_session(session_id, self.num_shards)]
        return PendingReply(self.transport, self.transport.submit(shard, "session_tokens", session_id))

    def delete_session(self, session_id: str) -> bool:
        """Forget a session (True if the service held it). Its pages stay (other sessions may share
        them) but lose its pins; its partial tail page, its alone, goes."""
        record = self._session_call(session_id, "session_delete", session_id)
        if record is not None and record.model == self.model:
            if record.pinned:
                self.pin_pages(record.page_hashes, pin=False)
            if record.tail_hash is not None:  # the tail is this session's alone
                self.delete_pages([record.tail_hash])
        return record is not None

    def list_sessions(self) -> list[str]:
        return sorted(s for ids in self._every_shard("session_list") for s in ids)

    def set_session_pinned(self, session_id: str, pinned: bool) -> None:
        """Pin a live session's pages (never evicted) or release them to LRU eviction."""
        record = self._session_call(session_id, "session_head", session_id)
        if record.pinned != pinned:
            self._session_call(session_id, "session_set_pinned", session_id, pinned)
            if record.model == self.model:
                self.pin_pages(record.page_hashes, pin=pinned)

    def restore_pins(self) -> int:
        """After a service restart, re-take the page pins of this model's pinned sessions (pins
        live in shard memory; the pinned flag is on disk). Returns the sessions re-pinned."""
        count = 0
        for session_id in self.list_sessions():
            record = self._session_call(session_id, "session_head", session_id)
            if record.pinned and record.model == self.model:
                self.pin_pages(record.page_hashes)
                count += 1
        return count

    def unpin_idle_sessions(self, idle_s: float) -> int:
        """Release the pins of this model's sessions not updated for idle_s seconds: their records
        and pages become evictable (LRU) like any other; a session that comes back re-pins what is
        still held (`SessionWriter`) and recomputes what was evicted. Returns the sessions unpinned."""
        older_than = time.time() - idle_s
        replies = self._every_shard("session_unpin_idle", self.model_key, older_than)
        records = [record for reply in replies for record in reply]
        hashes = [h for record in records for h in record.page_hashes]
        if hashes:
            self.pin_pages(hashes, pin=False)
        return len(records)

    def stats(self) -> list[dict]:
        return self._every_shard("stats")

    # ---- routing -----------------------------------------------------------------------------
    def _session_call(self, session_id: str, method: str, *args: Any) -> Any:
        shard = self.shards[shard_of_session(session_id, self.num_shards)]
        return self.transport.gather([self.transport.submit(shard, method, *args)])[0]

    def _every_shard(self, method: str, *args: Any) -> list[Any]:
        return self.transport.gather([self.transport.submit(s, method, *args) for s in self.shards])

    def _packed(self, method: str, hashes: list[int], items: list, out: np.ndarray) -> PackedFetch:
        """`_per_shard` for packed reads: each shard gets a consecutive block of `out`'s rows; a
        shard in this process writes it directly, others return it as one array, copied into
        place by `result()`."""
        if out.ndim != 2 or out.shape[0] != len(items) or out.dtype != np.uint8:
            raise ValueError(f"out must be a uint8 array [{len(items)}, row bytes], "
                             f"got {out.dtype} {tuple(out.shape)}")
        shared = self.transport.shares_memory
        futures, segments, first = [], [], 0
        for s, pos in self._by_shard(hashes).items():
            segment = slice(first, first + len(pos))
            first = segment.stop
            call = self.transport.submit(self.shards[s], method, self.model_key, [items[i] for i in pos],
                                         out.shape[1], out[segment] if shared else None)
            futures.append((call, pos))
            segments.append(segment)
        return PackedFetch(self.transport, futures, len(items), out, segments)

    def _per_shard(self, method: str, hashes: list[int], items: list, *args: Any) -> PendingFetch:
        """Call `method(model_key, items of this shard, *args)` on every shard holding one of the
        hashes (hashes[i] routes items[i])."""
        submit = self.transport.submit
        futures = [
            (submit(self.shards[s], method, self.model_key, [items[i] for i in pos], *args), pos)
            for s, pos in self._by_shard(hashes).items()
        ]
        return PendingFetch(self.transport, futures, len(items))

    def _by_shard(self, hashes: list[int]) -> dict[int, list[int]]:
        """Shard → positions of the hashes it holds."""
        num_shards = len(self.shards)
        if len(hashes) < 256:
            groups: dict[int, list[int]] = defaultdict(list)
            for i, h in enumerate(hashes):
                groups[shard_of_page(h, num_shards)].append(i)
            return groups
        shards = shards_of_pages(hashes, num_shards)  # vectorised (a 1M-token index is 8,192 pages)
        order = np.argsort(shards, kind="stable")
        found, starts = np.unique(shards[order], return_index=True)
        ends = [*starts[1:], len(order)]
        groups = {int(s): order[a:b].tolist() for s, a, b in zip(found, starts, ends, strict=True)}
        return dict(sorted(groups.items(), key=lambda kv: kv[1][0]))  # in order of first appearance
