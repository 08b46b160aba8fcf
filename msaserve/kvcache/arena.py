"""Page memory of a memory tier: large segments allocated once, pages placed in slots of them.

Why: a reader in the same process (an engine adopting a session) can then copy pages to a GPU
straight from the service's memory, when the segments are pinned host memory (the engine hands
the shards a pinned allocator; the service imports no torch), and pages of one session written in
order lie next to each other, so a run of them is one host→device copy.

- Segments (`segment_bytes` each, the last one possibly smaller) come from `allocate(nbytes)` on
  demand, up to `capacity_bytes` in all, and are never given back.
- A slot is `nbytes` bytes at an aligned offset of one segment. Freed slots are kept per size and
  reused lowest address first (so a session written again after an eviction lands in order too);
  new slots are carved from the end of the newest segment.
- A slot that a reader holds (`acquire`: a zero-copy read in flight) is not reused when the tier
  frees it: it retires, and becomes free when the last reader `release`s it. So the bytes a reader
  verifies are the bytes it copies.
- `allocate` returns None when no slot fits, or the allocator cannot give a new segment (the tier
  then keeps that page in plain memory).

Not thread-safe: the shard's one worker thread (or Ray actor) makes every call.
"""

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

SegmentAllocator = Callable[[int], np.ndarray]
"""nbytes → a new 1-D uint8 array of that many bytes (pinned host memory when a GPU reads it)."""

SEGMENT_BYTES = 64 << 20
ALIGN = 64
"""Slot offsets and sizes are multiples of this (cache lines; pages are multiples of it anyway)."""


def numpy_segment(nbytes: int) -> np.ndarray:
    """The plain allocator: ordinary (pageable) host memory."""
    return np.empty(nbytes, dtype=np.uint8)


@dataclass(eq=False)
class Slot:
    segment: int
    offset: int
    nbytes: int
    readers: int = 0
    freed: bool = False
    """The tier let go of it while readers held it: free once they release it."""


@dataclass
class ArenaStats:
    segments: int = 0
    reserved_bytes: int = 0
    slots_in_use: int = 0
    bytes_in_use: int = 0
    reused_slots: int = 0
    retired_slots: int = field(default=0)
    """Slots freed by the tier but still held by a reader."""
    failed_segments: int = 0
    """Segments the allocator could not give (the pages went to plain memory)."""


class PageArena:
    def __init__(self, capacity_bytes: int, allocate: SegmentAllocator = numpy_segment,
                 segment_bytes: int = SEGMENT_BYTES) -> None:
        if capacity_bytes < 0 or segment_bytes < ALIGN:
            raise ValueError(f"arena capacity_bytes={capacity_bytes} must be ≥ 0 and segment_bytes="
                             f"{segment_bytes} ≥ {ALIGN}")
        self.capacity_bytes, self.segment_bytes = capacity_bytes, segment_bytes
        self._allocate = allocate
        self.segments: list[np.ndarray] = []
        """The segments, in allocation order (a slot's `segment` indexes this list)."""
        self._free: dict[int, list[tuple[int, int]]] = {}  # slot bytes → heap of (segment, offset)
        self._end = 0  # first unused byte of the newest segment
        self.stats = ArenaStats()

    def allocate(self, nbytes: int) -> Slot | None:
        """A slot of nbytes (rounded up to ALIGN), or None when none fits."""
        size = -(-nbytes // ALIGN) * ALIGN
        heap = self._free.get(size)
        if heap:
            segment, offset = heapq.heappop(heap)
            self.stats.reused_slots += 1
            return self._taken(Slot(segment, offset, nbytes))
        full = not self.segments or self._end + size > len(self.segments[-1])
        if full and not self._grow(size):
            return None
        slot = Slot(len(self.segments) - 1, self._end, nbytes)
        self._end += size
        return self._taken(slot)

    def view(self, slot: Slot) -> np.ndarray:
        """The slot's bytes: [nbytes] uint8, a view of its segment."""
        return self.segments[slot.segment][slot.offset : slot.offset + slot.nbytes]

    def free(self, slot: Slot) -> None:
        """The tier no longer holds the slot's page; reused once no reader holds it."""
        if slot.freed:
            raise ValueError(f"arena slot at segment {slot.segment} offset {slot.offset} freed twice")
        slot.freed = True
        if slot.readers:
            self.stats.retired_slots += 1
        else:
            self._recycle(slot)

    def acquire(self, slot: Slot) -> None:
        """A reader holds the slot's bytes (they stay as they are until `release`)."""
        if slot.freed:
            raise ValueError("a freed arena slot cannot be acquired")
        slot.readers += 1

    def release(self, slot: Slot) -> None:
        if slot.readers <= 0:
            raise ValueError(f"arena slot at segment {slot.segment} offset {slot.offset} released more "
                             "often than acquired")
        slot.readers -= 1
        if slot.readers == 0 and slot.freed:
            self.stats.retired_slots -= 1
            self._recycle(slot)

    def _taken(self, slot: Slot) -> Slot:
        self.stats.slots_in_use += 1
        self.stats.bytes_in_use += slot.nbytes
        return slot

    def _recycle(self, slot: Slot) -> None:
        self.stats.slots_in_use -= 1
        self.stats.bytes_in_use -= slot.nbytes
        size = -(-slot.nbytes // ALIGN) * ALIGN
        heapq.heappush(self._free.setdefault(size, []), (slot.segment, slot.offset))

    def _grow(self, size: int) -> bool:
        """A new segment for a slot of `size` bytes, if the capacity allows one."""
        room = self.capacity_bytes - self.stats.reserved_bytes
        nbytes = min(max(self.segment_bytes, size), room)
        if nbytes < size:
            return False
        try:
            segment = self._allocate(nbytes)
        except (OSError, MemoryError):  # e.g. a shared-memory directory without room for it
            self.stats.failed_segments += 1
            return False
        if segment.dtype != np.uint8 or segment.ndim != 1 or segment.nbytes != nbytes:
            raise ValueError(f"the arena's segment allocator returned {segment.dtype} {segment.shape}; "
                             f"allowed a 1-D uint8 array of {nbytes} bytes")
        self.segments.append(segment)
        self._end = 0
        self.stats.segments += 1
        self.stats.reserved_bytes += nbytes
        return True
