"""The tiered page store without Ray: round trips, checksums, caps, pins, LRU and restarts."""

import numpy as np
import pytest

from msaserve.kvcache.store import CapacityError, PageStore

PAGE = 1000


def payload(seed: int, nbytes: int = PAGE) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def test_round_trip_memory_and_disk(tmp_path):
    store = PageStore(memory_bytes=3 * PAGE, disk_path=tmp_path, disk_bytes=100 * PAGE)
    for i in range(10):
        store.put(f"p{i}", payload(i))
    assert store.memory.bytes_used <= 3 * PAGE
    for i in reversed(range(10)):  # the newest three from memory, the rest from disk
        np.testing.assert_array_equal(store.get(f"p{i}"), payload(i))
    assert store.stats.hits_memory == 3 and store.stats.hits_disk == 7
    assert store.get("absent") is None and store.stats.misses == 1


def test_bytes_payloads_and_checksums_of_read_only_arrays():
    store = PageStore(memory_bytes=10 * PAGE)
    store.put("b", b"page bytes")
    read_only = np.frombuffer(payload(3).tobytes(), dtype=np.uint8)  # as the object store hands it over
    store.put("r", read_only)
    assert store.get("b").tobytes() == b"page bytes"
    np.testing.assert_array_equal(store.get("r"), payload(3))
    with pytest.raises(TypeError, match="1-D uint8"):
        store.put("bad", np.zeros(4, dtype=np.float32))


def test_put_copies_so_callers_may_reuse_buffers():
    store = PageStore(memory_bytes=10 * PAGE)
    buf = payload(1)
    store.put("a", buf)
    buf[:] = 0
    np.testing.assert_array_equal(store.get("a"), payload(1))


@pytest.mark.parametrize("offset", [0, 10, PAGE - 1])
def test_corrupt_file_on_disk_is_detected_and_never_served(tmp_path, offset):
    store = PageStore(memory_bytes=PAGE, disk_path=tmp_path, disk_bytes=10 * PAGE)
    store.put("victim", payload(7))
    store.put("other", payload(8))  # pushes "victim" out of memory: only the disk copy is left
    assert "victim" not in store.memory and "victim" in store.disk
    file = store.disk.file_of("victim")
    raw = bytearray(file.read_bytes())
    raw[len(raw) - PAGE + offset] ^= 0x01  # flip one bit of the payload
    file.write_bytes(bytes(raw))
    assert store.get("victim") is None
    assert store.stats.corruptions == 1 and store.stats.misses == 1
    assert not file.exists() and "victim" not in store.disk  # the corrupt copy is dropped
    assert store.get("victim") is None and store.stats.corruptions == 1  # a plain miss now
    np.testing.assert_array_equal(store.get("other"), payload(8))


def test_corrupt_memory_copy_falls_back_to_a_valid_disk_copy(tmp_path):
    store = PageStore(memory_bytes=10 * PAGE, disk_path=tmp_path, disk_bytes=10 * PAGE)
    store.put("a", payload(1))
    store.memory.get("a").payload[5] ^= 0xFF  # bit rot in host memory
    np.testing.assert_array_equal(store.get("a"), payload(1))
    assert store.stats.corruptions == 1 and store.stats.hits_disk == 1


def test_truncated_file_is_a_corruption(tmp_path):
    store = PageStore(memory_bytes=PAGE, disk_path=tmp_path, disk_bytes=10 * PAGE, write_through=True)
    store.put("a", payload(1))
    store.put("b", payload(2))
    file = store.disk.file_of("a")
    file.write_bytes(file.read_bytes()[:-10])
    assert store.get("a") is None and store.stats.corruptions == 1


def test_memory_cap_holds_at_every_step_under_many_puts(tmp_path):
    cap, disk_cap = 64 * 1024, 256 * 1024
    store = PageStore(memory_bytes=cap, disk_path=tmp_path, disk_bytes=disk_cap, write_through=False)
    rng = np.random.default_rng(0)
    for i in range(600):
        size = int(rng.integers(1, 8 * 1024))
        store.put(f"k{i % 150}", payload(i, size), pin=i % 97 == 0 and i < 300)
        if i % 3 == 0:
            store.get(f"k{int(rng.integers(0, 150))}")
        assert store.memory.bytes_used <= cap, i
        assert store.disk.bytes_used <= disk_cap, i
        assert store.memory.bytes_used == sum(p.payload.nbytes for p in store.memory._pages.values())
    assert store.stats.evictions_to_disk > 0 and store.stats.evictions_dropped > 0


def test_pinned_pages_are_never_evicted():
    store = PageStore(memory_bytes=5 * PAGE)
    store.put("pinned0", payload(0), pin=True)
    store.pin(["pinned1"])  # pinned before it arrives
    store.put("pinned1", payload(1))
    for i in range(50):
        store.put(f"x{i}", payload(100 + i))
    np.testing.assert_array_equal(store.get("pinned0"), payload(0))
    np.testing.assert_array_equal(store.get("pinned1"), payload(1))
    store.unpin(["pinned0"])
    for i in range(50, 60):
        store.put(f"x{i}", payload(100 + i))
    assert store.get("pinned0") is None and store.get("pinned1") is not None


def test_full_of_pinned_pages_raises_and_leaves_store_intact():
    store = PageStore(memory_bytes=2 * PAGE)
    store.put("a", payload(0), pin=True)
    store.put("b", payload(1), pin=True)
    with pytest.raises(CapacityError, match="pinned"):
        store.put("c", payload(2))
    assert store.memory.bytes_used == 2 * PAGE and store.get("a") is not None and store.get("b") is not None


def test_lru_order_memory_then_disk_then_dropped(tmp_path):
    store = PageStore(memory_bytes=2 * PAGE, disk_path=tmp_path, disk_bytes=2 * PAGE, write_through=False)
    store.put("a", payload(0))
    store.put("b", payload(1))
    store.get("a")  # "b" is now the least recently used
    store.put("c", payload(2))
    assert set(store.memory._pages) == {"a", "c"} and "b" in store.disk
    store.put("d", payload(3))  # evicts "a" to disk
    store.put("e", payload(4))  # evicts "c" to disk, and "b" (oldest on disk) is dropped
    assert "b" not in store.disk and "b" not in store.memory
    assert set(store.disk._sizes) == {"a", "c"}
    assert store.stats.evictions_to_disk == 3 and store.stats.evictions_dropped == 1
    assert store.get("b") is None


def test_disk_tier_survives_a_restart(tmp_path):
    first = PageStore(memory_bytes=2 * PAGE, disk_path=tmp_path, disk_bytes=50 * PAGE)
    for i in range(20):
        first.put(f"p{i}", payload(i))
    (tmp_path / ".tmp-123-junk.page").write_bytes(b"half-written")  # a crash mid-write
    del first
    second = PageStore(memory_bytes=2 * PAGE, disk_path=tmp_path, disk_bytes=50 * PAGE)
    assert second.disk.bytes_used == 20 * PAGE
    for i in range(20):
        np.testing.assert_array_equal(second.get(f"p{i}"), payload(i))
    assert not (tmp_path / ".tmp-123-junk.page").exists()


def test_restart_keeps_lru_order_from_file_times(tmp_path):
    first = PageStore(memory_bytes=PAGE, disk_path=tmp_path, disk_bytes=3 * PAGE)
    for key in ("a", "b", "c"):
        first.put(key, payload(ord(key)))
    first.get("a")  # touches a's file: b is the least recently used
    second = PageStore(memory_bytes=PAGE, disk_path=tmp_path, disk_bytes=3 * PAGE)
    second.put("d", payload(4))
    assert "b" not in second.disk and second.get("a") is not None


def test_a_new_tier_kind_is_one_class(tmp_path):
    """A third kind of tier joins the chain by registering one class: pages flow memory → the new
    tier → disk as each fills, every hit is counted for its tier, and a hit below memory comes
    back up."""
    from msaserve.kvcache.tiers import TIER_KINDS, MemoryTier, make_tier, register_tier

    @register_tier
    class SlowMemoryTier(MemoryTier):
        kind = "slow_memory"

    try:
        tiers = [make_tier("memory", capacity_bytes=2 * PAGE),
                 make_tier("slow_memory", capacity_bytes=2 * PAGE),
                 make_tier("disk", path=tmp_path, capacity_bytes=10 * PAGE)]
        store = PageStore(tiers=tiers, write_through=False)
        for i in range(6):
            store.put(f"p{i}", payload(i))
        assert [len(t) for t in store.tiers] == [2, 2, 2]
        assert store.stats.evictions_to_slow_memory == 4 and store.stats.evictions_to_disk == 2
        assert "p0" in store.tiers[2] and "p2" in store.tiers[1] and "p5" in store.tiers[0]
        assert np.array_equal(store.get("p0"), payload(0)) and np.array_equal(store.get("p3"), payload(3))
        assert store.stats.hits_disk == 1 and store.stats.hits_slow_memory == 1
        assert "p0" in store.tiers[0] and "p3" in store.tiers[0]  # promoted
        allowed = r"tier kind='tape' is invalid: allowed disk, memory, slow_memory"
        with pytest.raises(ValueError, match=allowed):
            make_tier("tape")
    finally:
        TIER_KINDS.pop("slow_memory")
