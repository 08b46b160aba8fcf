"""The sharded Ray service on a real local Ray: round trips, routing, restarts, shared prefixes."""

import itertools

import numpy as np
import pytest
import ray

from msaserve.kvcache.client import KVCacheClient, start_shards
from msaserve.kvcache.config import ServiceConfig
from msaserve.kvcache.keys import IncompatibleModel, ModelIdentity, shard_of_page
from msaserve.kvcache.session import SessionNotFound, SessionRecord

MODEL = ModelIdentity("tiny@test", num_layers=2, page_size=4, num_kv_heads=2, head_dim=8,
                      num_index_heads=1, index_dim=8, kv_dtype="float32", index_dtype="float32")
_names = itertools.count()


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False,
             _node_ip_address="127.0.0.1", namespace="msaserve-kvcache-test")
    yield
    ray.shutdown()


@pytest.fixture
def service(ray_cluster, tmp_path):
    """Starts shards (with a disk tier under tmp_path) and kills them afterwards."""
    started = []

    def start(num_shards=3, memory_bytes=1 << 20, disk=True, prefix=None):
        config = ServiceConfig(
            num_shards=num_shards, memory_bytes=memory_bytes, disk_path=str(tmp_path) if disk else None,
            disk_bytes=8 << 20 if disk else 0, actor_name_prefix=prefix or f"kv{next(_names)}",
        )
        shards = start_shards(config)
        started.extend(shards)
        return config, shards

    yield start
    for shard in started:
        ray.kill(shard)


def kv(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, 2 * 4 * 2 * 8 * 4, dtype=np.uint8)


def index(seed: int) -> np.ndarray:
    return np.random.default_rng(seed + 10_000).integers(0, 256, 2 * 4 * 8 * 4, dtype=np.uint8)


def upload(client: KVCacheClient, hashes: list[int]) -> None:
    client.put_pages([(h, [kv(h * 2 + layer) for layer in range(2)], index(h)) for h in hashes])


def test_round_trip_and_shard_routing(service):
    _, shards = service(num_shards=3)
    client = KVCacheClient(shards, MODEL)
    hashes = [3 * i + r for i in range(4) for r in range(3)] + [(1 << 64) - 1]
    upload(client, hashes)
    got = client.get_kv([(h, layer) for h in hashes for layer in range(2)])
    for (h, layer), payload in zip([(h, layer) for h in hashes for layer in range(2)], got, strict=True):
        np.testing.assert_array_equal(payload, kv(h * 2 + layer))
    for h, payload in zip(hashes, client.get_index(hashes), strict=True):
        np.testing.assert_array_equal(payload, index(h))
    assert client.get_kv([(999, 0)]) == [None]
    assert client.has_pages([hashes[0], 999]) == [True, False]
    stats = client.stats()
    for shard_stats in stats:  # each page lives on exactly hash % num_shards
        expected = sum(1 for h in hashes if shard_of_page(h, 3) == shard_stats["shard"])
        assert shard_stats["index"]["memory_pages"] == expected
        assert shard_stats["kv"]["memory_pages"] == 2 * expected


def test_two_clients_share_a_prefix_page_by_hash(service):
    config, shards = service(num_shards=2)
    replica_a = KVCacheClient(shards, MODEL)
    replica_b = KVCacheClient.connect(config, MODEL)  # another replica finds the shards by name
    upload(replica_a, [41, 42])
    assert replica_b.has_pages([41, 42]) == [True, True]
    np.testing.assert_array_equal(replica_b.get_kv([(42, 1)])[0], kv(42 * 2 + 1))
    other_model = KVCacheClient(shards, ModelIdentity(**{**MODEL.as_dict(), "name": "other"}))
    assert other_model.has_pages([41]) == [False]  # same tokens, another model: not shared


def test_sessions_survive_a_service_restart_with_the_disk_tier(service):
    _, shards = service(num_shards=2, prefix="restart")
    client = KVCacheClient(shards, MODEL)
    upload(client, [7, 8])
    client.put_session(SessionRecord("chat-1", MODEL, token_ids=list(range(9)), page_hashes=[7, 8],
                                     sampling_state={"temperature": 0.0}, pinned=True))
    client.append_session("chat-1", [9, 10], [], {"temperature": 0.0, "generated": 2})
    for shard in shards:
        ray.kill(shard)
    _, restarted = service(num_shards=2, prefix="restart2")  # new actors, same disk path
    client = KVCacheClient(restarted, MODEL)
    record = client.get_session("chat-1")
    assert record.token_ids == list(range(11)) and record.page_hashes == [7, 8] and record.pinned
    assert record.sampling_state["generated"] == 2
    assert client.restore_pins() == 1
    np.testing.assert_array_equal(client.get_kv([(8, 1)])[0], kv(17))
    assert client.list_sessions() == ["chat-1"]
    client.delete_session("chat-1")
    with pytest.raises(SessionNotFound):
        client.get_session("chat-1")


def test_incompatible_replica_refuses_a_session(service):
    _, shards = service(num_shards=1, disk=False)
    KVCacheClient(shards, MODEL).put_session(SessionRecord("s", MODEL))
    other = ModelIdentity(**{**MODEL.as_dict(), "page_size": 8})
    with pytest.raises(IncompatibleModel, match="page_size"):
        KVCacheClient(shards, other).get_session("s")


def test_memory_cap_holds_under_load_through_the_service(service):
    _, shards = service(num_shards=2, memory_bytes=64 * 1024, disk=False)
    client = KVCacheClient(shards, MODEL)
    for start in range(0, 400, 40):
        upload(client, list(range(start, start + 40)))
        for s in client.stats():
            for store in ("kv", "index"):
                assert s[store]["memory_bytes"] <= s[store]["memory_capacity"]
    assert sum(s["kv"]["evictions_dropped"] for s in client.stats()) > 0
