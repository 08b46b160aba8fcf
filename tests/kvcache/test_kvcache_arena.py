"""The memory tier's page arena (`kvcache/arena.py`) and zero-copy leases (`PageStore.lease`):
slots reused after eviction and deletion, adjacency of pages written in order, bytes held while
leased, corrupt leased pages dropped when the reader reports them."""

import numpy as np
import pytest

from msaserve.kvcache.arena import PageArena, numpy_segment
from msaserve.kvcache.keys import INDEX_GROUPS, KV_GROUPS, index_key, index_namespace, kv_key, kv_page_group
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


def test_slots_held_and_released_by_id_retire_and_recycle_like_single_ones():
    arena = PageArena(4 * PAGE, segment_bytes=4 * PAGE)
    slots = [arena.allocate(PAGE) for _ in range(3)]
    ids = np.array([s.id for s in slots] + [slots[0].id])  # slot 0 held twice
    arena.acquire_ids(ids)
    assert arena.readers[slots[0].id] == 2 and arena.readers[slots[2].id] == 1
    segment, offset, nbytes = arena.where(ids[:3])
    assert segment.tolist() == [0, 0, 0] and offset.tolist() == [0, 256, 512] and (nbytes == PAGE).all()
    arena.free(slots[0])
    assert arena.stats.retired_slots == 1
    arena.release_ids(ids[:3])  # slot 0 still held once
    assert arena.stats.retired_slots == 1 and arena.allocate(PAGE).offset == 768
    arena.release_ids(ids[3:])
    assert arena.stats.retired_slots == 0
    again = arena.allocate(PAGE)
    assert (again.offset, again.id) == (0, slots[0].id)  # the slot comes back with its id
    with pytest.raises(ValueError, match="released more often"):
        arena.release_ids(np.array([slots[1].id]))
    assert arena.readers[slots[1].id] == 0  # a refused release changes nothing


def grouped_store(pages: int) -> PageStore:
    store = PageStore(memory_bytes=pages * PAGE, segment_allocator=numpy_segment, key_groups=KV_GROUPS)
    store.memory.arena.segment_bytes = 4 * PAGE
    return store


PAGES = [kv_page_group("m", g) for g in (0, 1, 2, 9)]


def test_a_lease_of_whole_groups_holds_the_same_pages_a_lease_by_key_does():
    store = grouped_store(pages=16)
    for g in range(3):
        for m in range(2):
            store.put(kv_key("m", g, m), page(10 * g + m))
    store.put(kv_key("m", 2, 1), page(99))  # replaced: the group now names the new slot
    store.delete([kv_key("m", 1, 0)])  # missing member
    lease = store.lease_groups(PAGES, 2)
    by_key = store.lease(KV_GROUPS.join_all(PAGES, 2))
    arena = store.memory.arena
    for i, stored in enumerate(by_key):
        if stored is None:
            assert lease.ids[i] < 0
            continue
        assert lease.ids[i] == stored.slot.id and arena.readers[stored.slot.id] == 2
        assert store.memory.checksums_of(lease.ids[i : i + 1])[0] == stored.checksum
        segment, offset, nbytes = arena.where(lease.ids[i : i + 1])
        assert np.array_equal(arena.segments[segment[0]][offset[0] : offset[0] + nbytes[0]], stored.payload)
    assert lease.ids.tolist()[2:4] == [-1, by_key[3].slot.id] and lease.ids[6:].tolist() == [-1, -1]
    assert np.array_equal(store.get(kv_key("m", 2, 1)), page(99))
    store.release(by_key)
    store.release_groups(lease)
    assert arena.readers.sum() == 0


def test_a_group_lease_keeps_bytes_through_eviction_drops_reported_pages_and_touches_at_its_end():
    store = grouped_store(pages=4)
    for g in range(2):
        for m in range(2):
            store.put(kv_key("m", g, m), page(10 * g + m))
    lease = store.lease_groups([kv_page_group("m", 0)], 2)
    store.put(kv_key("m", 5, 0), page(50))  # evicts page 0's layer 0 (least recently used) while leased
    assert kv_key("m", 0, 0) not in store.memory and store.memory.arena.stats.retired_slots == 1
    segment, offset, nbytes = store.memory.arena.where(lease.ids[:1])
    assert np.array_equal(store.memory.arena.segments[segment[0]][offset[0] : offset[0] + nbytes[0]], page(0))
    store.release_groups(lease, corrupt=[1])  # page 0's layer 1 failed the reader's check
    assert kv_key("m", 0, 1) not in store.memory and store.stats.corruptions == 1
    assert store.memory.arena.stats.retired_slots == 0
    lease = store.lease_groups([kv_page_group("m", 1)], 2)
    store.put(kv_key("m", 6, 0), page(60))
    store.release_groups(lease)  # its pages count as used now: the next eviction takes another
    store.put(kv_key("m", 7, 0), page(70))
    assert kv_key("m", 1, 0) in store.memory and kv_key("m", 1, 1) in store.memory


def test_a_shards_kv_lease_of_whole_pages_reads_the_stored_bytes_wherever_they_are(tmp_path):
    """`KVCacheShard.lease_kv` through page groups: pages in the arena by one lookup per page, a page
    evicted to disk promoted and leased by key, a page outside the arena by its bytes, a missing one
    absent; every view is the stored bytes and every checksum the stored one; the release lets go
    of every slot."""
    from msaserve.kvcache.codec import checksum
    from msaserve.kvcache.config import ServiceConfig
    from msaserve.kvcache.shard import KVCacheShard

    layers, nbytes = 2, 1024
    config = ServiceConfig(num_shards=1, memory_bytes=12 * nbytes, disk_bytes=1 << 20,  # K/V: 7/8 of it
                           disk_path=str(tmp_path))
    shard = KVCacheShard(config, 0, publish_metrics=False, segment_allocators={"kv": numpy_segment})
    kv = {h: [page(10 * h + layer, nbytes) for layer in range(layers)] for h in range(6)}
    shard.put_pages("m", [(h, kv[h], None) for h in range(6)])
    store = shard.stores["kv"]
    assert kv_key("m", 0, 0) not in store.memory  # on disk (K/V memory: 10 items, 5 pages)
    held = shard.lease_kv("m", [1, 2, 3, 4, 5], layers)  # so no slot is free when page 0 comes back
    views = shard.lease_kv("m", [0, 3, 99, 5], layers)
    assert (views.segment_of[:2] < 0).all() and (views.segment_of[2:4] >= 0).all()
    for i, (h, layer) in enumerate((h, layer) for h in (0, 3, 99, 5) for layer in range(layers)):
        if h == 99:
            assert views.views[i] is None and views.nbytes[i] == -1
            continue
        assert np.array_equal(views.views[i], kv[h][layer]) and views.checksums[i] == checksum(kv[h][layer])
    assert views.nbytes[0] == nbytes and shard.open_lease_stores() == ["kv", "kv"]
    shard.release_lease(views.lease_id)
    shard.release_lease(held.lease_id)
    assert shard.stats()["open_leases"] == 0 and store.memory.arena.readers.sum() == 0


def test_a_shards_index_lease_by_group_reads_the_stored_bytes_wherever_they_are(tmp_path):
    """`KVCacheShard.lease_index` through `INDEX_GROUPS`: pages in the index arena by one lookup per
    page, a page evicted to disk promoted and leased by key, a missing one absent; every view is
    the stored bytes and every checksum the stored one; a page reported corrupt is dropped; the
    release lets go of every slot."""
    from msaserve.kvcache.codec import checksum
    from msaserve.kvcache.config import ServiceConfig
    from msaserve.kvcache.shard import KVCacheShard

    nbytes = 1024
    config = ServiceConfig(num_shards=1, memory_bytes=40 * nbytes, disk_bytes=1 << 20,  # index: 1/8 of it
                           disk_path=str(tmp_path))
    shard = KVCacheShard(config, 0, publish_metrics=False, segment_allocators={"index": numpy_segment})
    index = {h: page(100 + h, nbytes) for h in range(6)}
    shard.put_pages("m", [(h, None, index[h]) for h in range(6)])
    store = shard.stores["index"]
    assert store.memory.groups is INDEX_GROUPS
    assert index_key("m", 0) not in store.memory  # on disk (index memory: 5 pages)
    held = shard.lease_index("m", [1, 2, 3, 4, 5])  # so no slot is free when page 0 comes back
    views = shard.lease_index("m", [0, 3, 99, 5])
    assert views.segment_of[0] < 0 and (views.segment_of[[1, 3]] >= 0).all()
    for i, h in enumerate((0, 3, 99, 5)):
        if h == 99:
            assert views.views[i] is None and views.nbytes[i] == -1
            continue
        assert np.array_equal(views.views[i], index[h]) and views.checksums[i] == checksum(index[h])
    assert shard.open_lease_stores() == ["index", "index"]
    shard.release_lease(views.lease_id, corrupt=[1])  # page 3's bytes failed the reader's check
    shard.release_lease(held.lease_id)
    assert index_key("m", 3) not in store.memory and store.stats.corruptions == 1
    assert shard.stats()["open_leases"] == 0 and store.memory.arena.readers.sum() == 0


def test_index_keys_split_into_their_page_group_and_join_back_and_other_keys_have_none():
    key = index_key("model-a", 0xABC)
    assert INDEX_GROUPS.split(key) == ((index_namespace("model-a"), 0xABC), 0)
    assert INDEX_GROUPS.join(*INDEX_GROUPS.split(key)) == key
    assert INDEX_GROUPS.join_all([(index_namespace("model-a"), 1)], 1) == [index_key("model-a", 1)]
    for other in ("kv/model-a/0000000000000abc/3", "ix/m/00000000000000zz", "plain"):
        assert INDEX_GROUPS.split(other) is None
    with pytest.raises(ValueError, match="member=1 is invalid"):
        INDEX_GROUPS.join((index_namespace("m"), 1), 1)


def test_kv_keys_split_into_their_page_group_and_join_back_and_other_keys_have_none():
    key = kv_key("model-a", 0xABC, 3)
    assert KV_GROUPS.split(key) == (kv_page_group("model-a", 0xABC), 3)
    assert KV_GROUPS.join(*KV_GROUPS.split(key)) == key
    both = [kv_key("model-a", 1, 0), kv_key("model-a", 1, 1)]
    assert KV_GROUPS.join_all([kv_page_group("model-a", 1)], 2) == both
    for other in ("ix/model-a/0000000000000abc", "kv/m/0/0", "kv/m/00000000000000zz/1", "plain"):
        assert KV_GROUPS.split(other) is None
