"""The host tier of a sparse-resident session: its K/V pages in (pinned) host memory.

A session decoding with sparse residency (`residency.py`) keeps only a working set of K/V pages on
the GPU; every other page lives here, one `[2, P, Hkv, D]` block per (layer, page), so that a page
the indexer selects is one host-to-device copy away. Pages arrive three ways:
- **offload**: a session prefilled (or decoded) fully resident hands its pages over;
- **write-behind**: a page that fills while the session decodes is copied here before its GPU
  slot can be reused (`ResidentSession`);
- **the KV cache service** (an adopted session, `ServiceSource`): a page not yet here is read from
  the service the first time it is needed, and `prefetch` keeps reads in flight in predicted
  order — each layer's previous selection and the local window first, then the newest pages —
  never in page order.
"""

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from msaserve.engine.kv.pinned_segments import segment_tensor
from msaserve.kvcache.client import KVCacheClient, ServiceUnavailable
from msaserve.kvcache.leases import LeaseFetch, PageLease

RENEW_S = 20.0
"""Seconds between renewals of a host tier's service lease (`HostKV.renew_lease`); the shards end a
lease after `ServiceConfig.lease_ttl_s` (120 s by default) without one."""


class PageLostInService(RuntimeError):
    """A page the session needs is missing or corrupt in the KV cache service."""


@dataclasses.dataclass
class ServiceSource:
    """An adopted session's pages in the KV cache service: logical page i is `hashes[i]`.

    Only the pages before `readable_pages` are read from it: from that page on the session writes
    its own (the stored partial tail is refilled by the session and written back), and a service
    read of such a page still in flight at the write-back would land after it and replace the
    newer copy with the stored one. Pages before it are never written by the session, so no read
    can race a write."""

    client: KVCacheClient
    hashes: list[int]
    session_id: str
    readable_pages: int | None = None
    """Pages the service provides (logical 0 .. readable_pages - 1); None: every stored page."""

    @property
    def readable(self) -> int:
        return len(self.hashes) if self.readable_pages is None else min(self.readable_pages, len(self.hashes))

    def read_into(self, items: Sequence[tuple[int, int]], dest: np.ndarray,
                  rows: Sequence[int]) -> list[bool]:
        """(page, layer) items → verified into rows `rows[i]` of dest [R, K+V bytes] (the host
        tier's memory: shards in this process write there directly, one copy). ok per item."""
        try:
            return self.client.get_kv_into_async([(self.hashes[p], layer) for p, layer in items], dest,
                                                 rows).result()
        except ServiceUnavailable as e:
            raise PageLostInService(f"session {self.session_id!r}: {e}") from e


class HostKV:
    """K/V of one session's pages in host memory: `[L, max_pages, 2, P, Hkv, D]`, pinned when the
    session decodes on CUDA. `present[l, p]`: whether (page p, layer l) is here.

    Service reads land in this memory directly (`KVCacheClient.get_kv_into_async`: in-process
    shards copy each page into its row and verify it there), so the source's K/V layout must be
    this tier's page, byte for byte (checked). Background reads (`prefetch`) run on a worker thread
    of their own and mark a page present only once its bytes are in place, so the decode thread
    does none of that work (a GPU kernel may read a present page straight from here)."""

    def __init__(self, num_layers: int, max_pages: int, page_shape: tuple[int, int, int], dtype: torch.dtype,
                 pin: bool, source: ServiceSource | None = None) -> None:
        """page_shape: (P, Hkv, D). source: where pages not offloaded or written back come from."""
        self.data = torch.empty(num_layers, max_pages, 2, *page_shape, dtype=dtype, pin_memory=pin)
        self._rows = self.data.view(torch.uint8).reshape(num_layers * max_pages, -1).numpy()
        """The same memory as [L · max_pages, page bytes] uint8: (page p, layer l) is row l · max_pages + p
        (service reads land there with no staging copy)."""
        # The whole-array updates of these flags (reset, lease, release) go through numpy views: a
        # torch CPU op on [L, max_pages] (32,792 items at 1M tokens and 4 layers) is above torch's
        # parallel grain (32,768 items) and runs as an OpenMP region, which took 15x its time beside
        # another thread's parallel torch op on a 2-core CPU (0.02 → 0.3 ms); numpy runs it on the
        # calling thread. (On the H200 the reset's flag clearing took 7-29 ms, cause unproven.)
        self.present = torch.zeros(num_layers, max_pages, dtype=torch.bool)
        self._requested = torch.zeros(num_layers, max_pages, dtype=torch.bool)
        """[L, max_pages] queued for a background read once (a failed one is left to demand)."""
        self.source = self._checked(source)
        self._pending: list[tuple[Future, list[tuple[int, int]]]] = []
        self._worker: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self.byte_offsets = self._own_rows()
        """[L, max_pages] where each (layer, page) lies, in bytes from `data`'s first byte: its own row,
        or (a leased page) the service's copy in a shard's arena (`lease`)."""
        self.leased = np.zeros((num_layers, max_pages), dtype=bool)
        """[L, max_pages] read in place from the service's memory (`lease`), never copied here."""
        self.lease_checksums = np.zeros((num_layers, max_pages), dtype=np.int64)
        """[L, max_pages] the xxh3_64 the service stored with each leased page (uint64 bits)."""
        self.lease: PageLease | None = None
        self._ended_leases: list[PageLease] = []
        """Leases of earlier sessions not yet released to the shards (`release_ended_leases`)."""
        self._releasing: list[Callable[[], None]] = []
        """Waits for the releases `release_ended_leases` started and has not waited for yet."""
        self._deferred: list[Callable[[], Callable[[], None]]] = []
        """Releases another reader handed over to start later (`start_releases(later=True)`)."""
        self._lease_position = np.full((num_layers, max_pages), -1, dtype=np.int64)
        self._renewed = 0.0
        self.reset_phases: dict[str, float] = {}
        """Seconds of the last `reset`'s parts (the queued reads cancelled, the device synchronised, the
        rest), on the host clock."""
        self.service_log: list[tuple[str, list[tuple[int, int]]]] = []
        """("demand" | "prefetch", (page, layer) items) of each service read, in the order they
        started (the first 10,000)."""
        self.service_reads = 0
        self.service_bytes = 0

    def reset(self, source: ServiceSource | None) -> "HostKV":
        """Reuse this (pinned) memory for another session: nothing present, pages from `source`.
        The last session's queued background reads are cancelled; only a read already running is
        waited for (it writes into this memory)."""
        t0 = time.perf_counter()
        self.cancel_pending()
        t1 = time.perf_counter()
        if self.data.is_pinned():  # kernels of the last session may still read it (UVA): let them end
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        self.release_lease(later=True)
        t3 = time.perf_counter()
        self.present.numpy()[:] = False  # (through numpy: see __init__)
        self._requested.numpy()[:] = False
        t4 = time.perf_counter()
        self.source = self._checked(source)
        self.service_log, self.service_reads, self.service_bytes = [], 0, 0
        t5 = time.perf_counter()
        # clear_s = lease_s + flags_s + rest_s (the H200's and H100's resets varied 2-29 ms, all of it in
        # clear, while a reset without decode steps before it took 1.6 ms: the split says where)
        self.reset_phases = dict(cancel_s=t1 - t0, sync_s=t2 - t1, clear_s=t5 - t2, lease_s=t3 - t2,
                                 flags_s=t4 - t3, rest_s=t5 - t4)
        return self

    def _checked(self, source: ServiceSource | None) -> ServiceSource | None:
        """The source, if its K/V pages are this tier's pages byte for byte (reads copy raw bytes)."""
        if source is not None:
            m = source.client.model
            theirs = ((m.page_size, m.num_kv_heads, m.head_dim), m.kv_dtype)
            ours = (tuple(self.data.shape[3:]), str(self.data.dtype).removeprefix("torch."))
            if theirs != ours:
                raise ValueError(f"the service's K/V pages of {m.name!r} are {theirs[0]} {theirs[1]}: "
                                 f"allowed only this host tier's page {ours[0]} {ours[1]} (copied as bytes)")
        return source

    @property
    def page_bytes(self) -> int:
        return self.data[0, 0].numel() * self.data.element_size()

    def _own_rows(self) -> np.ndarray:
        """[L, max_pages] byte offset of each (layer, page)'s own row in `data`."""
        layers, max_pages = self.present.shape
        return np.arange(layers * max_pages, dtype=np.int64).reshape(layers, max_pages) * self.page_bytes

    # ---- pages read in place from the service ---------------------------------------------------
    def request_lease(self, hashes: Sequence[int]) -> LeaseFetch | None:
        """Ask the service to lease every layer's K/V of these pages (logical page i = hashes[i]),
        where a kernel can read them in place: shards in this process that keep K/V in an arena.
        None where they do not (the pages then come by reads). `ResidentSession.adopt` asks after
        the index load: beside it, the shards' threads building the lease held the GIL and slowed
        the load more than the lease costs."""
        source = self.source
        if source is None or not hashes:
            return None
        client = source.client
        if not client.transport.shares_memory or "kv" not in client.arena_stores():
            return None
        if client.model.num_layers != self.present.shape[0]:
            raise ValueError(f"the service's model has {client.model.num_layers} layers: allowed this host "
                             f"tier's {self.present.shape[0]}")
        return client.lease_kv_async(hashes)

    def attach_lease(self, fetch: LeaseFetch | None, readable: int, cuda: bool) -> int:
        """The lease `request_lease` asked for → pages (before `readable`) that kernels now read in
        place: marked present (no read, no fill), with where they lie and their stored checksum
        (the session checks each on the GPU at its first use). A page the service lacks, or one
        outside the arena, or (cuda) in a segment that is not page-locked, stays absent and comes
        by reads. Returns the (page, layer) items leased."""
        if fetch is None:
            return 0
        lease = fetch.result()
        layers, max_pages = self.present.shape
        n = min(len(lease), min(readable, max_pages) * layers)
        segment_of = lease.segment_of[:n]
        if not lease.segments:
            return self._keep_lease(lease)
        bases = np.array([segment.ctypes.data for segment in lease.segments], dtype=np.int64)
        usable = np.array([not cuda or segment_tensor(segment).is_pinned() for segment in lease.segments])
        ok = (segment_of >= 0) & usable[np.maximum(segment_of, 0)]
        items = np.flatnonzero(ok)
        pages, layer_of = np.divmod(items, layers)
        address = bases[segment_of[items]] + lease.offsets[items]
        self.byte_offsets[layer_of, pages] = address - self.data.data_ptr()
        self.lease_checksums[layer_of, pages] = lease.checksums.view(np.int64)[items]
        self._lease_position[layer_of, pages] = items
        self.leased[layer_of, pages] = True
        flags = self.present.numpy()
        np.logical_or(flags, self.leased, out=flags)
        return self._keep_lease(lease, len(items))

    def _keep_lease(self, lease: PageLease, leased: int = 0) -> int:
        self.lease, self._renewed = lease, time.monotonic()
        return leased

    def renew_lease(self, now: float | None = None) -> None:
        """Keep the lease alive (every RENEW_S seconds; called at each decode step). A lease the
        shards already ended (the session went unstepped past `lease_ttl_s`) is an error: its pages'
        memory may hold other pages by now."""
        now = time.monotonic() if now is None else now
        if self.lease is None or now - self._renewed < RENEW_S:
            return
        self._renewed = now
        if not self.lease.renew():
            session = self.source.session_id if self.source is not None else "?"
            raise PageLostInService(f"session {session!r}: the service ended the lease of its K/V pages "
                                    "(no renewal within ServiceConfig.lease_ttl_s); adopt it again")

    def release_ended_leases(self, wait: bool = False) -> None:
        """Tell the shards about the leases `release_lease(later=True)` ended. Each release starts
        here and is waited for at the next call (so the shards' threads do it while the device
        decodes, not on the step's host path: ~8 ms for 32K items on a 2-core CPU), or here with
        `wait`. A release that failed raises when it is waited for."""
        pending, self._releasing = self._releasing, []
        for done in pending:
            done()
        while self._ended_leases:
            self._releasing.append(self._ended_leases.pop().release_async())
        deferred, self._deferred = self._deferred, []
        self._releasing.extend(start() for start in deferred)
        if wait:
            self.release_ended_leases()

    def start_releases(self, starts: Sequence[Callable[[], Callable[[], None]]], later: bool = False) -> None:
        """Start releases another reader deferred (an adoption's index leases: `load_index_leased`'s
        release_later), or with `later` at the next `release_ended_leases` (an adopted session's
        second step: the shards' threads then release while the device computes it, not while the
        adoption attaches its K/V lease); they are waited for with this tier's own."""
        if later:
            self._deferred.extend(starts)
        else:
            self._releasing.extend(start() for start in starts)

    def leased_item(self, layer: int, page: int) -> int:
        """The lease's item of (layer, page), -1 if not leased."""
        return int(self._lease_position[layer, page])

    def release_lease(self, corrupt: Sequence[int] = (), later: bool = False) -> None:
        """End the lease (after every kernel that reads its pages: the caller syncs first); its pages
        become absent, and each (layer, page) lies in its own row again. corrupt: items that failed
        their check (the shards drop them). later: the shards are told at `release_ended_leases`
        (a reused tier: releasing 32K pages is several ms of the shards' Python, off the next
        adoption's first token, and off its steps' host path)."""
        if self.lease is None:
            return
        lease, self.lease = self.lease, None
        if later:
            self._ended_leases.append(lease)
        else:
            lease.release(corrupt=list(corrupt))
        self.present.numpy()[self.leased] = False
        self.byte_offsets = self._own_rows()
        self.leased[:] = False
        self._lease_position[:] = -1

    def write(self, layer: int, pages: Sequence[int], kv: torch.Tensor) -> None:
        """kv [n, 2, P, Hkv, D] (any device) → these pages of `layer` (asynchronous from CUDA
        into pinned memory: stream order makes any later read of them see the data)."""
        pages = list(pages)
        index = torch.as_tensor(pages, dtype=torch.long)
        if self.leased[layer, pages].any():
            raise ValueError(f"pages {pages} of layer {layer} include pages leased from the service: a "
                             "session writes only from its first write page on (ServiceSource.readable)")
        if kv.device.type == "cpu":
            self.data[layer, index] = kv
        elif pages == list(range(pages[0], pages[0] + len(pages))):  # a run: one copy
            self.data[layer, pages[0] : pages[0] + len(pages)].copy_(kv, non_blocking=True)
        else:
            for i, page in enumerate(pages):  # one pinned destination per page: non-blocking copies
                self.data[layer, page].copy_(kv[i], non_blocking=True)
        self.present[layer, index] = True

    def ensure(self, layer: int, pages: Sequence[int]) -> None:
        """These pages of `layer` are here after this: the ones not here are read from the source
        now. A background read that holds one of them and is running is waited for (one chunk at
        most: the worker runs one at a time); one still queued is not — the worker runs its queue in
        order, so waiting for it would wait for every read ahead of it (the whole prefetch of an
        adopted session: seconds at 1M tokens). The page is read on demand instead, and the queued
        read later writes the same bytes again."""
        present = self.present[layer].numpy()
        missing = [p for p in pages if not present[p]]
        if missing:
            self.poll(wait_for={(p, layer) for p in missing}, started_only=True)
            missing = [p for p in missing if not present[p]]
        if missing:
            if self.source is None:
                raise PageLostInService(f"(pages {missing}, layer {layer}) are in neither the GPU working "
                                        "set nor the host tier, and the session has no service source")
            unreadable = [p for p in missing if p >= self.source.readable]
            if unreadable:
                raise PageLostInService(f"session {self.source.session_id!r}: pages {unreadable} of layer "
                                        f"{layer} are the session's own (from page {self.source.readable} "
                                        "on) and were never written to the host tier")
            items = [(p, layer) for p in missing]
            self._log("demand", items)
            ok = self._read(self.source, items)
            self.service_reads += 1
            lost = [p for (p, _), good in zip(items, ok, strict=True) if not good]
            if lost:
                raise PageLostInService(f"session {self.source.session_id!r}: K/V of pages {lost} in layer "
                                        f"{layer} are missing or corrupt in the KV cache service")

    def _read(self, source: ServiceSource, items: Sequence[tuple[int, int]]) -> list[bool]:
        """Service reads straight into this memory; the pages that arrived intact are marked present
        (the bytes first, then the flag: a kernel may read a present page at any time)."""
        max_pages = self.present.shape[1]
        ok = source.read_into(items, self._rows, [layer * max_pages + p for p, layer in items])
        good = [item for item, flag in zip(items, ok, strict=True) if flag]
        if good:
            index = torch.tensor(good, dtype=torch.long)
            self.present[index[:, 1], index[:, 0]] = True
        with self._lock:
            self.service_bytes += len(good) * self.page_bytes
        return ok

    # ---- background reads from the service ---------------------------------------------------
    def prefetch(self, predicted: Sequence[tuple[int, int]], max_items: int, chunk: int = 32) -> int:
        """Keep up to max_items (page, layer) service reads queued on the worker thread, in reads
        of `chunk` items: the `predicted` items first (in the order given), then the newest pages
        of every layer. Returns the items started. The worker runs one read at a time, so a
        demand read waits behind at most one chunk in the shards' queues; the queue is topped up
        only once half of it has run (building it costs the decode thread)."""
        if self.source is None:
            return 0
        self.poll()
        queued = sum(len(items) for _, items in self._pending)
        if queued > max_items // 2:
            return 0
        budget = max_items - queued
        stored = self.source.readable  # never the pages the session writes itself (see ServiceSource)
        # Absent and not asked for yet, [L, stored pages]; set the wanted ones as we go.
        open_ = ~(self.present.numpy()[:, :stored] | self._requested.numpy()[:, :stored])
        wanted: list[tuple[int, int]] = []
        for page, layer in predicted:
            if len(wanted) >= budget:
                break
            if 0 <= page < stored and open_[layer, page]:
                open_[layer, page] = False
                wanted.append((page, layer))
        if len(wanted) < budget:  # then the newest pages, every absent layer of each
            pages_rev, layers = np.nonzero(open_[:, ::-1].T)  # page-major, newest first
            take = budget - len(wanted)
            wanted += list(zip((stored - 1 - pages_rev[:take]).tolist(), layers[:take].tolist(), strict=True))
        if not wanted:
            return 0
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="host-tier-fill")
        index = torch.tensor(wanted, dtype=torch.long)
        self._requested[index[:, 1], index[:, 0]] = True
        for start in range(0, len(wanted), chunk):
            items = wanted[start : start + chunk]
            self._pending.append((self._worker.submit(self._fill, self.source, items), items))
            self._log("prefetch", items)
        return len(wanted)

    def _fill(self, source: ServiceSource, items: list[tuple[int, int]]) -> None:
        """(worker thread) One background read, stored; a read that fails leaves its pages to demand."""
        with contextlib.suppress(PageLostInService):
            self._read(source, items)

    def _log(self, kind: str, items: list[tuple[int, int]]) -> None:
        if len(self.service_log) < 10_000:
            self.service_log.append((kind, items))

    def poll(self, wait_for: set[tuple[int, int]] | None = None, started_only: bool = False) -> int:
        """Drop the background reads that ended, waiting first for those holding an item of
        `wait_for` (with `started_only`, only those already running). Returns the items they brought."""
        ended, still = 0, []
        for future, items in self._pending:
            if wait_for is not None and not wait_for.isdisjoint(items) and (
                    not started_only or future.running() or future.done()):
                future.result()
            if future.done():
                ended += len(items)
            else:
                still.append((future, items))
        self._pending = still
        return ended

    def skip_layer(self, layer: int) -> None:
        """Never read `layer`'s pages from the service in the background (a layer that attends
        densely holds its whole K/V on the device already)."""
        self._requested[layer] = True

    def cancel_pending(self) -> None:
        """Drop the background reads not started yet and wait for the running one."""
        for future, _ in self._pending:
            future.cancel()
        for future, _ in self._pending:
            if not future.cancelled():
                future.result()
        self._pending = []

    def wait_all(self) -> None:
        """Wait for every background read (before the session's memory is reused)."""
        for future, _ in self._pending:
            future.result()
        self._pending = []
