"""Page payloads between layer caches and the service, without Ray."""

import pytest
import torch

from msaserve.engine.kv.pages import PageCodec, identity_for
from msaserve.models.cache import allocate_caches
from msaserve.models.presets import get_preset


@pytest.mark.parametrize("dtype,index_dtype", [
    (torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, torch.float8_e4m3fn),
])
def test_export_then_import_restores_every_page(dtype, index_dtype):
    config = get_preset("tiny")
    identity = identity_for(config, "tiny", dtype, index_dtype)
    codec = PageCodec(identity)
    source = allocate_caches(config, 6, "cpu", dtype, index_dtype)
    generator = torch.Generator().manual_seed(0)
    for cache in source:
        for t in (cache.k_cache, cache.v_cache, cache.index_cache, cache.index_scale):
            if t is not None:
                t.copy_(torch.randn(t.shape, generator=generator).to(t.dtype))
    pages = codec.export_pages(source, [4, 1, 2])
    assert len(pages) == 3 and all(len(kv) == config.num_layers for kv, _ in pages)
    assert pages[0][0][0].nbytes == codec.kv_bytes
    assert pages[0][1].nbytes == codec.index_bytes + codec.scale_bytes

    target = allocate_caches(config, 6, "cpu", dtype, index_dtype)
    codec.import_index(target, [0, 3, 5], [ix for _, ix in pages])
    for layer, cache in enumerate(target):
        codec.import_kv(cache, [0, 3, 5], [kv[layer] for kv, _ in pages])
    fresh = allocate_caches(config, 6, "cpu", dtype, index_dtype)
    for src, dst, untouched in zip(source, target, fresh, strict=True):
        for name in ("k_cache", "v_cache", "index_cache", "index_scale"):
            if getattr(src, name) is None:
                continue
            a, b = getattr(src, name), getattr(dst, name)
            assert torch.equal(a[[4, 1, 2]].view(torch.uint8), b[[0, 3, 5]].view(torch.uint8)), name
            other = getattr(untouched, name)[[1, 2, 4]].view(torch.uint8)
            assert torch.equal(b[[1, 2, 4]].view(torch.uint8), other), name  # other pages untouched


def test_wrong_layout_is_refused_naming_the_sizes():
    config = get_preset("tiny")
    codec = PageCodec(identity_for(config, "tiny", torch.float32))
    other = PageCodec(identity_for(config, "tiny", torch.bfloat16))
    caches = allocate_caches(config, 2, "cpu", torch.bfloat16)
    ((kv, _),) = other.export_pages(caches, [0])
    target = allocate_caches(config, 2, "cpu", torch.float32)
    expected = f"{other.kv_bytes} bytes; the layout of tiny needs {codec.kv_bytes}"
    with pytest.raises(ValueError, match=expected):
        codec.import_kv(target[0], [0], [kv[0]])


def test_model_identity_key_changes_with_layout():
    config = get_preset("tiny")
    keys = {
        identity_for(config, "tiny", torch.float32).key,
        identity_for(config, "tiny", torch.bfloat16).key,
        identity_for(config, "tiny-v2", torch.float32).key,
        identity_for(get_preset("tiny", page_size=32), "tiny", torch.float32).key,
    }
    assert len(keys) == 4
