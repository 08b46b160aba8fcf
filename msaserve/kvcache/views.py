"""Zero-copy page reads for a reader in the shards' process (wire types of `lease_*` calls).

A shard answers a lease with the stored bytes themselves — views of its memory tier, whose pages
live in slots of an arena (`arena.py`) — and their stored checksums, instead of copies. The reader
verifies every page it uses against its checksum (off the copy's critical path) and must end the
lease (`KVCacheClient` leases do it in `release`), reporting the pages that failed; until then the
shard keeps those bytes as they are. Where a page lies in the arena (segment, offset) lets the
reader copy a run of adjacent pages to a device as one copy.
"""

from dataclasses import dataclass

import numpy as np


@dataclass
class PageViews:
    """One shard's answer to a lease of n pages."""

    lease_id: int
    views: list[np.ndarray | None]
    """[n] the stored bytes of each page (read-only by contract), None where the shard has none."""
    checksums: np.ndarray
    """[n] uint64: the xxh3_64 stored with each page (0 where missing)."""
    segments: list[np.ndarray]
    """The arena's segments (shared with the shard, not copied)."""
    segment_of: np.ndarray
    """[n] int64: the segment index of each page's bytes, -1 where they are not in the arena."""
    offsets: np.ndarray
    """[n] int64: byte offset of each page in its segment (0 where not in the arena)."""
