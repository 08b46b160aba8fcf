"""Page contents ↔ payloads, between a replica's layer caches and the service.

Two payload kinds, chosen by the adoption access pattern (docs/design.md §4):
- **K+V of one page in one layer** (`[2, P, Hkv, D]` bytes): a decode step learns which pages it
  needs one layer at a time (layer l's selection depends on layer l's input), and the selections
  differ per layer, so fetching per (page, layer) moves exactly the selected bytes. With the M3
  shape this is 256 KiB: large enough for the object store's shared-memory path.
- **index-K of one page in every layer** (`[L, P, HkI, DI]` (+ fp32 scales)): the index is loaded
  whole before the first step, so one payload per page keeps the object count L× lower.

Payloads are raw bytes without a header: the layout follows from `ModelIdentity`, which is part
of every page key, so writer and reader always agree. Bulk imports concatenate payloads on the
host in reused pinned buffers and copy chunk by chunk to the device (`staging.py`).
"""

from collections.abc import Sequence

import numpy as np
import torch

from msaserve.engine.kv.staging import check_sizes, to_device_chunks
from msaserve.kvcache.codec import Payload
from msaserve.kvcache.keys import ModelIdentity
from msaserve.models.cache import LayerKVCache


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def identity_for(
    config, name: str, kv_dtype: torch.dtype, index_dtype: torch.dtype | None = None
) -> ModelIdentity:
    """The ModelIdentity of an `MSAConfig` served with these cache dtypes."""
    return ModelIdentity(
        name=name, num_layers=config.num_layers, page_size=config.page_size,
        num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
        num_index_heads=config.num_index_heads, index_dim=config.index_head_dim,
        kv_dtype=str(kv_dtype).removeprefix("torch."),
        index_dtype=str(index_dtype or kv_dtype).removeprefix("torch."),
    )


class PageCodec:
    """Encodes and decodes the pages of caches laid out as `model` says."""

    def __init__(self, model: ModelIdentity) -> None:
        self.model = model
        self.kv_dtype, self.index_dtype = _dtype(model.kv_dtype), _dtype(model.index_dtype)
        self.fp8_index = self.index_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        m = model
        self.kv_shape = (2, m.page_size, m.num_kv_heads, m.head_dim)  # K then V
        self.index_shape = (m.num_layers, m.page_size, m.num_index_heads, m.index_dim)
        self.scale_shape = (m.num_layers, m.page_size, m.num_index_heads)
        self.kv_bytes = int(np.prod(self.kv_shape)) * self.kv_dtype.itemsize
        self.index_bytes = int(np.prod(self.index_shape)) * self.index_dtype.itemsize
        self.scale_bytes = int(np.prod(self.scale_shape)) * 4 if self.fp8_index else 0

    # ---- export (replica → service) -----------------------------------------------------------
    def export_pages(
        self, caches: Sequence[LayerKVCache], physical_pages: Sequence[int]
    ) -> list[tuple[list[Payload], Payload]]:
        """(K+V payload per layer, index payload) of each physical page, one device copy per
        layer and tensor."""
        index = torch.as_tensor(list(physical_pages), dtype=torch.long, device=caches[0].k_cache.device)
        scale = torch.stack([c.index_scale[index] for c in caches], dim=1) if self.fp8_index else None
        return self.encode(
            k=[c.k_cache[index] for c in caches], v=[c.v_cache[index] for c in caches],
            index=torch.stack([c.index_cache[index] for c in caches], dim=1), index_scale=scale,
        )

    def encode(
        self, k: Sequence[torch.Tensor], v: Sequence[torch.Tensor], index: torch.Tensor,
        index_scale: torch.Tensor | None,
    ) -> list[tuple[list[Payload], Payload]]:
        """k, v: per layer [n, P, Hkv, D]; index [n, L, P, HkI, DI]; index_scale [n, L, P, HkI]
        → (K+V payload per layer, index payload) of each of the n pages."""
        n = index.shape[0]
        kv = [  # per layer: [n, 2 · P · Hkv · D · itemsize] on the host
            _host_bytes(torch.stack([k_l, v_l], dim=1)).reshape(n, -1) for k_l, v_l in zip(k, v, strict=True)
        ]
        parts = [_host_bytes(index).reshape(n, -1)]
        if self.fp8_index:
            parts.append(_host_bytes(index_scale).reshape(n, -1))
        index_payloads = np.concatenate(parts, axis=1)  # [n, index_bytes + scale_bytes]
        return [([layer[i] for layer in kv], index_payloads[i]) for i in range(n)]

    def decode_kv(self, payloads: Sequence[Payload]) -> torch.Tensor:
        """K+V payloads of n pages of one layer → host tensor [n, 2, P, Hkv, D]."""
        data = self._stack(payloads, self.kv_bytes, "K+V")
        return torch.from_numpy(data).view(self.kv_dtype).view(len(payloads), *self.kv_shape)

    def decode_index(self, payloads: Sequence[Payload]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Index payloads of n pages → host tensors index [n, L, P, HkI, DI], scale [n, L, P, HkI]."""
        n = len(payloads)
        data = self._stack(payloads, self.index_bytes + self.scale_bytes, "index")
        ix = torch.from_numpy(np.ascontiguousarray(data[:, : self.index_bytes]))
        ix = ix.view(self.index_dtype).view(n, *self.index_shape)
        if not self.fp8_index:
            return ix, None
        scales = torch.from_numpy(np.ascontiguousarray(data[:, self.index_bytes :]))
        return ix, scales.view(torch.float32).view(n, *self.scale_shape)

    # ---- import (service → replica) -----------------------------------------------------------
    def import_kv(
        self, cache: LayerKVCache, physical_pages: Sequence[int], payloads: Sequence[Payload]
    ) -> None:
        """Write K+V payloads of one layer into `cache` at `physical_pages` (through pinned
        staging on CUDA: `staging.py`)."""
        if not payloads:
            return
        device = cache.k_cache.device
        index = torch.as_tensor(list(physical_pages), dtype=torch.long, device=device)
        for start, chunk in to_device_chunks(payloads, self.kv_bytes, device, "K+V", self.model.name):
            self.scatter_kv(cache, index[start : start + chunk.shape[0]], chunk)

    def import_index(
        self, caches: Sequence[LayerKVCache], physical_pages: Sequence[int], payloads: Sequence[Payload]
    ) -> None:
        """Write index payloads (every layer) into the caches at `physical_pages`."""
        if not payloads:
            return
        device = caches[0].index_cache.device
        index = torch.as_tensor(list(physical_pages), dtype=torch.long, device=device)
        nbytes = self.index_bytes + self.scale_bytes
        for start, chunk in to_device_chunks(payloads, nbytes, device, "index", self.model.name):
            self.scatter_index(caches, index[start : start + chunk.shape[0]], chunk)

    def scatter_kv(self, cache: LayerKVCache, rows: torch.Tensor, chunk: torch.Tensor) -> None:
        """chunk [n, kv_bytes] uint8 on the cache's device: K+V payloads → cache pages `rows` [n]."""
        kv = chunk.view(self.kv_dtype).view(chunk.shape[0], *self.kv_shape)  # [n, 2, P, Hkv, D]
        cache.k_cache[rows] = kv[:, 0]
        cache.v_cache[rows] = kv[:, 1]

    def scatter_index(self, caches: Sequence[LayerKVCache], rows: torch.Tensor, chunk: torch.Tensor) -> None:
        """chunk [n, index + scale bytes] uint8 on the caches' device → pages `rows` [n] of every layer."""
        n = chunk.shape[0]
        ix = chunk[:, : self.index_bytes].contiguous().view(self.index_dtype).view(n, *self.index_shape)
        scales = None
        if self.fp8_index:
            scales = chunk[:, self.index_bytes :].contiguous().view(torch.float32).view(n, *self.scale_shape)
        for layer, cache in enumerate(caches):
            cache.index_cache[rows] = ix[:, layer]
            if scales is not None:
                cache.index_scale[rows] = scales[:, layer]

    def _stack(self, payloads: Sequence[Payload], nbytes: int, what: str) -> np.ndarray:
        """[n, nbytes] uint8: one host copy of all payloads, checked for the expected size."""
        return np.stack(check_sizes(payloads, nbytes, what, self.model.name))


def _host_bytes(tensor: torch.Tensor) -> np.ndarray:
    """A tensor's bytes as a host uint8 array (one device-to-host copy)."""
    return tensor.contiguous().view(torch.uint8).cpu().numpy()
