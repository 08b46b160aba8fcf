"""A tiered page store: host memory over an optional disk directory, with pins and LRU eviction.

What must stay true:
- every read verifies the xxh3 checksum stored with the page; a mismatch is a miss, counts one
  corruption and drops that copy (the other tier's copy may still be served after its own check);
- `memory.bytes_used ≤ memory.capacity_bytes` and `disk.bytes_used ≤ disk.capacity_bytes` after
  every call (a put that cannot fit without evicting pinned pages raises CapacityError);
- pinned pages (pin count > 0) are never evicted from the tier they are in;
- eviction goes memory → disk → dropped, least recently used first.

Pure Python: the Ray actor (`shard.py`) wraps it, and tests drive it directly.
"""

import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from msaserve.kvcache.codec import Payload, as_payload, checksum
from msaserve.kvcache.tiers import DiskTier, MemoryTier


class CapacityError(RuntimeError):
    """A page does not fit: the tiers are full of pinned pages (or it is larger than a tier)."""


@dataclass
class StoreStats:
    """Counters since the store was created (the shard turns them into metrics)."""

    hits_memory: int = 0
    hits_disk: int = 0
    misses: int = 0
    corruptions: int = 0
    evictions_to_disk: int = 0
    evictions_dropped: int = 0
    puts: int = 0
    bytes_written: int = 0
    bytes_read: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class PageStore:
    """Pages by string key. `write_through` also writes every put to disk at once (so a restart
    keeps it); otherwise pages reach disk only when evicted from memory."""

    def __init__(
        self,
        memory_bytes: int,
        disk_path: str | os.PathLike[str] | None = None,
        disk_bytes: int = 0,
        write_through: bool = True,
        fsync: bool = False,
    ) -> None:
        self.memory = MemoryTier(memory_bytes)
        has_disk = disk_path is not None and disk_bytes > 0
        self.disk = DiskTier(disk_path, disk_bytes, fsync) if has_disk else None
        self.write_through = write_through and self.disk is not None
        self.stats = StoreStats()
        self._pins: dict[str, int] = {}

    # ---- reads -------------------------------------------------------------------------------
    def get(self, key: str) -> Payload | None:
        """The page's bytes (read-only array when served from disk), or None on a miss."""
        page = self.memory.get(key)
        if page is not None:
            if checksum(page.payload) == page.checksum:
                self.stats.hits_memory += 1
                self.stats.bytes_read += page.payload.nbytes
                return page.payload
            self.memory.pop(key)
            self.stats.corruptions += 1
        if self.disk is not None:
            page = self.disk.get(key)
            if page is not None:
                if checksum(page.payload) == page.checksum:
                    self.stats.hits_disk += 1
                    self.stats.bytes_read += page.payload.nbytes
                    self._promote(key, page.payload, page.checksum)
                    return page.payload
                self.disk.pop(key)
                self.stats.corruptions += 1
        self.stats.misses += 1
        return None

    def get_many(self, keys: Sequence[str]) -> list[Payload | None]:
        return [self.get(key) for key in keys]

    def contains(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is held in some tier (not verified: a later get may still miss)."""
        return [key in self.memory or (self.disk is not None and key in self.disk) for key in keys]

    # ---- writes ------------------------------------------------------------------------------
    def put(self, key: str, data: Payload | bytes, pin: bool = False) -> None:
        """Store a page (copied: callers may reuse their buffer; object-store arguments are not
        held). pin=True also takes one pin on it."""
        payload = as_payload(data).copy()
        page_checksum = checksum(payload)
        if pin:
            self._pins[key] = self._pins.get(key, 0) + 1
        try:
            self._place(key, payload, page_checksum)
        except CapacityError:
            if pin:
                self._release_pin(key)
            raise
        self.stats.puts += 1
        self.stats.bytes_written += payload.nbytes

    def put_many(self, items: Iterable[tuple[str, Payload | bytes]], pin: bool = False) -> None:
        for key, data in items:
            self.put(key, data, pin)

    def delete(self, keys: Iterable[str]) -> None:
        """Remove pages from both tiers, pinned or not (pins on them are dropped too)."""
        for key in keys:
            self.memory.pop(key)
            if self.disk is not None:
                self.disk.pop(key)
            self._pins.pop(key, None)

    # ---- pins --------------------------------------------------------------------------------
    def pin(self, keys: Iterable[str]) -> None:
        """Take one pin per key (a key may be pinned before its page arrives)."""
        for key in keys:
            self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, keys: Iterable[str]) -> None:
        for key in keys:
            self._release_pin(key)

    def is_pinned(self, key: str) -> bool:
        return self._pins.get(key, 0) > 0

    def _release_pin(self, key: str) -> None:
        count = self._pins.get(key, 0)
        if count <= 1:
            self._pins.pop(key, None)
        else:
            self._pins[key] = count - 1

    # ---- placement and eviction --------------------------------------------------------------
    def _place(self, key: str, payload: Payload, page_checksum: int) -> None:
        on_disk = False
        if self.write_through and self._make_room_on_disk(payload.nbytes, exclude=key):
            self.disk.put(key, payload, page_checksum)
            on_disk = True
        if self._make_room_in_memory(payload.nbytes, exclude=key):
            self.memory.put(key, payload, page_checksum)
            return
        self.memory.pop(key)  # an older copy must not outlive the new one
        if on_disk:
            return
        if self.disk is not None and self._make_room_on_disk(payload.nbytes, exclude=key):
            self.disk.put(key, payload, page_checksum)
            return
        disk = f"disk {self.disk.bytes_used}/{self.disk.capacity_bytes} bytes" if self.disk else "no disk"
        raise CapacityError(
            f"page {key!r} of {payload.nbytes} bytes does not fit: memory {self.memory.bytes_used}"
            f"/{self.memory.capacity_bytes} bytes, {disk}, {len(self._pins)} pinned pages; "
            "unpin finished sessions or raise the capacity"
        )

    def _promote(self, key: str, payload: Payload, page_checksum: int) -> None:
        """Bring a disk hit back to memory when that needs no pinned page to move."""
        if self._make_room_in_memory(payload.nbytes, exclude=key):
            self.memory.put(key, payload, page_checksum)

    def _make_room_in_memory(self, nbytes: int, exclude: str) -> bool:
        """Evict unpinned LRU pages from memory (to disk where it fits) until nbytes fit."""
        freed_if_replaced = self.memory.nbytes(exclude) if exclude in self.memory else 0
        need = self.memory.bytes_used - freed_if_replaced + nbytes - self.memory.capacity_bytes
        if need <= 0:
            return True
        victims = self._victims(self.memory.lru_keys(), self.memory.nbytes, need, exclude)
        if victims is None:
            return False
        for victim in victims:
            page = self.memory.pop(victim)
            if self.disk is not None and victim in self.disk:
                self.stats.evictions_to_disk += 1  # already there (write-through)
            elif self.disk is not None and self._make_room_on_disk(page.payload.nbytes, victim, also=exclude):
                self.disk.put(victim, page.payload, page.checksum)
                self.stats.evictions_to_disk += 1
            else:
                self.stats.evictions_dropped += 1
        return True

    def _make_room_on_disk(self, nbytes: int, exclude: str, also: str | None = None) -> bool:
        """Drop unpinned LRU pages from disk until nbytes fit; `exclude` (the page being placed) and
        `also` (the page whose placement caused this demotion) are never chosen."""
        if self.disk is None:
            return False
        freed_if_replaced = self.disk.nbytes(exclude) if exclude in self.disk else 0
        need = self.disk.bytes_used - freed_if_replaced + nbytes - self.disk.capacity_bytes
        if need <= 0:
            return True
        victims = self._victims(self.disk.lru_keys(), self.disk.nbytes, need, exclude, also)
        if victims is None:
            return False
        for victim in victims:
            self.disk.pop(victim)
            if victim not in self.memory:
                self.stats.evictions_dropped += 1
        return True

    def _victims(
        self, lru_keys, nbytes_of, need: int, exclude: str, also: str | None = None
    ) -> list[str] | None:
        """The least recently used unpinned keys that free ≥ need bytes, or None if impossible
        (then nothing is evicted: a failed put leaves the store as it was)."""
        victims, freed = [], 0
        for key in lru_keys:
            if key in (exclude, also) or self.is_pinned(key):
                continue
            victims.append(key)
            freed += nbytes_of(key)
            if freed >= need:
                return victims
        return None
