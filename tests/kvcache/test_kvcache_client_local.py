"""The client over in-process shards (no Ray): routing, batching, sessions, restart, swap protocol."""

import numpy as np
import pytest
import torch

from msaserve.engine.kv.service_swap import ServiceSwapStore
from msaserve.kvcache.client import KVCacheClient
from msaserve.kvcache.config import ServiceConfig
from msaserve.kvcache.keys import ModelIdentity, index_key, shard_of_page
from msaserve.kvcache.session_records import SessionNotFound, SessionRecord

MODEL = ModelIdentity("tiny@test", num_layers=2, page_size=4, num_kv_heads=2, head_dim=8,
                      num_index_heads=1, index_dim=8, kv_dtype="float32", index_dtype="float32")


def kv(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, 2 * 4 * 2 * 8 * 4, dtype=np.uint8)


def test_round_trip_routes_every_page_to_its_shard(tmp_path):
    config = ServiceConfig(num_shards=3, memory_bytes=1 << 20, disk_path=str(tmp_path), disk_bytes=1 << 22)
    client = KVCacheClient.in_process(config, MODEL)
    hashes = [*range(20), (1 << 64) - 1]
    client.put_pages([(h, [kv(2 * h), kv(2 * h + 1)], kv(h)[:256]) for h in hashes])
    requests = [(h, layer) for h in reversed(hashes) for layer in (1, 0)]
    for (h, layer), got in zip(requests, client.get_kv(requests), strict=True):
        np.testing.assert_array_equal(got, kv(2 * h + layer))
    for shard in client.shards:  # the page lives on hash % num_shards, and only there
        held = {h for h in hashes if shard.has_pages(MODEL.key, [h], 2)[0]}
        assert held == {h for h in hashes if shard_of_page(h, 3) == shard.shard_id}


def test_sessions_and_pins_survive_new_shards_over_the_same_disk(tmp_path):
    config = ServiceConfig(num_shards=2, memory_bytes=1 << 20, disk_path=str(tmp_path), disk_bytes=1 << 22)
    client = KVCacheClient.in_process(config, MODEL)
    client.put_pages([(5, [kv(0), kv(1)], kv(2)[:256])])
    client.put_session(SessionRecord("s", MODEL, token_ids=[1, 2, 3, 4, 5], page_hashes=[5], pinned=True))
    client.append_session("s", [6], [], {"generated": 1})
    restarted = KVCacheClient.in_process(config, MODEL)  # "restart": new shard objects, same path
    assert restarted.get_session("s").token_ids == [1, 2, 3, 4, 5, 6]
    assert restarted.restore_pins() == 1
    holder = restarted.shards[shard_of_page(5, 2)]
    assert holder.stores["kv"].is_pinned(f"kv/{MODEL.key}/{5:016x}/0")
    np.testing.assert_array_equal(restarted.get_kv([(5, 1)])[0], kv(1))
    restarted.delete_session("s")
    with pytest.raises(SessionNotFound):
        restarted.get_session("s")


def test_swap_protocol_round_trip_and_full_service():
    client = KVCacheClient.in_process(ServiceConfig(num_shards=2, memory_bytes=1 << 20), MODEL)
    store = ServiceSwapStore(client)
    data = {
        "k": torch.randn(2, 3, 4, 2, 8), "v": torch.randn(2, 3, 4, 2, 8), "index": torch.randn(2, 3, 4, 1, 8),
    }
    assert store.put("req-1", data) and len(store) == 1
    back = store.pop("req-1")
    assert all(torch.equal(back[name], data[name]) for name in data) and len(store) == 0
    assert all(s.stats()["kv"]["memory_pages"] == 0 for s in client.shards)  # removed after pop
    tiny = KVCacheClient.in_process(ServiceConfig(num_shards=1, memory_bytes=4096), MODEL)
    assert not ServiceSwapStore(tiny).put("req-2", data)  # no room: the engine recomputes
    assert tiny.shards[0].stats()["kv"]["memory_pages"] == 0  # the part that fitted was dropped


def test_idle_sessions_release_their_pins_and_come_back_pinned():
    from msaserve.engine.kv.persist import SessionWriter

    client = KVCacheClient.in_process(ServiceConfig(num_shards=2, memory_bytes=1 << 20), MODEL)
    client.put_pages([(h, [kv(h), kv(h + 1)], kv(h + 2)[:256]) for h in (7, 8)])  # pinned by the record
    client.put_session(SessionRecord("idle", MODEL, list(range(8)), page_hashes=[7, 8], pinned=True))
    client.put_session(SessionRecord("busy", MODEL, token_ids=[1], page_hashes=[], pinned=True))
    other = ModelIdentity("other@test", **{k: v for k, v in MODEL.as_dict().items() if k != "name"})
    theirs = KVCacheClient(client.shards, other, client.transport)  # another model, same service
    theirs.put_session(SessionRecord("theirs", other, token_ids=[1], page_hashes=[], pinned=True))

    def pinned(h: int) -> bool:
        store = client.shards[shard_of_page(h, 2)].stores["kv"]
        return store.is_pinned(f"kv/{MODEL.key}/{h:016x}/0")

    assert pinned(7) and pinned(8)
    for shard in client.shards:  # "idle" was last updated an hour ago
        if "idle" in shard.sessions.session_ids():
            shard.sessions.get("idle").updated_at -= 3600
    assert client.unpin_idle_sessions(idle_s=600) == 1  # not "busy", not another model's
    assert not pinned(7) and not pinned(8) and not client.get_session("idle").pinned
    assert client.get_session("busy").pinned and theirs.get_session("theirs").pinned
    SessionWriter(client, "idle")  # the session comes back: one pin per page again
    assert pinned(7) and pinned(8) and client.get_session("idle").pinned
    client.delete_session("idle")  # and DELETE releases exactly that pin
    assert not pinned(7) and not pinned(8)


def test_packed_reads_fill_the_rows_of_each_item_and_flag_what_is_missing_or_corrupt(tmp_path):
    config = ServiceConfig(num_shards=3, memory_bytes=1 << 20)
    client = KVCacheClient.in_process(config, MODEL)
    hashes = list(range(1, 12))
    client.put_pages([(h, [kv(2 * h), kv(2 * h + 1)], kv(h)[:256]) for h in hashes])
    shard = client.shards[shard_of_page(4, 3)]
    shard.stores["index"].memory.get(index_key(MODEL.key, 4)).payload[0] ^= 1  # flip a bit in place
    asked = [9, 4, 100, *hashes]  # 4 is corrupt, 100 was never stored
    out = np.full((len(asked), 256), 7, dtype=np.uint8)
    fetch = client.get_index_packed_async(asked, out)
    ok = fetch.result()
    assert ok == [h not in (4, 100) for h in asked]
    assert sorted(fetch.rows.tolist()) == list(range(len(asked)))  # every item has its own row
    for item, h in enumerate(asked):
        row = out[fetch.rows[item]]
        if ok[item]:
            np.testing.assert_array_equal(row, kv(h)[:256])
        else:
            assert not row.any()  # never the bytes of a bad page
    requests = [(h, layer) for h in hashes for layer in (0, 1)]
    kv_out = np.empty((len(requests), kv(0).nbytes), dtype=np.uint8)
    fetch = client.get_kv_packed_async(requests, kv_out)
    assert all(fetch.result())
    for item, (h, layer) in enumerate(requests):
        np.testing.assert_array_equal(kv_out[fetch.rows[item]], kv(2 * h + layer))


def test_packed_reads_refuse_a_buffer_of_the_wrong_shape_or_row_size():
    client = KVCacheClient.in_process(ServiceConfig(num_shards=2, memory_bytes=1 << 20), MODEL)
    client.put_pages([(1, None, kv(1)[:256])])
    with pytest.raises(ValueError, match=r"out must be a uint8 array \[1, row bytes\], got uint8 \(2, 256\)"):
        client.get_index_packed_async([1], np.empty((2, 256), np.uint8))
    with pytest.raises(ValueError, match="has 256 bytes; the reader's layout needs 128"):
        client.get_index_packed_async([1], np.empty((1, 128), np.uint8)).result()


def test_session_head_and_tokens_are_the_record_split_in_two(tmp_path):
    config = ServiceConfig(num_shards=2, memory_bytes=1 << 20, disk_path=str(tmp_path), disk_bytes=1 << 22)
    client = KVCacheClient.in_process(config, MODEL)
    client.put_session(SessionRecord("s", MODEL, token_ids=[9, 8, 7, 6, 5], page_hashes=[3], tail_hash=11,
                                     tail_tokens=1))
    client.append_session("s", [4, 3, 2], [12], tail=(None, 0))
    tokens = client.get_session_tokens_async("s")
    head = client.get_session_head("s")
    assert head.tokens_omitted and head.token_ids == [] and head.page_hashes == [3, 12]
    assert head.tail_hash is None and head.num_stored_tokens == 8
    got = tokens.result()
    assert got.dtype == np.int64 and got.tolist() == [9, 8, 7, 6, 5, 4, 3, 2]
    got[0] = -1  # the caller's copy: the service's tokens stay as they were
    whole = client.get_session("s")
    assert whole.token_ids == [9, 8, 7, 6, 5, 4, 3, 2] and not whole.tokens_omitted
    restarted = KVCacheClient.in_process(config, MODEL)  # tokens read back from disk
    assert restarted.get_session_tokens_async("s").result().tolist() == [9, 8, 7, 6, 5, 4, 3, 2]
    with pytest.raises(ValueError, match="tokens_omitted"):  # a head is never stored back
        client.put_session(head)
    with pytest.raises(SessionNotFound):
        client.get_session("nobody")
    with pytest.raises(SessionNotFound):
        client.get_session_tokens_async("nobody").result()


def test_many_pages_route_as_one_page_does():
    """The vectorised routing of large requests (≥ 256 hashes) gives every page the shard
    `shard_of_page` gives it, groups in order of first appearance, positions ascending."""
    import random

    from msaserve.kvcache.keys import shards_of_pages

    rng = random.Random(0)
    hashes = [rng.getrandbits(64) for _ in range(700)]
    assert shards_of_pages(hashes, 5).tolist() == [shard_of_page(h, 5) for h in hashes]
    client = KVCacheClient.in_process(ServiceConfig(num_shards=5), MODEL)
    groups = client._by_shard(hashes)
    expected: dict[int, list[int]] = {}
    for i, h in enumerate(hashes):
        expected.setdefault(shard_of_page(h, 5), []).append(i)
    assert list(groups.items()) == list(expected.items())
