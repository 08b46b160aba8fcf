"""Index arenas in shared-memory files (`kvcache/shared_segments.py`): an engine in another process
on the node leases the stored index pages in place (`lease_index_shared`) instead of packed reads.

Shards here run in this process behind a transport that behaves as another process would: it says
it shares no memory, and every answer crosses a pickle round trip (so a lease carries file names
and offsets, never arrays of the shard's memory). tests/kvcache/test_kvcache_service.py does the
same through real Ray actors."""

import pickle
import time

import numpy as np
import pytest
import torch

from msaserve.engine.kv.adoption import LazyPageFetcher
from msaserve.engine.kv.direct_index import load_index_leased
from msaserve.engine.kv.pages import PageCodec, identity_for
from msaserve.kvcache import shared_segments
from msaserve.kvcache.client import KVCacheClient
from msaserve.kvcache.config import ServiceConfig
from msaserve.kvcache.keys import index_key, shard_of_page
from msaserve.kvcache.session_records import SessionRecord
from msaserve.kvcache.shard import KVCacheShard
from msaserve.kvcache.shared_segments import SharedSegments, map_segment
from msaserve.kvcache.transport import LocalTransport
from msaserve.kvcache.views import SharedPageViews
from msaserve.models.cache import allocate_caches
from msaserve.models.presets import get_preset

PAGES = 40


class OtherProcess(LocalTransport):
    """LocalTransport as a shard in another process looks: no shared memory, answers pickled."""

    shares_memory = False

    def gather(self, futures, timeout_s=None):
        return [pickle.loads(pickle.dumps(answer)) for answer in super().gather(futures, timeout_s)]


def service(tmp_path, arena: bool = True, **config):
    """(model config, client, codec, shards, hashes, payloads): PAGES index pages of `tiny` in 3
    shards with shared index arenas under tmp_path, reached as from another process."""
    model = get_preset("tiny")
    identity = identity_for(model, "tiny@shared", torch.float32)
    settings = ServiceConfig(num_shards=3, memory_bytes=64 << 20, shared_index_arena=arena,
                             shared_directory=str(tmp_path), actor_name_prefix=f"t{tmp_path.name}", **config)
    shards = [KVCacheShard(settings, i, publish_metrics=False) for i in range(3)]
    client = KVCacheClient(shards, identity, OtherProcess(shards))
    codec = PageCodec(identity)
    rng = np.random.default_rng(0)
    hashes = [int(h) for h in rng.integers(1, 2**62, PAGES)]
    payloads = rng.integers(0, 256, (PAGES, codec.index_bytes), dtype=np.uint8)
    client.put_pages([(h, None, payloads[i]) for i, h in enumerate(hashes)])
    return model, client, codec, shards, hashes, payloads


def index_pages(codec: PageCodec, caches, pages: range) -> np.ndarray:
    ix = torch.stack([c.index_cache[list(pages)] for c in caches], dim=1)
    return ix.contiguous().view(torch.uint8).reshape(len(pages), -1).numpy()


def test_segments_are_files_another_mapping_sees_and_a_successor_cleans_up(tmp_path):
    segments = SharedSegments("msaserve-test", tmp_path)
    first = segments(4096)
    first[:4] = [1, 2, 3, 4]
    assert [p.name for p in tmp_path.iterdir()] == segments.names
    elsewhere = map_segment(tmp_path, segments.names[0])  # as a reader process maps it
    assert elsewhere.tolist()[:4] == [1, 2, 3, 4] and elsewhere.nbytes == 4096
    SharedSegments("msaserve-test", tmp_path)  # a restarted shard: its predecessor's files go
    assert not list(tmp_path.iterdir())
    assert elsewhere.tolist()[:4] == [1, 2, 3, 4]  # a reader's mapping outlives the unlink
    with pytest.raises(ValueError, match="without '/'"):
        SharedSegments("a/b", tmp_path)


def test_a_lease_from_another_process_reads_the_stored_bytes_in_place(tmp_path):
    _, client, _, shards, hashes, payloads = service(tmp_path)
    assert client.arena_stores() == {"index"}
    lease = client.lease_index_async(hashes).result()
    assert all(np.array_equal(lease.views[i], payloads[i]) for i in range(PAGES))
    assert (lease.segment_of >= 0).all()
    # In place: the views are the shard's segment files mapped here, not copies of them.
    shard = shards[shard_of_page(hashes[0], 3)]
    stored = shard.stores["index"].memory.get(index_key(client.model_key, hashes[0])).payload
    stored[5] ^= 0xFF
    assert lease.views[0][5] == stored[5]
    stored[5] ^= 0xFF
    # The lease holds the bytes: a page deleted meanwhile keeps its slot until the lease ends.
    client.delete_pages([hashes[1]])
    assert np.array_equal(lease.views[1], payloads[1])
    assert sum(s.stats()["index"]["arena_retired_slots"] for s in shards) == 1
    lease.release()
    for s in shards:
        assert s.stats()["open_leases"] == 0 and s.stats()["index"]["arena_retired_slots"] == 0


def test_adoption_loads_the_index_through_shared_leases_and_stops_at_a_corrupt_page(tmp_path):
    model, client, codec, shards, hashes, payloads = service(tmp_path)
    caches = allocate_caches(model, PAGES, "cpu", torch.float32)
    assert load_index_leased(client, hashes, codec, caches, torch.arange(PAGES), group_pages=16) == PAGES
    assert np.array_equal(index_pages(codec, caches, range(PAGES)), payloads)
    bad = 25  # a flipped bit in the shared file, as memory corruption would leave it
    shard = shards[shard_of_page(hashes[bad], 3)]
    shard.stores["index"].memory.get(index_key(client.model_key, hashes[bad])).payload[3] ^= 0x08
    for c in caches:
        c.index_cache.zero_()
    assert load_index_leased(client, hashes, codec, caches, torch.arange(PAGES), group_pages=16) == bad
    assert np.array_equal(index_pages(codec, caches, range(bad)), payloads[:bad])
    assert shard.stores["index"].stats.corruptions == 1
    assert all(s.stats()["open_leases"] == 0 for s in shards)


def test_files_this_process_cannot_map_fall_back_to_packed_reads(tmp_path, monkeypatch):
    """A shard on another node: its file names mean nothing here. The adoption ends the leases,
    reads the index packed instead (same pages), and stops asking for shared leases."""
    model, client, codec, shards, hashes, payloads = service(tmp_path)

    def elsewhere(directory, name):
        raise FileNotFoundError(f"{directory}/{name}")

    monkeypatch.setattr(shared_segments, "map_segment", elsewhere)
    record = SessionRecord("s", client.model, page_hashes=hashes)
    caches = allocate_caches(model, PAGES, "cpu", torch.float32)
    fetcher = LazyPageFetcher(client, record, caches, list(range(PAGES)))
    assert fetcher.load_index() == PAGES * model.page_size
    assert np.array_equal(index_pages(codec, caches, range(PAGES)), payloads)
    assert client.arena_stores() == frozenset()  # packed from here on
    assert all(s.stats()["open_leases"] == 0 for s in shards)


def test_shards_without_shared_arenas_answer_packed_reads_only(tmp_path):
    _, client, _, shards, hashes, _ = service(tmp_path, arena=False)
    assert client.arena_stores() == frozenset()
    with pytest.raises(ValueError, match="shared index arenas"):
        client.lease_index_async(hashes)
    with pytest.raises(ValueError, match=r"needs ServiceConfig\.shared_index_arena"):
        shards[0].lease_index_shared(client.model_key, hashes[:1])


def test_kv_leases_need_shards_in_this_process_and_a_renewal_keeps_a_lease_past_its_ttl(tmp_path):
    """K/V pages are leased in place only from shards in the reader's process (a sparse-resident
    adoption's kernels read them through UVA); from these, `lease_kv_async` refuses. A renewal
    restarts a lease's TTL clock: a renewed lease outlives `lease_ttl_s`, an unrenewed one expires,
    and renewing it then says so."""
    _, client, _, shards, hashes, _ = service(tmp_path, lease_ttl_s=0.2)
    with pytest.raises(ValueError, match="lease_kv_async needs shards in this process"):
        client.lease_kv_async(hashes)
    shard = shards[0]
    kept, dropped = (shard.lease_index(client.model_key, [0]).lease_id,
                     shard.lease_index(client.model_key, [0]).lease_id)
    for _ in range(3):
        time.sleep(0.1)
        assert shard.renew_leases([kept]) == 1
    shard.lease_index(client.model_key, [0])  # any new lease ends the expired ones
    assert shard.renew_leases([kept, dropped]) == 1 and shard.stats()["expired_leases"] >= 1


def test_a_lease_its_reader_never_ends_expires(tmp_path):
    _, client, _, shards, hashes, _ = service(tmp_path, lease_ttl_s=0.05)
    shard = shards[0]
    mine = [h for h in hashes if shard_of_page(h, 3) == 0][:2]
    views = shard.lease_index_shared(client.model_key, mine)
    assert isinstance(views, SharedPageViews) and shard.stats()["open_leases"] == 1
    time.sleep(0.1)
    again = shard.lease_index_shared(client.model_key, mine)  # any new lease ends expired ones
    assert shard.stats()["open_leases"] == 1 and shard.stats()["expired_leases"] == 1
    shard.release_lease(views.lease_id)  # the late reader's release: nothing left to end
    shard.release_lease(again.lease_id)
    assert shard.stats()["open_leases"] == 0
    with pytest.raises(ValueError, match="lease_ttl_s=0"):
        ServiceConfig(lease_ttl_s=0)


def test_a_segment_the_directory_has_no_room_for_leaves_pages_in_plain_memory(tmp_path, monkeypatch):
    """No SIGBUS later: the file's memory is reserved when it is made; where that fails the arena
    keeps the page in plain memory, and a lease answers with its bytes (copied) instead."""

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shared_segments.os, "posix_fallocate", full, raising=False)
    _, client, _, shards, hashes, payloads = service(tmp_path)
    assert not list(tmp_path.iterdir())  # the failed files were removed
    assert sum(s.stores["index"].memory.arena.stats.failed_segments for s in shards) >= 1
    lease = client.lease_index_async(hashes).result()
    assert (lease.segment_of == -1).all()
    assert all(np.array_equal(lease.views[i], payloads[i]) for i in range(PAGES))
    lease.release()
