"""Adoption's index load from shards in this process (`engine/kv/direct_index.py`): the stored
pages copied straight from the service's arena, each verified against its stored checksum, only
the verified prefix imported, the lease ended."""

import numpy as np
import pytest
import torch

from msaserve.engine.kv.direct_index import load_index_leased, runs_of
from msaserve.engine.kv.pages import PageCodec, identity_for
from msaserve.kvcache.arena import numpy_segment
from msaserve.kvcache.client import KVCacheClient, ServiceUnavailable
from msaserve.kvcache.config import ServiceConfig
from msaserve.kvcache.keys import index_key, shard_of_page
from msaserve.models.cache import allocate_caches
from msaserve.models.presets import get_preset

PAGES = 40


def stored(arena: bool = True):
    """(client, codec, hashes, payloads): PAGES index pages of `tiny` in 3 in-process shards."""
    config = get_preset("tiny")
    identity = identity_for(config, "tiny@direct", torch.float32)
    allocators = {"index": numpy_segment} if arena else None
    client = KVCacheClient.in_process(ServiceConfig(num_shards=3, memory_bytes=64 << 20), identity,
                                      segment_allocators=allocators)
    codec = PageCodec(identity)
    rng = np.random.default_rng(0)
    hashes = [int(h) for h in rng.integers(1, 2**62, PAGES)]
    payloads = rng.integers(0, 256, (PAGES, codec.index_bytes), dtype=np.uint8)
    client.put_pages([(h, None, payloads[i]) for i, h in enumerate(hashes)])
    return config, client, codec, hashes, payloads


def index_pages(codec: PageCodec, caches, pages: range) -> np.ndarray:
    """[len(pages), index bytes]: the caches' index pages as payload bytes (every layer)."""
    ix = torch.stack([c.index_cache[list(pages)] for c in caches], dim=1)
    return ix.contiguous().view(torch.uint8).reshape(len(pages), -1).numpy()


def test_pages_come_straight_from_the_arena_in_runs_verified_into_their_cache_pages():
    config, client, codec, hashes, payloads = stored()
    assert client.arena_stores() == {"index"}  # what adoption on CUDA asks before leasing
    lease = client.lease_index_async(hashes).result()
    shard = client.shards[shard_of_page(hashes[0], 3)]
    key = index_key(client.model_key, hashes[0])
    assert np.shares_memory(lease.views[0], shard.stores["index"].memory.get(key).payload)  # zero-copy
    # Written in order, each shard's pages lie side by side: one run (one copy) per shard.
    _, runs = runs_of(lease.segment_of, lease.offsets, codec.index_bytes)
    assert len(runs) == 3 and sum(count for _, count, _, _ in runs) == PAGES
    lease.release()
    caches = allocate_caches(config, PAGES + 8, "cpu", torch.float32)
    physical = torch.arange(PAGES) + 8  # page i → cache page i + 8
    assert load_index_leased(client, hashes, codec, caches, physical, group_pages=16) == PAGES
    assert np.array_equal(index_pages(codec, caches, range(8, PAGES + 8)), payloads)
    for stats in client.stats():
        assert stats["open_leases"] == 0 and stats["index"]["arena_retired_slots"] == 0
        assert stats["index"]["arena_segments"] == 1


@pytest.mark.parametrize("check_on", ["host", "device"])
def test_a_corrupt_arena_page_ends_the_load_there_and_is_dropped_by_its_shard(check_on):
    """On the host the checks come before the scatter: nothing past the bad page is imported. On
    the device (CUDA's default; here the same code with the host's digests) the scatter does not
    wait: pages past it may be written, but the load counts only the verified prefix."""
    config, client, codec, hashes, payloads = stored()
    bad = 21
    shard = client.shards[shard_of_page(hashes[bad], 3)]
    store = shard.stores["index"]
    store.memory.get(index_key(client.model_key, hashes[bad])).payload[7] ^= 0x10
    caches = allocate_caches(config, PAGES, "cpu", torch.float32)
    usable = load_index_leased(client, hashes, codec, caches, torch.arange(PAGES), group_pages=16,
                               check_on=check_on)
    assert usable == bad
    assert np.array_equal(index_pages(codec, caches, range(bad)), payloads[:bad])
    if check_on == "host":
        assert not index_pages(codec, caches, range(bad, PAGES)).any()  # nothing after it imported
    assert store.stats.corruptions == 1 and client.get_index([hashes[bad]]) == [None]
    assert all(stats["open_leases"] == 0 for stats in client.stats())


def test_the_device_check_passes_intact_pages_and_rejects_an_unknown_place():
    config, client, codec, hashes, payloads = stored()
    caches = allocate_caches(config, PAGES, "cpu", torch.float32)
    assert load_index_leased(client, hashes, codec, caches, torch.arange(PAGES), group_pages=16,
                             check_on="device") == PAGES
    assert np.array_equal(index_pages(codec, caches, range(PAGES)), payloads)
    with pytest.raises(ValueError, match="check_on is 'gpu'"):
        load_index_leased(client, hashes, codec, caches, torch.arange(PAGES), check_on="gpu")


def test_pages_outside_an_arena_and_a_missing_page_take_the_same_path():
    config, client, codec, hashes, payloads = stored(arena=False)
    assert client.arena_stores() == frozenset()
    client.delete_pages([hashes[30]])
    caches = allocate_caches(config, PAGES, "cpu", torch.float32)
    lease = client.lease_index_async(hashes).result()
    assert (lease.segment_of == -1).all()
    lease.release()
    assert load_index_leased(client, hashes, codec, caches, torch.arange(PAGES), group_pages=16) == 30
    assert np.array_equal(index_pages(codec, caches, range(30)), payloads[:30])


def test_a_shard_that_stops_answering_keeps_the_groups_before_it_and_ends_every_lease():
    config, client, codec, hashes, payloads = stored()
    failing = client.shards[0]
    calls = []
    lease_index = failing.lease_index

    def answer_once(*args):
        calls.append(args)
        if len(calls) > 1:
            raise ServiceUnavailable("shard 0 restarting")
        return lease_index(*args)

    failing.lease_index = answer_once
    caches = allocate_caches(config, PAGES, "cpu", torch.float32)
    assert load_index_leased(client, hashes, codec, caches, torch.arange(PAGES), group_pages=16) == 16
    assert np.array_equal(index_pages(codec, caches, range(16)), payloads[:16])
    assert all(stats["open_leases"] == 0 for stats in client.stats())  # the other shards' too


def test_a_segment_allocated_as_a_tensor_gives_that_tensor_back():
    """The reader copies from the tensor the engine allocated (pinned on CUDA: a tensor made from
    the numpy view would not be known as pinned); plain segments get a tensor over their memory."""
    from msaserve.engine.kv.pinned_segments import segment_allocators, segment_tensor

    tensor_backed = torch.zeros(4096, dtype=torch.uint8).numpy()
    assert isinstance(tensor_backed.base, torch.Tensor)
    assert segment_tensor(tensor_backed) is tensor_backed.base
    plain = numpy_segment(4096)
    assert segment_tensor(plain).data_ptr() == plain.ctypes.data
    assert segment_allocators("cpu") is None  # plain pages off CUDA, as before
