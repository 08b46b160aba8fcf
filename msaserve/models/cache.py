"""Paged per-layer caches (DESIGN §3): K and V pages, and the separate index-K pages."""

from dataclasses import dataclass

import torch


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

    def write(
        self, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index_k: torch.Tensor
    ) -> None:
        """Store new tokens: slot_mapping [T] int64; k, v [T, Hkv, D]; index_k [T, HkI, DI]."""
        page_size = self.k_cache.shape[1]
        pages, offsets = slot_mapping // page_size, slot_mapping % page_size
        self.k_cache[pages, offsets] = k.to(self.k_cache.dtype)
        self.v_cache[pages, offsets] = v.to(self.v_cache.dtype)
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
