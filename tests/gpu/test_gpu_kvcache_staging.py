"""Pinned double-buffered staging to the GPU: every byte arrives, buffers are reused safely."""

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from msaserve.engine.kv.pages import PageCodec, identity_for
from msaserve.engine.kv.staging import PinnedStaging
from msaserve.models.cache import allocate_caches
from msaserve.models.presets import get_preset


@pytest.mark.parametrize("chunk_bytes", [4096, 1 << 20])
def test_pinned_staging_moves_every_byte_across_many_reused_chunks(chunk_bytes):
    rng = np.random.default_rng(0)
    payloads = [rng.integers(0, 256, 1000, dtype=np.uint8) for _ in range(300)]
    staging = PinnedStaging(torch.device("cuda"), chunk_bytes)
    for _ in range(2):  # the second upload reuses the buffers of the first
        out = torch.empty(300, 1000, dtype=torch.uint8, device="cuda")
        for start, chunk in staging.upload(payloads, 1000):
            out[start : start + chunk.shape[0]] = chunk
        assert np.array_equal(out.cpu().numpy(), np.stack(payloads))


@pytest.mark.parametrize("index_dtype", [None, torch.float8_e4m3fn])
def test_import_through_staging_restores_pages_on_the_gpu(index_dtype):
    config = get_preset("tiny")
    codec = PageCodec(identity_for(config, "tiny", torch.bfloat16, index_dtype))
    source = allocate_caches(config, 40, "cuda", torch.bfloat16, index_dtype)
    for cache in source:
        for t in (cache.k_cache, cache.v_cache, cache.index_cache, cache.index_scale):
            if t is not None:
                t.copy_(torch.randn(t.shape, device="cuda").to(t.dtype))
    pages = list(range(39, -1, -1))
    exported = codec.export_pages(source, pages)
    target = allocate_caches(config, 40, "cuda", torch.bfloat16, index_dtype)
    codec.import_index(target, list(range(40)), [ix for _, ix in exported])
    for layer, cache in enumerate(target):
        codec.import_kv(cache, list(range(40)), [kv[layer] for kv, _ in exported])
    for src, dst in zip(source, target, strict=True):
        for name in ("k_cache", "v_cache", "index_cache", "index_scale"):
            if getattr(src, name) is not None:
                a, b = getattr(src, name)[pages], getattr(dst, name)
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


def test_upload_ring_reuses_pinned_buffers_only_after_their_copy():
    from msaserve.engine.kv.staging import UploadRing

    ring = UploadRing(torch.device("cuda"), buffer_bytes=64 << 20, count=2)
    chunks = []
    for value in range(5):  # more uploads than buffers: each refill waits for the buffer's copy
        slot, host = ring.acquire(64, 1 << 20)
        host[:] = value
        chunks.append(ring.upload(slot, 64, 1 << 20))
    torch.cuda.synchronize()
    for value, chunk in enumerate(chunks):
        assert chunk.is_cuda and bool((chunk == value).all())
