"""Adoption's index load from shards in this process: copied to the device straight from the
service's memory, verified beside the copy.

The shards lease the stored index pages (`KVCacheClient.lease_index_async`: the bytes themselves,
unverified, held unchanged until the lease ends). Then, group by group of logical pages:
- the pages' bytes go to a device staging buffer: each run of pages that lie next to each other
  in one arena segment (pages of a session written in order do) is one host→device copy, on a
  side stream, from pinned memory when the engine gave the shards pinned segments
  (`pinned_segments.py`); pages outside an arena are copied one by one;
- meanwhile a thread pool checks every page's bytes — the same bytes the copy reads — against the
  checksum stored with it (xxhash releases the GIL for buffers over 64 KiB, so the checks run in
  parallel);
- only the verified prefix is scattered into the caches: the first missing or bad page ends the
  load there (the caller recomputes from its tokens) and is reported to its shard as corrupt.
The lease ends after every copy that reads the leased bytes has completed.
"""

import contextlib
from collections.abc import Sequence

import numpy as np
import torch
import xxhash

from msaserve.engine.kv.pages import PageCodec
from msaserve.engine.kv.pinned_segments import segment_tensor
from msaserve.kvcache.client import PageLease
from msaserve.kvcache.codec import pack_pool
from msaserve.models.cache import LayerKVCache

GROUP_PAGES = 1024
"""Logical pages per staging buffer (128 MiB of device memory at M3's 4-layer index page)."""
VERIFY_PAGES = 32
"""Pages per verification task."""


def index_to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A small host index array on `device`, without a stream sync on CUDA (a pageable copy would
    wait for every queued upload and scatter: one host stall per group of a bulk load)."""
    host = torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _first_bad(views: Sequence[np.ndarray], checksums: Sequence[int]) -> int:
    """Index of the first view whose xxh3_64 differs from its checksum, or -1."""
    for i, (view, expected) in enumerate(zip(views, checksums, strict=True)):
        if xxhash.xxh3_64_intdigest(view) != expected:
            return i
    return -1


def runs_of(segment_of: np.ndarray, offsets: np.ndarray, row_bytes: int) -> tuple[np.ndarray, list]:
    """Pages → (their order in the staging rows, runs). Pages in an arena come first, sorted by
    (segment, offset), cut into runs of byte-adjacent pages: (first row, pages, segment, offset);
    the pages outside an arena follow, one row each (not in the runs)."""
    in_arena = np.flatnonzero(segment_of >= 0)
    order = in_arena[np.lexsort((offsets[in_arena], segment_of[in_arena]))]
    seg, off = segment_of[order], offsets[order]
    runs = []
    if len(order):
        breaks = np.flatnonzero((np.diff(seg) != 0) | (np.diff(off) != row_bytes)) + 1
        starts = np.concatenate([[0], breaks]).astype(np.int64)
        ends = np.append(starts[1:], len(order))
        runs = [(int(a), int(b - a), int(seg[a]), int(off[a])) for a, b in zip(starts, ends, strict=True)]
    loose = np.flatnonzero(segment_of < 0)
    return np.concatenate([order, loose]), runs


class _Staging:
    """Two device buffers [GROUP_PAGES, row_bytes]; on CUDA the copies into them run on a side
    stream, ordered against the scatters that read them by events."""

    def __init__(self, device: torch.device, rows: int, row_bytes: int) -> None:
        self.device, self.cuda = device, device.type == "cuda"
        self.buffers = [torch.empty(rows, row_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.copied = [None, None]
        self.consumed = [None, None]

    def fill(self, slot: int, lease: PageLease, segments: list[torch.Tensor], items: np.ndarray,
             row_bytes: int) -> np.ndarray:
        """Copy the pages `items` into buffer `slot` (in run order); returns the item of each row."""
        order, runs = runs_of(lease.segment_of[items], lease.offsets[items], row_bytes)
        buffer = self.buffers[slot]
        with torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext():
            if self.cuda and self.consumed[slot] is not None:
                self.stream.wait_event(self.consumed[slot])  # the scatter of its last group is done
            for first, count, segment, offset in runs:
                source = segments[segment][offset : offset + count * row_bytes]
                buffer[first : first + count].view(-1).copy_(source, non_blocking=True)
            loose = order[sum(count for _, count, _, _ in runs):]
            if len(loose):
                first = len(order) - len(loose)
                rows = np.stack([lease.views[i] for i in items[loose]])  # rare: pages outside an arena
                buffer[first : first + len(loose)].copy_(torch.from_numpy(rows))
            if self.cuda:
                self.copied[slot] = torch.cuda.Event()
                self.copied[slot].record(self.stream)
        return items[order]

    def ready(self, slot: int) -> torch.Tensor:
        """Buffer `slot` for work on the current stream (which waits for its copy)."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.copied[slot])
        return self.buffers[slot]

    def consumed_by_current_stream(self, slot: int) -> None:
        if self.cuda:
            self.consumed[slot] = torch.cuda.Event()
            self.consumed[slot].record()

    def finish(self) -> None:
        """Wait until no copy reads host memory any more (before the lease ends)."""
        if self.cuda:
            self.stream.synchronize()


def load_index_leased(lease: PageLease, codec: PageCodec, caches: Sequence[LayerKVCache],
                      physical: torch.Tensor, group_pages: int = GROUP_PAGES) -> int:
    """Scatter the lease's index pages (item i → cache page physical[i]) into the caches, up to the
    first missing or bad one; returns how many (the verified prefix). Ends the lease."""
    row_bytes = codec.index_bytes + codec.scale_bytes
    limit = lease.first_missing()
    for i in range(limit):
        if lease.views[i].nbytes != row_bytes:
            lease.release()
            raise ValueError(f"index page {i} has {lease.views[i].nbytes} bytes; the reader's layout needs "
                             f"{row_bytes} (a model identity mismatch)")
    checksums = lease.checksums[:limit].tolist()
    groups = [np.arange(a, min(a + group_pages, limit)) for a in range(0, limit, group_pages)]
    # Per group, (first page, its check) for each VERIFY_PAGES pages, all queued now (in page order).
    checks = [[(a, pack_pool().submit(_first_bad, lease.views[a:b], checksums[a:b]))
               for a in range(int(items[0]), int(items[-1]) + 1, VERIFY_PAGES)
               for b in [min(a + VERIFY_PAGES, int(items[-1]) + 1)]] for items in groups]
    device = caches[0].index_cache.device
    staging = _Staging(device, min(group_pages, max(1, limit)), row_bytes)
    segments = [segment_tensor(s) for s in lease.segments]
    rows_items: list[np.ndarray] = []
    usable, bad = 0, None
    try:
        for g in range(min(2, len(groups))):
            rows_items.append(staging.fill(g % 2, lease, segments, groups[g], row_bytes))
        for g, items in enumerate(groups):
            intact = len(items)
            for a, check in checks[g]:
                first_bad = check.result()
                if first_bad >= 0:
                    bad = a + first_bad
                    intact = bad - int(items[0])
                    break
            chunk, row_items = staging.ready(g % 2), rows_items[g]
            if intact:
                keep = np.flatnonzero(row_items < items[0] + intact)
                if len(keep) < len(row_items):
                    chunk = chunk.index_select(0, index_to_device(keep, device))
                codec.scatter_index(caches, physical[index_to_device(row_items[keep], device)],
                                    chunk[: len(keep)])
            staging.consumed_by_current_stream(g % 2)
            usable += intact
            if bad is not None:
                break
            if g + 2 < len(groups):
                rows_items.append(staging.fill(g % 2, lease, segments, groups[g + 2], row_bytes))
    finally:
        every = [check for group in checks for _, check in group]
        for check in every:
            check.cancel()
        for check in every:
            with contextlib.suppress(Exception):
                if not check.cancelled():
                    check.result()  # no thread reads the leased bytes after the lease ends
        staging.finish()
        lease.release(corrupt=[bad] if bad is not None else None)
    return usable
