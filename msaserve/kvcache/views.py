"""Zero-copy page reads for a reader in the shards' process (wire types of `lease_*` calls).

A shard answers a lease with the stored bytes themselves — views of its memory tier, whose pages
live in slots of an arena (`arena.py`) — and their stored checksums, instead of copies. The reader
verifies every page it uses against its checksum (off the copy's critical path) and must end the
lease (`KVCacheClient` leases do it in `release`), reporting the pages that failed; until then the
shard keeps those bytes as they are. Where a page lies in the arena (segment, offset) lets the
reader copy a run of adjacent pages to a device as one copy.
"""

from dataclasses import dataclass, field

import numpy as np

from msaserve.kvcache import shared_segments


@dataclass
class PageViews:
    """One shard's answer to a lease of n pages: where each page's stored bytes lie (the reader's
    kernels may read them there by address), their checksums, and `views` of them."""

    lease_id: int
    checksums: np.ndarray
    """[n] uint64: the xxh3_64 stored with each page (0 where missing)."""
    segments: list[np.ndarray]
    """The arena's segments (shared with the shard, not copied)."""
    segment_of: np.ndarray
    """[n] int64: the segment index of each page's bytes, -1 where they are not in the arena."""
    offsets: np.ndarray
    """[n] int64: byte offset of each page in its segment (0 where not in the arena)."""
    nbytes: np.ndarray
    """[n] int64: each page's size, -1 where the shard has no page."""
    loose: dict[int, np.ndarray] = field(default_factory=dict)
    """Pages held outside the arena (it was full, or read back from disk): their stored bytes."""
    _views: list[np.ndarray | None] | None = field(default=None, repr=False)

    @property
    def views(self) -> list[np.ndarray | None]:
        """[n] the stored bytes of each page (read-only by contract), None where the shard has none:
        built on first use (a reader of in-arena pages by address never needs them)."""
        if self._views is None:
            views: list[np.ndarray | None] = []
            for i, (segment, offset, size) in enumerate(zip(self.segment_of.tolist(), self.offsets.tolist(),
                                                            self.nbytes.tolist(), strict=True)):
                if size < 0:
                    views.append(None)
                elif segment < 0:
                    views.append(self.loose[i])
                else:
                    views.append(self.segments[segment][offset : offset + size])
            self._views = views
        return self._views


@dataclass
class SharedPageViews:
    """A shard in another process's answer to a lease (`KVCacheShard.lease_index_shared`): where
    each page's stored bytes lie in its shared segment files, not the bytes. `mapped()` on the
    reader's side maps the files and gives the same `PageViews` an in-process shard gives."""

    lease_id: int
    checksums: np.ndarray
    """[n] uint64, as PageViews."""
    directory: str
    segment_names: list[str]
    """The shard's segment files, in arena order (`segment_of` indexes this list)."""
    segment_of: np.ndarray
    offsets: np.ndarray
    nbytes: np.ndarray
    """[n] int64: each page's size, -1 where the shard has no page."""
    loose: dict[int, np.ndarray] = field(default_factory=dict)
    """Pages held outside the arena (it was full, or read back from disk): their bytes, copied."""

    def mapped(self) -> PageViews:
        used = set(self.segment_of[self.segment_of >= 0].tolist())  # map only the files read
        segments = [shared_segments.map_segment(self.directory, name) if i in used else np.empty(0, np.uint8)
                    for i, name in enumerate(self.segment_names)]
        return PageViews(self.lease_id, self.checksums, segments, self.segment_of, self.offsets, self.nbytes,
                         self.loose)
