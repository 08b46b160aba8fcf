"""Adoption's index load on CUDA straight from the shards' pinned arenas (`engine/kv/direct_index.py`):
runs of adjacent pages copied on a side stream, the verified prefix scattered, every byte equal."""

import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from msaserve.engine.kv.direct_index import load_index_leased, runs_of
from msaserve.engine.kv.pages import PageCodec, identity_for
from msaserve.engine.kv.pinned_segments import segment_allocators, segment_tensor
from msaserve.kvcache.client import KVCacheClient
from msaserve.kvcache.config import ServiceConfig
from msaserve.kvcache.keys import index_key, shard_of_page
from msaserve.models.cache import allocate_caches
from msaserve.models.presets import get_preset

PAGES = 700


@pytest.mark.parametrize("index_dtype", [None, torch.float8_e4m3fn])
@pytest.mark.parametrize("corrupt", [None, 513])
def test_leased_index_load_from_pinned_arenas_matches_every_byte(index_dtype, corrupt):
    config = get_preset("m3-proxy", num_layers=2)
    identity = identity_for(config, "m3-proxy-L2", torch.bfloat16, index_dtype)
    codec = PageCodec(identity)
    row = codec.index_bytes + codec.scale_bytes
    client = KVCacheClient.in_process(ServiceConfig(num_shards=4, memory_bytes=256 << 20, index_fraction=0.5),
                                      identity, segment_allocators=segment_allocators("cuda"))
    rng = np.random.default_rng(0)
    hashes = [int(h) for h in rng.integers(1, 2**62, PAGES)]
    payloads = rng.integers(0, 256, (PAGES, row), dtype=np.uint8)
    client.put_pages([(h, None, payloads[i]) for i, h in enumerate(hashes)])
    if corrupt is not None:
        shard = client.shards[shard_of_page(hashes[corrupt], 4)]
        shard.stores["index"].memory.get(index_key(client.model_key, hashes[corrupt])).payload[100] ^= 1
    lease = client.lease_index_async(hashes).result()
    assert all(segment_tensor(s).is_pinned() for s in lease.segments)
    assert len(runs_of(lease.segment_of, lease.offsets, row)[1]) == 4  # one run per shard
    lease.release()
    caches = allocate_caches(config, PAGES, "cuda", torch.bfloat16, index_dtype)
    usable = load_index_leased(client, hashes, codec, caches, torch.arange(PAGES, device="cuda"),
                               group_pages=128)
    want = PAGES if corrupt is None else corrupt
    assert usable == want
    ix = torch.stack([c.index_cache for c in caches], dim=1).contiguous().view(torch.uint8)
    got = ix.reshape(PAGES, -1).cpu().numpy()
    assert np.array_equal(got[:want], payloads[:want, : codec.index_bytes])
    # Checked on the GPU, the scatter does not wait for the check: the pages past a bad one may be
    # written (the caller recomputes them); the count above is what the load vouches for.
    assert all(stats["open_leases"] == 0 for stats in client.stats())
    if codec.scale_bytes:
        scales = torch.stack([c.index_scale for c in caches], dim=1).contiguous().view(torch.uint8)
        got_scales = scales.reshape(PAGES, -1).cpu().numpy()
        assert np.array_equal(got_scales[:want], payloads[:want, codec.index_bytes :])


def test_index_leased_from_shards_in_another_process_through_shared_files(tmp_path):
    """Shards that share no memory with this process (as the platform's actors) and keep their
    index arenas in shared-memory files: the load maps the files, page-locks them for the copies
    (`cudaHostRegister`) and checks the pages on the GPU; every byte equal, every lease ended."""
    import pickle

    from msaserve.kvcache.shard import KVCacheShard
    from msaserve.kvcache.transport import LocalTransport

    class OtherProcess(LocalTransport):
        shares_memory = False

        def gather(self, futures, timeout_s=None):
            return [pickle.loads(pickle.dumps(a)) for a in super().gather(futures, timeout_s)]

    config = get_preset("m3-proxy", num_layers=2)
    identity = identity_for(config, "m3-proxy-L2", torch.bfloat16)
    codec = PageCodec(identity)
    row = codec.index_bytes + codec.scale_bytes
    # The files on a tmpfs, as the platform keeps them (/dev/shm): Linux page-locks writable
    # file-backed memory only on shmem, so segment files on a disk directory stay pageable.
    shm = Path("/dev/shm")
    directory = tempfile.mkdtemp(dir=shm) if shm.is_dir() else str(tmp_path)
    settings = ServiceConfig(num_shards=4, memory_bytes=256 << 20, index_fraction=0.5,
                             shared_index_arena=True, shared_directory=directory)
    shards = [KVCacheShard(settings, i, publish_metrics=False) for i in range(4)]
    client = KVCacheClient(shards, identity, OtherProcess(shards))
    rng = np.random.default_rng(1)
    hashes = [int(h) for h in rng.integers(1, 2**62, PAGES)]
    payloads = rng.integers(0, 256, (PAGES, row), dtype=np.uint8)
    client.put_pages([(h, None, payloads[i]) for i, h in enumerate(hashes)])
    assert client.arena_stores() == {"index"}
    lease = client.lease_index_async(hashes).result()
    used = [s for i, s in enumerate(lease.segments) if i in set(lease.segment_of.tolist())]
    assert all(segment_tensor(s, "cuda").is_pinned() for s in used)  # registered in place
    lease.release()
    caches = allocate_caches(config, PAGES, "cuda", torch.bfloat16)
    assert load_index_leased(client, hashes, codec, caches, torch.arange(PAGES, device="cuda"),
                             group_pages=128) == PAGES
    ix = torch.stack([c.index_cache for c in caches], dim=1).contiguous().view(torch.uint8)
    assert np.array_equal(ix.reshape(PAGES, -1).cpu().numpy(), payloads[:, : codec.index_bytes])
    assert all(s.stats()["open_leases"] == 0 for s in shards)
    shutil.rmtree(directory, ignore_errors=True)
