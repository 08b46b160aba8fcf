"""The memory tier's page arena (`kvcache/arena.py`) and zero-copy leases (`PageStore.lease`):
slots reused after eviction and deletion, adjacency of pages written in order, bytes held while
leased, corrupt leased pages dropped when the reader reports them."""

import numpy as np
import pytest

from msaserve.kvcache.arena import PageArena, numpy_segment
from msaserve.kvcache.store import PageStore

PAGE = 256


def page(seed: int, nbytes: int = PAGE) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def arena_store(pages: int, segment_pages: int = 4) -> PageStore:
    store = PageStore(memory_bytes=pages * PAGE, segment_allocator=numpy_segment)
    store.memory.arena.segment_bytes = segment_pages * PAGE
    return store


def test_slots_are_carved_in_order_and_reused_lowest_address_first():
    arena = PageArena(8 * PAGE, segment_bytes=4 * PAGE)
    slots = [arena.allocate(PAGE) for _ in range(6)]
    assert [(s.segment, s.offset) for s in slots] == [(0, 0), (0, 256), (0, 512), (0, 768), (1, 0), (1, 256)]
    arena.free(slots[3])
    arena.free(slots[1])
    again = [arena.allocate(PAGE), arena.allocate(PAGE)]
    assert [(s.segment, s.offset) for s in again] == [(0, 256), (0, 768)]
    assert arena.stats.reused_slots == 2 and arena.stats.segments == 2
    assert arena.allocate(PAGE) is not None and arena.allocate(PAGE) is not None
    assert arena.allocate(PAGE) is None  # 8 pages of capacity, all in use
    with pytest.raises(ValueError, match="freed twice"):
        arena.free(slots[0]) or arena.free(slots[0])


def test_a_held_slot_retires_and_is_reused_only_after_its_release():
    arena = PageArena(2 * PAGE, segment_bytes=2 * PAGE)
    first = arena.allocate(PAGE)
    arena.acquire(first)
    arena.free(first)
    assert arena.stats.retired_slots == 1
    assert (arena.allocate(PAGE).offset, arena.allocate(PAGE)) == (256, None)  # not first's slot
    arena.release(first)
    assert arena.stats.retired_slots == 0 and arena.allocate(PAGE).offset == 0


def test_store_pages_live_in_the_arena_and_eviction_frees_their_slots_for_new_pages():
    store = arena_store(pages=4)
    for i in range(4):
        store.put(f"p{i}", page(i))
    offsets = [store.memory.get(f"p{i}").slot.offset for i in range(4)]
    assert offsets == [0, 256, 512, 768]  # written in order: adjacent
    store.put("p4", page(4))  # over capacity: p0 (least recently used) is evicted, its slot reused
    assert store.memory.get("p0") is None and store.memory.get("p4").slot.offset == 0
    store.delete(["p2"])
    store.put("p5", page(5))
    assert store.memory.get("p5").slot.offset == 512
    assert store.memory.arena.stats.segments == 1 and store.memory.bytes_used == 4 * PAGE
    for i in (1, 3, 4, 5):
        assert np.array_equal(store.get(f"p{i}"), page(i))


def test_a_page_that_finds_no_slot_is_kept_as_an_array_of_its_own():
    store = arena_store(pages=2)
    store.put("a", page(1))
    store.put("b", page(2))
    held = store.lease(["a", "b"])
    store.put("c", page(3))  # evicts a, whose slot a reader still holds: no slot is free
    assert store.memory.get("c").slot is None and np.array_equal(store.get("c"), page(3))
    store.release(held)
    store.put("d", page(4))  # evicts b; a's slot is free again
    assert store.memory.get("d").slot.offset == 0


def test_leased_bytes_stay_until_release_even_if_the_page_is_replaced_or_evicted():
    store = arena_store(pages=2)
    store.put("a", page(1))
    store.put("b", page(2))
    (leased_a, leased_b) = store.lease(["a", "b"])
    assert np.shares_memory(leased_a.payload, store.memory.get("a").payload)  # zero-copy
    store.put("a", page(3))  # replaced while leased
    store.put("c", page(4))  # evicts b while leased
    assert np.array_equal(leased_a.payload, page(1)) and np.array_equal(leased_b.payload, page(2))
    assert store.memory.arena.stats.retired_slots == 2
    store.release([leased_a, leased_b])
    assert store.memory.arena.stats.retired_slots == 0
    assert np.array_equal(store.get("a"), page(3)) and np.array_equal(store.get("c"), page(4))


def test_a_leased_page_reported_corrupt_is_dropped_and_counted_and_a_miss_is_none():
    store = arena_store(pages=4)
    store.put("a", page(1))
    leased, missing = store.lease(["a", "nope"])
    assert missing is None and store.stats.misses == 1
    leased.payload[0] ^= 1  # the reader's check fails
    store.drop_corrupt("a", leased)
    store.release([leased])
    assert store.get("a") is None and store.stats.corruptions == 1
