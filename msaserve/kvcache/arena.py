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
- Every slot has an `id`, and the arena keeps each id's segment, offset, size and readers in
  arrays, so that many slots are held and released by id in one numpy call (`acquire_ids`,
  `release_ids`: a million-token session's K/V lease is 32K slots) and described the same way
  (`where`). An id is reused with its slot.
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
    id: int = -1
    """Index of this slot in the arena's arrays (`PageArena.where`, `acquire_ids`)."""
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
        self._free: dict[int, list[tuple[int, int, int]]] = {}  # slot bytes → heap of (segment, offset, id)
        self._end = 0  # first unused byte of the newest segment
        self.stats = ArenaStats()
        # Per slot id: where it lies, its size, how many readers hold it; ids of freed slots that
        # readers still hold (retired) map to their slot.
        self._segment_of = np.zeros(0, np.int64)
        self._offset_of = np.zeros(0, np.int64)
        self._nbytes_of = np.zeros(0, np.int64)
        self.readers = np.zeros(0, np.int32)
        self._retired: dict[int, Slot] = {}
        self._mark = np.zeros(0, np.int64)  # scratch of `_add_readers`
        self._next_id = 0

    def allocate(self, nbytes: int) -> Slot | None:
        """A slot of nbytes (rounded up to ALIGN), or None when none fits."""
        size = -(-nbytes // ALIGN) * ALIGN
        heap = self._free.get(size)
        if heap:
            segment, offset, slot_id = heapq.heappop(heap)
            self.stats.reused_slots += 1
            return self._taken(Slot(segment, offset, nbytes, slot_id))
        full = not self.segments or self._end + size > len(self.segments[-1])
        if full and not self._grow(size):
            return None
        slot = Slot(len(self.segments) - 1, self._end, nbytes, self._new_id())
        self._end += size
        return self._taken(slot)

    def _new_id(self) -> int:
        slot_id, self._next_id = self._next_id, self._next_id + 1
        if slot_id == len(self.readers):  # grow the per-id arrays (doubling)
            size = max(1024, 2 * len(self.readers))
            for name in ("_segment_of", "_offset_of", "_nbytes_of", "readers"):
                old = getattr(self, name)
                new = np.zeros(size, old.dtype)
                new[: len(old)] = old
                setattr(self, name, new)
        return slot_id

    def where(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(segment, byte offset, nbytes) of each slot id (int64 arrays; ids must be valid)."""
        return self._segment_of[ids], self._offset_of[ids], self._nbytes_of[ids]

    def view(self, slot: Slot) -> np.ndarray:
        """The slot's bytes: [nbytes] uint8, a view of its segment."""
        return self.segments[slot.segment][slot.offset : slot.offset + slot.nbytes]

    def free(self, slot: Slot) -> None:
        """The tier no longer holds the slot's page; reused once no reader holds it."""
        if slot.freed:
            raise ValueError(f"arena slot at segment {slot.segment} offset {slot.offset} freed twice")
        slot.freed = True
        if self.readers[slot.id]:
            self.stats.retired_slots += 1
            self._retired[slot.id] = slot
        else:
            self._recycle(slot)

    def acquire(self, slot: Slot) -> None:
        """A reader holds the slot's bytes (they stay as they are until `release`)."""
        if slot.freed:
            raise ValueError("a freed arena slot cannot be acquired")
        self.readers[slot.id] += 1

    def release(self, slot: Slot) -> None:
        readers = self.readers
        if readers[slot.id] <= 0:
            raise ValueError(f"arena slot at segment {slot.segment} offset {slot.offset} released more "
                             "often than acquired")
        readers[slot.id] -= 1
        if readers[slot.id] == 0 and slot.freed:
            del self._retired[slot.id]
            self.stats.retired_slots -= 1
            self._recycle(slot)

    def acquire_ids(self, ids: np.ndarray) -> None:
        """`acquire` of the slots with these ids (slots the tier holds: none freed), in one call."""
        self._add_readers(np.asarray(ids, np.int64), 1)

    def _add_readers(self, ids: np.ndarray, delta: int) -> None:
        """readers[ids] += delta, an id listed k times counted k times (np.add.at), at the cost of
        plain indexing when no id repeats (as in a lease of distinct pages: 10x faster)."""
        positions = np.arange(len(ids))
        if len(self._mark) != len(self.readers):
            self._mark = np.zeros(len(self.readers), np.int64)
        self._mark[ids] = positions
        if (self._mark[ids] == positions).all():  # every id once
            self.readers[ids] += delta
        else:
            np.add.at(self.readers, ids, delta)

    def release_ids(self, ids: np.ndarray) -> None:
        """`release` of the slots with these ids, in one call (an id twice: released twice)."""
        ids = np.asarray(ids, np.int64)
        self._add_readers(ids, -1)
        if (self.readers[ids] < 0).any():
            bad = ids[self.readers[ids] < 0]
            self._add_readers(ids, 1)  # as it was
            raise ValueError(f"arena slots {bad[:8].tolist()} released more often than acquired")
        if self._retired:
            for slot_id in np.unique(ids[self.readers[ids] == 0]).tolist():
                slot = self._retired.pop(slot_id, None)
                if slot is not None:
                    self.stats.retired_slots -= 1
                    self._recycle(slot)

    def _taken(self, slot: Slot) -> Slot:
        self.stats.slots_in_use += 1
        self.stats.bytes_in_use += slot.nbytes
        self._segment_of[slot.id], self._offset_of[slot.id] = slot.segment, slot.offset
        self._nbytes_of[slot.id] = slot.nbytes
        return slot

    def _recycle(self, slot: Slot) -> None:
        self.stats.slots_in_use -= 1
        self.stats.bytes_in_use -= slot.nbytes
        size = -(-slot.nbytes // ALIGN) * ALIGN
        heapq.heappush(self._free.setdefault(size, []), (slot.segment, slot.offset, slot.id))

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
