"""Adopting a session on a replica that has never seen it: the index first, K/V on demand.

1. `load_index` fetches the index-K of every stored page (all layers) into the caches; decode can
   select blocks from then on. From shards in this process it copies the stored pages to the
   device directly, verified beside the copy (`direct_index.py`); from other processes it reads
   packed (`load_packed`): verified pages written into pinned upload buffers, copied to the device
   while later groups are read. Pages after the first missing or corrupt index page are not
   adopted: the caller recomputes them from the record's token ids (never serving a bad page). The stored
   partial tail page, if any, also gets its K/V now: new tokens are written into it, so it must be
   resident before they are (a lazy import later would overwrite them).
2. Each step, the wrapped indexer ops (`wrap_ops`) learn which pages layer l selected and fetch
   the K+V of those not yet resident, for layer l only, before attention reads them. The
   selection always contains the `n_local` pages ending at the query's page and, when `n_init > 0`,
   the init pages (docs/design.md §2), so these come too.
3. `prefetch` keeps a bounded number of background reads in flight for the rest, and `poll`
   imports the ones that arrived, so lazily fetched steps become rare and then stop. They go in
   predicted order, not page order: first the pages the previous step selected in any layer
   (most-selected first) for every layer still missing them — decode selections move little
   between steps, and pages selected by one layer (recent pages, sinks) tend to be selected by
   the others — then the newest pages.

One fetcher serves one sequence: its block table is row 0 of the step's metadata.
"""

import collections
import contextlib
import dataclasses
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from msaserve.engine.kv import staging
from msaserve.engine.kv.direct_index import ReleaseStart, index_to_device, load_index_leased
from msaserve.engine.kv.pages import PageCodec
from msaserve.kernels import AttentionOps
from msaserve.kvcache.client import KVCacheClient, PackedFetch, PendingFetch, ServiceUnavailable
from msaserve.kvcache.session_records import SessionRecord
from msaserve.models.cache import LayerKVCache
from msaserve.models.metadata import AttentionMetadata

INDEX_GROUP_PAGES = 512
"""Pages per index read while adopting (32 MiB at the M3 shape with 2 layers)."""

PackedUnit = tuple[int, int, Callable[[np.ndarray], PackedFetch]]
"""One read of a bulk load: (row bytes, rows, start(out [rows, row bytes]) → its PackedFetch)."""

logger = logging.getLogger(__name__)


def load_packed(ring: staging.UploadRing, units: Sequence[PackedUnit], depth: int = 2
                ) -> Iterator[tuple[int, list[bool], Callable[[int], tuple[torch.Tensor, torch.Tensor]]]]:
    """Run the units' packed reads into the ring's buffers, up to `depth` reads ahead of the one
    handed out. Yields (unit index, ok per item, rows(n)) in order; rows(n) copies the buffer to
    the device (once) and returns (chunk [m, row bytes], items [m]): the rows holding items
    0..n-1 and the item each holds (all rows, in buffer order, without a gather when n is every
    item). The caller holds `ring.lock`; close the generator (or run it to the end) before
    releasing it: every read started is awaited then, since in-process shards write into the
    buffers until their call returns."""
    started: deque[tuple[int, int, PackedFetch]] = deque()
    following = iter(range(len(units)))

    def begin() -> None:
        i = next(following, None)
        if i is not None:
            row_bytes, rows, start = units[i]
            slot, host = ring.acquire(rows, row_bytes)
            started.append((i, slot, start(host)))

    def on_device(slot: int, row_bytes: int, fetch: PackedFetch
                  ) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
        uploaded: list[torch.Tensor] = []

        def rows(n: int) -> tuple[torch.Tensor, torch.Tensor]:
            if not uploaded:
                uploaded.append(ring.upload(slot, len(fetch.items), row_bytes))
            chunk, device = uploaded[0], uploaded[0].device
            if n == len(fetch.items):
                return chunk, index_to_device(fetch.items, device)
            keep = np.flatnonzero(fetch.items < n)
            kept = chunk.index_select(0, index_to_device(keep, device))
            return kept, index_to_device(fetch.items[keep], device)

        return rows

    try:
        for _ in range(depth + 1):
            begin()
        while started:
            i, slot, fetch = started.popleft()
            ok = fetch.result()
            yield i, ok, on_device(slot, units[i][0], fetch)
            begin()
    finally:
        for _, _, fetch in started:  # an early exit: wait until no shard writes into the buffers
            with contextlib.suppress(Exception):  # the error that ended the load is already raised
                fetch.result()


class PageLost(RuntimeError):
    """A page the session needs is missing or corrupt in the service: recompute from tokens."""


@dataclasses.dataclass
class AdoptionStats:
    index_bytes: int = 0
    kv_bytes_on_demand: int = 0
    kv_bytes_prefetched: int = 0
    kv_pages_on_demand: int = 0
    on_demand_fetches: int = 0
    on_demand_seconds: float = 0.0
    index_seconds: float = 0.0


class LazyPageFetcher:
    def __init__(
        self,
        client: KVCacheClient,
        record: SessionRecord,
        caches: Sequence[LayerKVCache],
        block_table: Sequence[int],
        kv_block_table: Sequence[int] | None = None,
        dense_layers: Sequence[int] = (),
    ) -> None:
        """block_table: logical → physical page for this sequence, covering every stored page;
        kv_block_table: where the K/V of each page goes when not at block_table's page (a
        sparse-resident session's K/V pool, `resident_session.py`), except in `dense_layers`
        (layers that attend densely keep their K/V at block_table's page)."""
        self.client, self.record, self.caches = client, record, list(caches)
        self.codec = PageCodec(client.model)
        self.block_table = list(block_table)
        self.kv_block_table = None if kv_block_table is None else list(kv_block_table)
        self.dense_layers = frozenset(dense_layers)
        # Logical page i is stored under hashes[i]: the full pages, then the partial tail if any.
        self.hashes = list(record.page_hashes) + ([record.tail_hash] if record.tail_hash is not None else [])
        self.num_pages = 0  # adopted pages (set by load_index)
        self.release_later: list[ReleaseStart] | None = None
        """None: the index load ends its leases itself. A list (set before `load_index`): the load
        appends its leases' release starts there, for the caller to call (`ResidentSession.adopt`
        asks for its K/V lease first, so the shards answer that before they release the index)."""
        self.resident = torch.zeros(len(caches), 0, dtype=torch.bool)  # [L, num_pages]
        self._layer_of = {c.index_cache.data_ptr(): layer for layer, c in enumerate(caches)}
        self._pending: list[tuple[PendingFetch, list[tuple[int, int]]]] = []
        self.stats = AdoptionStats()
        self.last_selected: dict[int, list[int]] = {}
        """layer → the adopted pages it selected in its latest step."""
        self.prefetch_log: list[list[tuple[int, int]]] = []
        """(page, layer) items of each background read, in the order they started (the latest 1,000)."""

    # ---- 1. the index ------------------------------------------------------------------------
    def load_index(self) -> int:
        """Load the index of every stored page; returns the number of tokens now covered
        (adopted pages × page size); the caller prefills the rest of the record's tokens.

        Shards in this process lease their pages and the device copies them straight from the
        service's memory while a thread pool verifies the same bytes (`direct_index.py`). Shards in
        other processes answer packed reads, in groups of up to INDEX_GROUP_PAGES (one upload buffer
        each) with the next groups' reads in flight while one is copied to the device and scattered
        (`load_packed`). Either way only the verified prefix is imported."""
        start = time.perf_counter()
        device = self.caches[0].index_cache.device
        # Straight from the shards' memory where this process can read it in place: shards in this
        # process (on CUDA only from arenas: pinned segments; plain pages would each need a
        # pageable copy, and packed reads are faster then), or shards in other processes on the
        # node whose index arenas are shared segment files this process maps. A shard on another
        # node has files this process cannot map: packed reads then, from here on.
        in_process = self.client.transport.shares_memory
        if "index" in self.client.arena_stores() or (in_process and device.type != "cuda"):
            try:
                usable = self._load_index_leased()
            except OSError as error:
                logger.warning("index pages not leasable from this process (%s); packed reads instead", error)
                self.client.forget_shared_arenas()
                usable = self._load_index_packed()
        else:
            usable = self._load_index_packed()
        self.num_pages = usable
        self.resident = torch.zeros(len(self.caches), usable, dtype=torch.bool)
        self.stats.index_seconds = time.perf_counter() - start
        num_full = len(self.record.page_hashes)
        if usable > num_full:  # the tail page came too
            # Its K/V now, for every layer: it is the page the next tokens are written into, and a
            # later lazy import would overwrite them (it is also always selected, being local).
            try:
                self.ensure_all_layers(num_full)
            except PageLost:
                self.num_pages = num_full  # recompute the tail's tokens instead
                return num_full * self.record.page_size
            return num_full * self.record.page_size + self.record.tail_tokens
        return usable * self.record.page_size

    def _load_index_leased(self) -> int:
        """`direct_index.load_index_leased`: copied from the shards' memory, verified beside the copy."""
        device = self.caches[0].index_cache.device
        physical = torch.as_tensor(self.block_table[: len(self.hashes)], dtype=torch.long, device=device)
        usable = load_index_leased(self.client, self.hashes, self.codec, self.caches, physical,
                                   release_later=self.release_later)
        self.stats.index_bytes += usable * (self.codec.index_bytes + self.codec.scale_bytes)
        return usable

    def _load_index_packed(self) -> int:
        """Packed reads into the upload ring (shards in other processes): see `load_index`."""
        device = self.caches[0].index_cache.device
        row_bytes = self.codec.index_bytes + self.codec.scale_bytes
        ring = staging.ring_for(device)
        usable = 0
        with ring.lock:
            size = max(1, min(INDEX_GROUP_PAGES, ring.rows_per_buffer(row_bytes)))
            groups = [range(i, min(i + size, len(self.hashes))) for i in range(0, len(self.hashes), size)]
            units: list[PackedUnit] = [
                (row_bytes, len(r), lambda out, r=r: self.client.get_index_packed_async(
                    [self.hashes[p] for p in r], out)) for r in groups
            ]
            physical = torch.as_tensor(self.block_table[: len(self.hashes)], dtype=torch.long, device=device)
            try:
                with contextlib.closing(load_packed(ring, units)) as loads:
                    for i, ok, upload in loads:
                        pages = groups[i]
                        intact = next((k for k, good in enumerate(ok) if not good), len(ok))
                        if intact:
                            chunk, items = upload(intact)
                            self.codec.scatter_index(self.caches, physical[pages.start + items], chunk)
                        usable += intact
                        self.stats.index_bytes += intact * row_bytes
                        if intact < len(ok):
                            break  # the first missing or corrupt page: the caller recomputes from here
            except ServiceUnavailable:
                pass  # keep the pages already imported (verified); the caller recomputes the rest
        return usable

    def ensure_all_layers(self, logical_page: int) -> None:
        """Make one adopted page's K/V resident in every layer (one batched read)."""
        layers = [layer for layer in range(len(self.caches)) if not self.resident[layer, logical_page]]
        try:
            payloads = self.client.get_kv([(self.hashes[logical_page], layer) for layer in layers])
        except ServiceUnavailable as e:
            raise PageLost(f"session {self.record.session_id!r}: {e}") from e
        if any(p is None for p in payloads):
            raise PageLost(f"session {self.record.session_id!r}: K/V of page {logical_page} is missing or "
                           "corrupt in the KV cache service")
        for layer, payload in zip(layers, payloads, strict=True):
            placed = self.kv_block_table is not None and layer not in self.dense_layers
            physical = (self.kv_block_table if placed else self.block_table)[logical_page]
            self.codec.import_kv(self.caches[layer], [physical], [payload])
            self.resident[layer, logical_page] = True
        self.stats.kv_pages_on_demand += len(layers)
        self.stats.kv_bytes_on_demand += sum(p.nbytes for p in payloads)

    # ---- 2. on demand ------------------------------------------------------------------------
    def ensure(self, layer: int, logical_pages: Sequence[int]) -> None:
        """Make the K+V of these adopted pages resident in `layer` (fetching what is missing)."""
        selected = sorted({p for p in logical_pages if 0 <= p < self.num_pages})
        self.last_selected[layer] = selected
        need = [p for p in selected if not self.resident[layer, p]]
        if not need:
            return
        start = time.perf_counter()
        try:
            payloads = self.client.get_kv([(self.hashes[p], layer) for p in need])
        except ServiceUnavailable as e:
            raise PageLost(f"session {self.record.session_id!r}: {e}") from e
        lost = [p for p, payload in zip(need, payloads, strict=True) if payload is None]
        if lost:
            raise PageLost(f"session {self.record.session_id!r}: K/V of pages {lost} in layer {layer} "
                           "are missing or corrupt in the KV cache service")
        self.codec.import_kv(self.caches[layer], [self.block_table[p] for p in need], payloads)
        self.resident[layer, need] = True
        self.stats.on_demand_fetches += 1
        self.stats.kv_pages_on_demand += len(need)
        self.stats.kv_bytes_on_demand += sum(p.nbytes for p in payloads)
        self.stats.on_demand_seconds += time.perf_counter() - start

    def wrap_ops(self, ops: AttentionOps) -> AttentionOps:
        """The same ops, whose indexers fetch the selected pages of their layer before returning."""

        def fetching(indexer):
            def run(q_index, index_cache, block_tables, *args, **kwargs):
                selected = indexer(q_index, index_cache, block_tables, *args, **kwargs)
                layer = self._layer_of.get(index_cache.data_ptr())
                if layer is not None:
                    self.ensure(layer, torch.unique(selected[selected >= 0]).tolist())
                return selected

            return run

        return dataclasses.replace(
            ops, indexer_decode=fetching(ops.indexer_decode), indexer_prefill=fetching(ops.indexer_prefill)
        )

    # ---- 3. background -----------------------------------------------------------------------
    def predicted(self) -> list[tuple[int, int]]:
        """(page, layer) the next steps are likely to select: every page some layer selected in
        its latest step, the most-selected (then newest) first, for every layer."""
        counts = collections.Counter(p for pages in self.last_selected.values() for p in pages)
        pages = sorted(counts, key=lambda p: (-counts[p], -p))
        return [(p, layer) for p in pages for layer in range(len(self.caches))]

    def prefetch(self, max_pages: int) -> None:
        """Keep up to max_pages (page, layer) reads in flight for pages not yet resident: the
        predicted ones first, then the newest pages (decode selects recent pages more often)."""
        in_flight = sum(len(items) for _, items in self._pending)
        budget = max_pages - in_flight
        if budget <= 0:
            return
        wanted: list[tuple[int, int]] = []
        requested = {item for _, items in self._pending for item in items}

        def want(page: int, layer: int) -> bool:
            if not self.resident[layer, page] and (page, layer) not in requested:
                requested.add((page, layer))
                wanted.append((page, layer))
            return len(wanted) == budget

        layers = range(len(self.caches))
        newest = ((page, layer) for page in range(self.num_pages - 1, -1, -1) for layer in layers)
        any(want(page, layer) for page, layer in itertools.chain(self.predicted(), newest))
        if wanted:
            fetch = self.client.get_kv_async([(self.hashes[p], layer) for p, layer in wanted])
            self._pending.append((fetch, wanted))
            if len(self.prefetch_log) < 1_000:
                self.prefetch_log.append(wanted)

    def poll(self, wait: bool = False) -> int:
        """Import the background reads that have arrived (all of them if wait); returns pages."""
        imported, still = 0, []
        for fetch, items in self._pending:
            if not (wait or fetch.done()):
                still.append((fetch, items))
                continue
            by_layer: dict[int, tuple[list[int], list]] = {}
            try:
                results = fetch.result()
            except ServiceUnavailable:
                continue  # a background read: the pages stay non-resident, fetched on demand
            for (page, layer), payload in zip(items, results, strict=True):
                if payload is not None and not self.resident[layer, page]:
                    pages, payloads = by_layer.setdefault(layer, ([], []))
                    pages.append(page)
                    payloads.append(payload)
                    self.stats.kv_bytes_prefetched += payload.nbytes
            for layer, (pages, payloads) in by_layer.items():
                self.codec.import_kv(self.caches[layer], [self.block_table[p] for p in pages], payloads)
                self.resident[layer, pages] = True
                imported += len(pages)
        self._pending = still
        return imported

    @property
    def complete(self) -> bool:
        return bool(self.resident.all())


@torch.inference_mode()
def forward_with_ops(model, input_ids: torch.Tensor, meta: AttentionMetadata,
                     caches: list[LayerKVCache], ops: AttentionOps) -> torch.Tensor:
    """`MSATransformer.forward` with the given (wrapped) attention ops: input_ids [T] → hidden [T, H]."""
    return model(input_ids, meta, caches, ops=ops)
