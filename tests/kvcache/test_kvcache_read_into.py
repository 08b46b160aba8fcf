"""Reads straight into chosen rows of the reader's buffer (`KVCacheClient.get_kv_into_async`,
`PageStore.read_into`): what a sparse-resident session's pinned host tier receives from the service
with no staging copy. Each page is copied into its row and verified there."""

import numpy as np
import pytest

from msaserve.kvcache.client import KVCacheClient
from msaserve.kvcache.config import ServiceConfig
from msaserve.kvcache.keys import ModelIdentity, kv_key, shard_of_page
from msaserve.kvcache.store import PageStore
from msaserve.kvcache.transport import LocalTransport

MODEL = ModelIdentity("tiny@test", num_layers=2, page_size=4, num_kv_heads=2, head_dim=8,
                      num_index_heads=1, index_dim=8, kv_dtype="float32", index_dtype="float32")
KV_BYTES = 2 * 4 * 2 * 8 * 4


def kv(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, KV_BYTES, dtype=np.uint8)


def stored_client(shared: bool) -> KVCacheClient:
    """Three shards holding pages 0..9 (K/V of 2 layers); page 4 layer 1 corrupt in memory.
    shared=False: the shards answer as if in another process (packed rows, scattered by the client)."""
    client = KVCacheClient.in_process(ServiceConfig(num_shards=3, memory_bytes=1 << 20), MODEL)
    if not shared:
        transport = LocalTransport(client.shards)
        transport.shares_memory = False
        client = KVCacheClient(client.shards, MODEL, transport)
    client.put_pages([(h, [kv(2 * h), kv(2 * h + 1)], None) for h in range(10)])
    shard = client.shards[shard_of_page(4, 3)]
    shard.stores["kv"].memory.get(kv_key(MODEL.key, 4, 1)).payload[3] ^= 1
    return client


@pytest.mark.parametrize("shared", [True, False], ids=["in-process", "other-process"])
def test_pages_land_in_their_rows_verified_and_bad_ones_are_zero_rows(shared):
    client = stored_client(shared)
    requests = [(7, 0), (4, 1), (2, 1), (99, 0), (0, 0), (4, 0)]  # 4/1 corrupt, 99 never stored
    rows = [11, 3, 0, 8, 5, 14]
    dest = np.full((16, KV_BYTES), 7, dtype=np.uint8)
    ok = client.get_kv_into_async(requests, dest, rows).result()
    assert ok == [True, False, True, False, True, True]
    for (h, layer), row, good in zip(requests, rows, ok, strict=True):
        if good:
            np.testing.assert_array_equal(dest[row], kv(2 * h + layer))
        else:
            assert not dest[row].any()  # never the bytes of a bad page
    untouched = sorted(set(range(16)) - set(rows))
    assert (dest[untouched] == 7).all()
    # The corrupt copy was dropped: a second read misses it instead of serving it.
    assert client.get_kv([(4, 1)]) == [None]


def test_read_into_refuses_rows_that_do_not_fit_the_buffer():
    client = stored_client(shared=True)
    dest = np.zeros((4, KV_BYTES), dtype=np.uint8)
    with pytest.raises(ValueError, match=r"rows must give each of the 2 requests a row of dest \(0..3\)"):
        client.get_kv_into_async([(1, 0), (2, 0)], dest, [0, 4])
    with pytest.raises(ValueError, match="dest must be a C-contiguous uint8 array"):
        client.get_kv_into_async([(1, 0)], dest[:, ::2], [0])


def test_store_read_into_counts_like_get_and_refuses_a_layout_mismatch():
    store = PageStore(memory_bytes=1 << 20)
    store.put("a", kv(1))
    store.put("b", kv(2))
    store.memory.get("b").payload[0] ^= 1
    dest = np.zeros((3, KV_BYTES), dtype=np.uint8)
    assert store.read_into(["a", "b", "c"], dest, [2, 0, 1]) == [True, False, False]
    np.testing.assert_array_equal(dest[2], kv(1))
    assert (store.stats.hits_memory, store.stats.corruptions, store.stats.misses) == (1, 1, 2)
    with pytest.raises(ValueError, match=f"has {KV_BYTES} bytes; the reader's layout needs 64"):
        store.read_into(["a"], np.zeros((1, 64), dtype=np.uint8), [0])
