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
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from msaserve.kvcache.client import KVCacheClient, ServiceUnavailable


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
        self.present = torch.zeros(num_layers, max_pages, dtype=torch.bool)
        self._requested = torch.zeros(num_layers, max_pages, dtype=torch.bool)
        """[L, max_pages] queued for a background read once (a failed one is left to demand)."""
        self.source = self._checked(source)
        self._pending: list[tuple[Future, list[tuple[int, int]]]] = []
        self._worker: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self.service_log: list[tuple[str, list[tuple[int, int]]]] = []
        """("demand" | "prefetch", (page, layer) items) of each service read, in the order they
        started (the first 10,000)."""
        self.service_reads = 0
        self.service_bytes = 0

    def reset(self, source: ServiceSource | None) -> "HostKV":
        """Reuse this (pinned) memory for another session: nothing present, pages from `source`.
        The last session's queued background reads are cancelled; only a read already running is
        waited for (it writes into this memory)."""
        self.cancel_pending()
        if self.data.is_pinned():  # kernels of the last session may still read it (UVA): let them end
            torch.cuda.synchronize()
        self.present.zero_()
        self._requested.zero_()
        self.source = self._checked(source)
        self.service_log, self.service_reads, self.service_bytes = [], 0, 0
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

    def write(self, layer: int, pages: Sequence[int], kv: torch.Tensor) -> None:
        """kv [n, 2, P, Hkv, D] (any device) → these pages of `layer` (asynchronous from CUDA
        into pinned memory: stream order makes any later read of them see the data)."""
        pages = list(pages)
        index = torch.as_tensor(pages, dtype=torch.long)
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
        open_ = ~(self.present[:, :stored] | self._requested[:, :stored]).numpy()
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
