"""A reader's side of zero-copy reads (`KVCacheClient.lease_index_async`): the shards' answers
(`views.PageViews`) merged into request order, and the end of the lease.

    lease = client.lease_index_async(page_hashes).result()
    try:
        ...  # copy lease.views[i] (or runs of lease.segments) and check each against lease.checksums[i]
    finally:
        lease.release(corrupt=[items that failed the check])

Until `release` the shards keep every leased page's bytes as they are (an arena slot is not
reused even if the page is evicted or replaced), so what the reader checks is what it copies.
"""

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from msaserve.kvcache.transport import Transport
from msaserve.kvcache.views import PageViews, SharedPageViews


class PageLease:
    def __init__(self, transport: Transport, shards: list[Any], size: int,
                 replies: list[tuple[int, Sequence[int] | np.ndarray, PageViews]]) -> None:
        """replies: (shard index, request positions, that shard's PageViews — or SharedPageViews
        from a shard in another process, mapped here) per shard called."""
        self._transport, self._shards = transport, shards
        self._parts = [(shard, np.asarray(positions, np.int64), views.lease_id)
                       for shard, positions, views in replies]
        self.released = False
        self._size = size
        self._views: list[np.ndarray | None] | None = None
        try:  # a shard's files this process cannot map (another node): end every lease, re-raise
            replies = [(shard, positions, views.mapped() if isinstance(views, SharedPageViews) else views)
                       for shard, positions, views in replies]
        except OSError:
            self.release()
            raise
        self.checksums = np.zeros(size, np.uint64)
        self.segment_of = np.full(size, -1, np.int64)
        """[n] index into `segments` of each page's bytes, -1 where not in an arena (or missing)."""
        self.offsets = np.zeros(size, np.int64)
        self.nbytes = np.full(size, -1, np.int64)
        """[n] each page's size, -1 where the service has none."""
        self.segments: list[np.ndarray] = []
        """Every leased shard's arena segments, one list (`segment_of` indexes it)."""
        self._replies = replies
        for _, positions, views in replies:
            pos = np.asarray(positions, np.int64)
            self.checksums[pos] = views.checksums
            in_arena = views.segment_of >= 0
            self.segment_of[pos] = np.where(in_arena, views.segment_of + len(self.segments), -1)
            self.offsets[pos] = views.offsets
            self.nbytes[pos] = views.nbytes
            self.segments.extend(views.segments)

    @property
    def views(self) -> list[np.ndarray | None]:
        """[n] each page's stored bytes (None where the service has none), in request order; merged
        on first use (a reader of in-arena pages by address never needs them: 32K items for a
        million-token session's K/V)."""
        if self._views is None:
            views: list[np.ndarray | None] = [None] * self._size
            for _, positions, reply in self._replies:
                for p, view in zip(positions, reply.views, strict=True):
                    views[p] = view
            self._views = views
        return self._views

    def __len__(self) -> int:
        return self._size

    def first_missing(self) -> int:
        """The first item the service has no page for (len(self) if none)."""
        missing = np.flatnonzero(self.nbytes < 0)
        return int(missing[0]) if len(missing) else self._size

    def renew(self) -> bool:
        """Restart every shard's TTL clock of this lease (`ServiceConfig.lease_ttl_s`) → whether
        every shard still held it (False: one expired, its pages may have been reused)."""
        if self.released:
            return False
        calls = [self._transport.submit(self._shards[shard], "renew_leases", [lease_id])
                 for shard, _, lease_id in self._parts]
        return all(held == 1 for held in self._transport.gather(calls))

    def release(self, corrupt: list[int] | None = None) -> None:
        """End the lease on every shard (once); `corrupt`: items whose bytes failed the check —
        the shards drop those copies and count them as corruptions."""
        self.release_async(corrupt)()

    def release_async(self, corrupt: list[int] | None = None) -> Callable[[], None]:
        """`release` without waiting for the shards → a function that waits for them (a reader
        ending many leases at once starts every release, then waits for all of them together)."""
        if self.released:
            return lambda: None
        self.released = True
        bad = np.zeros(self._size, bool)
        if corrupt:
            bad[np.asarray(corrupt, np.int64)] = True
        calls = []
        for shard, positions, lease_id in self._parts:
            mine = np.flatnonzero(bad[positions]).tolist()
            calls.append(self._transport.submit(self._shards[shard], "release_lease", lease_id, mine))

        def wait() -> None:
            self._transport.gather(calls)

        return wait


class LeaseFetch:
    """Leases in flight; `result()` waits for every shard and merges their answers."""

    def __init__(self, transport: Transport, shards: list[Any], size: int,
                 futures: list[tuple[int, Sequence[int] | np.ndarray, Any]]) -> None:
        self._transport, self._shards, self._size, self._futures = transport, shards, size, futures
        self._lease: PageLease | None = None
        self._error: Exception | None = None

    def result(self, timeout_s: float | None = None) -> PageLease:
        """The merged lease (the same object on every call). If a shard did not answer, the leases
        the others gave are ended and its error is raised."""
        if self._error is not None:
            raise self._error
        if self._lease is None:
            parts, error = [], None
            for shard, positions, future in self._futures:
                try:
                    parts.append((shard, positions, self._transport.gather([future], timeout_s)[0]))
                except Exception as e:  # re-raised below, once the others' leases have ended
                    error = error or e
            if error is not None:
                self._error = error
                with contextlib.suppress(OSError):  # (mapping failed: its leases are ended too)
                    PageLease(self._transport, self._shards, self._size, parts).release()
                raise error
            try:
                self._lease = PageLease(self._transport, self._shards, self._size, parts)
            except OSError as e:  # the shards' files cannot be mapped here: the leases are ended
                self._error = e
                raise
        return self._lease
