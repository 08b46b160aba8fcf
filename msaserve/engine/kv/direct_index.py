"""Adoption's index load from shards in this process: copied to the device straight from the
service's memory, verified beside the copy.

Group by group of GROUP_PAGES logical pages (every group's lease asked for at once, so the shards
answer later groups while the first is copied):
- the shards lease the group's stored index pages (`KVCacheClient.lease_index_async`: the bytes
  themselves, unverified, held unchanged until the lease ends);
- the pages' bytes go to a device staging buffer: each run of pages that lie next to each other
  in one arena segment (pages of a session written in order do) is one host→device copy, on a
  side stream, from pinned memory when the engine gave the shards pinned segments
  (`pinned_segments.py`); pages outside an arena are stacked and copied together;
- every page's bytes are checked against the checksum stored with it (xxh3_64):
  - on CUDA, on the GPU, from the bytes the copy wrote (`kernels.checksum`, no host sync until the
    end): the check covers host memory and the link too, and costs the host nothing. Checking on the
    host was the load's bound: 1 GiB took 72.5 ms with 8 threads on the H200's host (host memory
    bound near 16 GB/s; more threads were no faster) against 20 ms for the copies
    (`benchmarks/kvcache/verify_threads.py`). The scatter does not wait for the check: a bad page's
    bytes may land in cache pages at or past the first bad one, which the load does not count and
    the caller recomputes (it prefills every token from there, and frees the pages it does not keep);
  - elsewhere, by a thread pool on the same bytes the copy reads, and only the verified prefix is
    scattered;
- the first missing or bad page ends the load there (the caller recomputes from its tokens) and is
  reported to its shard as corrupt.
The leases end after every check and copy that reads the leased bytes has completed (a
sparse-resident adoption starts their releases at its session's second step: `release_later`).
"""

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import numpy as np
import torch
import xxhash

from msaserve.engine.kv.pages import PageCodec
from msaserve.engine.kv.pinned_segments import segment_tensor
from msaserve.kernels.checksum import kernel_takes, xxh3_64_rows
from msaserve.kvcache.client import KVCacheClient, LeaseFetch, PageLease, ServiceUnavailable
from msaserve.kvcache.codec import pack_pool
from msaserve.models.cache import LayerKVCache

ReleaseStart = Callable[[], Callable[[], None]]
"""Starts one lease's release; returns a function that waits for it (`load_index_leased`)."""

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
    """Where a group's pages are read from by the scatter. On CUDA: two device buffers [group
    pages, row bytes], filled by copies on a side stream (one per run), ordered against the
    scatters that read them by events. On the CPU the runs are the chunks themselves (views of the
    arena: no copy at all); pages outside an arena are stacked."""

    def __init__(self, device: torch.device, rows: int, row_bytes: int) -> None:
        self.device, self.cuda = device, device.type == "cuda"
        self.buffers = [torch.empty(rows, row_bytes, dtype=torch.uint8, device=device)
                        for _ in range(2 if self.cuda else 0)]
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        if self.cuda:  # the buffers' memory may still be in use by earlier work of the current stream
            self.stream.wait_stream(torch.cuda.current_stream(device))
        self.copied: list[torch.cuda.Event | None] = [None, None]
        self.consumed: list[torch.cuda.Event | None] = [None, None]

    def fill(self, slot: int, lease: PageLease, segments: list[torch.Tensor], items: np.ndarray,
             row_bytes: int) -> list[tuple[np.ndarray, torch.Tensor]]:
        """The pages `items` → pieces (the item of each row, chunk [rows, row_bytes])."""
        order, runs = runs_of(lease.segment_of[items], lease.offsets[items], row_bytes)
        in_runs = sum(count for _, count, _, _ in runs)
        loose = items[order[in_runs:]]
        sources = [segments[segment][offset : offset + count * row_bytes].view(count, row_bytes)
                   for _, count, segment, offset in runs]
        if len(loose):  # rare: pages outside an arena (it was full, or they came from disk)
            sources.append(torch.from_numpy(np.stack([lease.views[i] for i in loose])))
        if not self.cuda:
            starts = [first for first, _, _, _ in runs]
            ends = [*starts[1:], in_runs][: len(starts)]
            pieces = [(items[order[a:b]], source)
                      for a, b, source in zip(starts, ends, sources[: len(runs)], strict=True)]
            return pieces + ([(loose, sources[-1])] if len(loose) else [])
        buffer = self.buffers[slot]
        with torch.cuda.stream(self.stream):
            if self.consumed[slot] is not None:
                self.stream.wait_event(self.consumed[slot])  # the scatter of its last group is done
            first = 0
            for source in sources:
                buffer[first : first + len(source)].copy_(source, non_blocking=True)
                first += len(source)
            self.copied[slot] = torch.cuda.Event()
            self.copied[slot].record(self.stream)
        return [(items[order], buffer[: len(order)])]

    def ready(self, slot: int) -> None:
        """Work on the current stream from here on sees buffer `slot`'s copies."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.copied[slot])

    def consumed_by_current_stream(self, slot: int) -> None:
        if self.cuda:
            self.consumed[slot] = torch.cuda.Event()
            self.consumed[slot].record()

    def finish(self) -> None:
        """Wait until no copy reads host memory any more (before the lease ends)."""
        if self.cuda:
            self.stream.synchronize()


def _scatter(codec: PageCodec, caches: Sequence[LayerKVCache], physical: torch.Tensor,
             pieces: list[tuple[np.ndarray, torch.Tensor]], bound: int) -> None:
    """Scatter the pieces' rows whose item is below `bound` into the caches."""
    for row_items, chunk in pieces:
        keep = np.flatnonzero(row_items < bound)
        if not len(keep):
            continue
        if len(keep) < len(row_items):
            chunk = chunk.index_select(0, index_to_device(keep, chunk.device))
        codec.scatter_index(caches, physical[index_to_device(row_items[keep], physical.device)],
                            chunk.to(physical.device))


@dataclasses.dataclass
class _Group:
    """One group of logical pages: its lease, its checks, where its pages were put."""

    start: int
    lease: PageLease
    limit: int
    """Pages of the group before its first missing one."""
    checks: list[tuple[int, Future]]
    """(first page of the group's lease, the check of VERIFY_PAGES pages from there); empty when
    the device checks the group."""
    pieces: list[tuple[np.ndarray, torch.Tensor]] = dataclasses.field(default_factory=list)
    first_bad: torch.Tensor | None = None
    """Device check: the group's first bad page on the device (`limit` if none), not yet read."""


def _begin(fetch: LeaseFetch, start: int, row_bytes: int, on_host: bool) -> _Group:
    """A group's lease arrived: its sizes checked, its pages' checks queued on the thread pool
    (`on_host`; else the device checks them after the copy, `_check_on_device`)."""
    lease = fetch.result()
    limit = lease.first_missing()
    wrong = np.flatnonzero(lease.nbytes[:limit] != row_bytes)
    if len(wrong):
        i = int(wrong[0])
        raise ValueError(f"index page {start + i} has {lease.nbytes[i]} bytes; the reader's "
                         f"layout needs {row_bytes} (a model identity mismatch)")
    if not on_host:
        return _Group(start, lease, limit, [])
    checksums = lease.checksums[:limit].tolist()
    checks = [(a, pack_pool().submit(_first_bad, lease.views[a:b], checksums[a:b]))
              for a in range(0, limit, VERIFY_PAGES) for b in [min(a + VERIFY_PAGES, limit)]]
    return _Group(start, lease, limit, checks)


def _check_on_device(group: _Group) -> None:
    """Queue the device check of the group's copied rows (after `ready`, before `consumed`): its
    first page whose xxh3_64 differs from the stored checksum, as a device scalar."""
    firsts = []
    for row_items, chunk in group.pieces:
        digests = xxh3_64_rows(chunk)
        expected = index_to_device(group.lease.checksums[row_items].view(np.int64), chunk.device)
        items = index_to_device(row_items, chunk.device)
        firsts.append(torch.where(digests != expected, items, torch.full_like(items, group.limit)).min())
    group.first_bad = torch.stack(firsts).min()


def load_index_leased(client: KVCacheClient, hashes: Sequence[int], codec: PageCodec,
                      caches: Sequence[LayerKVCache], physical: torch.Tensor,
                      group_pages: int = GROUP_PAGES, check_on: str | None = None,
                      release_later: list[ReleaseStart] | None = None) -> int:
    """Lease the index pages `hashes` (page i → cache page physical[i]) and scatter them into the
    caches, up to the first missing or bad one; returns how many (the verified prefix).

    One lease per group of pages, all asked for at once: the first group's pages are copied and
    checked while the shards still answer the later leases. Every lease ends before this returns,
    unless release_later is given.
    check_on: "device" (the default on CUDA where the checksum kernel takes the page size) or
    "host" (the default elsewhere). release_later: the leases' releases are not started here but
    appended to it (`ReleaseStart`s) for the caller to start (an adoption asks for its K/V lease
    first: each shard answers in order, and ~32 index releases before it were on the first
    token's path); no copy or check reads the leased bytes any more when this returns."""
    row_bytes = codec.index_bytes + codec.scale_bytes
    device = caches[0].index_cache.device
    if check_on is None:
        check_on = "device" if device.type == "cuda" and kernel_takes(row_bytes) else "host"
    if check_on not in ("device", "host"):
        raise ValueError(f"check_on is {check_on!r}: allowed 'device', 'host' or None (by device)")
    on_device = check_on == "device"
    bounds = [(a, min(a + group_pages, len(hashes))) for a in range(0, len(hashes), group_pages)]
    fetches = [client.lease_index_async(hashes[a:b]) for a, b in bounds]
    staging = _Staging(device, min(group_pages, max(1, len(hashes))), row_bytes)
    groups: list[_Group] = []
    usable, bad = 0, None

    def fill(g: int) -> None:  # group g's lease, checks and copies (into buffer g % 2)
        try:
            group = _begin(fetches[g], bounds[g][0], row_bytes, on_host=not on_device)
        except ServiceUnavailable:
            return  # a shard did not answer: the load ends before this group
        groups.append(group)
        segments = [segment_tensor(segment, device) for segment in group.lease.segments]
        group.pieces = staging.fill(g % 2, group.lease, segments, np.arange(group.limit), row_bytes)

    try:
        for g in range(min(2, len(bounds))):
            fill(g)
        for g in range(len(bounds)):
            if g >= len(groups):
                break  # its lease did not come (ServiceUnavailable)
            group = groups[g]
            intact = group.limit
            for a, check in group.checks:
                first_bad = check.result()
                if first_bad >= 0:
                    bad, intact = (g, a + first_bad), a + first_bad
                    break
            staging.ready(g % 2)
            if on_device and group.limit:
                _check_on_device(group)
            _scatter(codec, caches, physical[group.start :], group.pieces, intact)
            staging.consumed_by_current_stream(g % 2)
            group.pieces = []
            usable += intact
            if intact < bounds[g][1] - bounds[g][0]:
                break  # the first bad or missing page: the caller recomputes from here
            if g + 2 < len(bounds) and len(groups) == g + 2:
                fill(g + 2)
        if on_device:
            usable, bad = _device_verdict(groups, usable)
    finally:
        _end(groups, fetches, staging, bad, release_later)
    return usable


def _device_verdict(groups: list[_Group], usable: int) -> tuple[int, tuple[int, int] | None]:
    """The device checks' answer (one host sync for the whole load): the verified prefix, and
    (group, page of its lease) of the first bad page if any."""
    checked = [(g, group) for g, group in enumerate(groups) if group.first_bad is not None]
    if not checked:
        return usable, None
    firsts = torch.stack([group.first_bad for _, group in checked]).tolist()
    for (g, group), first in zip(checked, firsts, strict=True):
        if first < group.limit:
            return group.start + first, (g, first)
    return usable, None


def _end(groups: list[_Group], fetches: list[LeaseFetch], staging: _Staging,
         bad: tuple[int, int] | None, release_later: list[ReleaseStart] | None = None) -> None:
    """No thread or copy reads leased bytes any more, then every lease ends (the bad page reported):
    here, or (release_later) by the functions appended to it, which the caller calls when the
    shards' time is cheaper (each starts one lease's release and returns its wait)."""
    checks = [check for group in groups for _, check in group.checks]
    for check in checks:
        check.cancel()
    for check in checks:
        with contextlib.suppress(Exception):
            if not check.cancelled():
                check.result()
    staging.finish()
    starts = [functools.partial(_start_release, groups[g].lease if g < len(groups) else None, fetch,
                                [bad[1]] if bad is not None and bad[0] == g else None)
              for g, fetch in enumerate(fetches)]
    if release_later is not None:
        release_later.extend(starts)
        return
    waits = [start() for start in starts]  # every lease's release in flight at once, then waited for
    for wait in waits:
        wait()


def _start_release(lease: PageLease | None, fetch: LeaseFetch, corrupt: list[int] | None
                   ) -> Callable[[], None]:
    """Start the release of one group's lease (`lease`, or the one `fetch` brings: a group the load
    did not reach) → a function that waits for it. A lease that failed has nothing to end, and a
    failed release is not the reader's error: both wait for nothing."""
    try:
        wait = (lease if lease is not None else fetch.result()).release_async(corrupt=corrupt)
    except Exception:
        return lambda: None

    def quietly() -> None:
        with contextlib.suppress(Exception):
            wait()

    return quietly
