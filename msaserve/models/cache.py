"""Paged per-layer caches (docs/design.md §3): K and V pages, and the separate index-K pages."""

from dataclasses import dataclass

import torch

from msaserve.models.config import MSAConfig


@dataclass
class LayerKVCache:
    """One layer's page pool. Physical page ids index the first axis of every tensor."""

    k_cache: torch.Tensor
    """[num_pages, P, Hkv, D]"""
    v_cache: torch.Tensor
    """[num_pages, P, Hkv, D]"""
    index_cache: torch.Tensor
    """[num_pages, P, HkI, DI]; kept apart so it can be loaded, moved and kept resident alone."""
    index_scale: torch.Tensor | None = None
    """[num_pages, P, HkI] fp32 per-key scales when index_cache is fp8, else None."""

    def write_index(self, slot_mapping: torch.Tensor, index_k: torch.Tensor) -> None:
        """Store new index keys: slot_mapping [T] int64; index_k [T, HkI, DI]."""
        page_size = self.index_cache.shape[1]
        pages, offsets = slot_mapping // page_size, slot_mapping % page_size
        if self.index_scale is None:
            self.index_cache[pages, offsets] = index_k.to(self.index_cache.dtype)
        else:  # fp8: one scale per key so that its largest element maps to the fp8 max
            fp8_max = torch.finfo(self.index_cache.dtype).max
            scale = index_k.float().abs().amax(dim=-1).clamp(min=1e-12) / fp8_max
            self.index_scale[pages, offsets] = scale
            self.index_cache[pages, offsets] = (index_k.float() / scale[..., None]).to(
                self.index_cache.dtype
            )

    @property
    def num_pages(self) -> int:
        return int(self.k_cache.shape[0])

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across K, V, index-K (and scales)."""
        total = 0
        for t in (self.k_cache, self.v_cache, self.index_cache, self.index_scale):
            if t is not None:
                total += t[0].numel() * t.element_size()
        return total


def allocate_caches(
    config: MSAConfig,
    num_pages: int,
    device: torch.device | str,
    dtype: torch.dtype,
    index_dtype: torch.dtype | None = None,
) -> list[LayerKVCache]:
    """One zeroed page pool per layer: K/V in `dtype`, index-K in `index_dtype` (default `dtype`).

    An fp8 index dtype also allocates the per-key fp32 `index_scale`.
    """
    if num_pages < 1:
        raise ValueError(f"num_pages={num_pages} is invalid: allowed an integer ≥ 1")
    index_dtype = index_dtype or dtype
    fp8 = index_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    p, hkv, d = config.page_size, config.num_kv_heads, config.head_dim
    hki, di = config.num_index_heads, config.index_head_dim
    return [
        LayerKVCache(
            k_cache=torch.zeros(num_pages, p, hkv, d, device=device, dtype=dtype),
            v_cache=torch.zeros(num_pages, p, hkv, d, device=device, dtype=dtype),
            index_cache=torch.zeros(num_pages, p, hki, di, device=device, dtype=index_dtype),
            index_scale=(
                torch.ones(num_pages, p, hki, device=device, dtype=torch.float32) if fp8 else None
            ),
        )
        for _ in range(config.num_layers)
    ]
