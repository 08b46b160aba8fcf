"""Preemption by swapping: a preempted sequence's pages go to a page store and come back later,
so resuming costs a copy instead of recomputing the prefill.

`SwapStore` is the seam to the KV cache service (docs/design.md §4, kvcache/): the engine only needs
put/pop/delete of a sequence's page contents. `HostSwapStore` keeps them in (pinned) host memory.
"""

from typing import Protocol

import torch

from msaserve.engine.block_manager import BlockManager
from msaserve.engine.sequence import Sequence, SequenceStatus
from msaserve.models.cache import LayerKVCache

PageData = dict[str, torch.Tensor]
"""Page contents of all layers: "k", "v" [L, n, P, Hkv, D]; "index" [L, n, P, HkI, DI];
optionally "index_scale" [L, n, P, HkI]."""


class SwapStore(Protocol):
    def put(self, key: str, data: PageData) -> bool:
        """Keep `data` under `key`; False when there is no room (the caller recomputes instead)."""
        ...

    def pop(self, key: str) -> PageData: ...

    def delete(self, key: str) -> None: ...


class EvictedPageSink(Protocol):
    def store_evicted(self, page_hashes: list[int], data: PageData) -> None:
        """Keep evicted prefix-cache pages (one per hash, in order) instead of dropping them."""
        ...


def page_data_bytes(data: PageData) -> int:
    return sum(t.numel() * t.element_size() for t in data.values())


class HostSwapStore:
    """Page contents in host memory, bounded by `capacity_bytes`."""

    def __init__(self, capacity_bytes: int, pin_memory: bool = False) -> None:
        self.capacity_bytes = capacity_bytes
        self.pin_memory = pin_memory
        self.bytes_used = 0
        self._data: dict[str, PageData] = {}

    def put(self, key: str, data: PageData) -> bool:
        size = page_data_bytes(data)
        if self.bytes_used + size > self.capacity_bytes:
            return False
        host = {}
        for name, tensor in data.items():
            copy = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self.pin_memory)
            copy.copy_(tensor)  # from the device: synchronous, the pages are reused right after
            host[name] = copy
        self._data[key] = host
        self.bytes_used += size
        return True

    def pop(self, key: str) -> PageData:
        data = self._data.pop(key)
        self.bytes_used -= page_data_bytes(data)
        return data

    def delete(self, key: str) -> None:
        if key in self._data:
            self.pop(key)

    def __len__(self) -> int:
        return len(self._data)


class CachePageIO:
    """Reads and writes whole physical pages of every layer's caches."""

    def __init__(self, caches: list[LayerKVCache]) -> None:
        self.caches = caches

    def read(self, pages: list[int]) -> PageData:
        index = torch.tensor(pages, dtype=torch.long, device=self.caches[0].k_cache.device)
        data = {
            "k": torch.stack([c.k_cache[index] for c in self.caches]),
            "v": torch.stack([c.v_cache[index] for c in self.caches]),
            "index": torch.stack([c.index_cache[index] for c in self.caches]),
        }
        if self.caches[0].index_scale is not None:
            data["index_scale"] = torch.stack([c.index_scale[index] for c in self.caches])
        return data

    def write(self, pages: list[int], data: PageData) -> None:
        device = self.caches[0].k_cache.device
        index = torch.tensor(pages, dtype=torch.long, device=device)
        for layer, cache in enumerate(self.caches):
            cache.k_cache[index] = data["k"][layer].to(device)
            cache.v_cache[index] = data["v"][layer].to(device)
            cache.index_cache[index] = data["index"][layer].to(device)
            if cache.index_scale is not None:
                cache.index_scale[index] = data["index_scale"][layer].to(device)


class Swapper:
    """Moves a sequence's computed pages between the pool and a SwapStore."""

    def __init__(self, store: SwapStore, page_io: CachePageIO, block_manager: BlockManager) -> None:
        self.store = store
        self.page_io = page_io
        self.block_manager = block_manager

    def swap_out(self, seq: Sequence) -> bool:
        """Copy seq's pages out and free them. False (nothing changed) if the store is full."""
        num_pages = -(-seq.num_computed_tokens // self.block_manager.page_size)
        if num_pages and not self.store.put(seq.request_id, self.page_io.read(seq.block_table[:num_pages])):
            return False
        seq.swapped_pages = num_pages
        self.block_manager.free(seq)
        seq.status = SequenceStatus.SWAPPED
        return True

    def pages_to_swap_in(self, seq: Sequence) -> int:
        cached = self.block_manager.lookup(seq.page_hashes[: seq.swapped_pages], seq.token_ids)
        return seq.swapped_pages - len(cached)

    def swap_in(self, seq: Sequence) -> bool:
        """Bring seq's pages back (reusing prefix-cache pages that still hold the same tokens).
        False (nothing changed) if the pool lacks pages."""
        manager = self.block_manager
        cached = manager.lookup(seq.page_hashes[: seq.swapped_pages], seq.token_ids)
        if seq.swapped_pages - len(cached) > manager.num_free_pages:
            return False
        manager.acquire(cached)
        fresh = manager.allocate(seq.swapped_pages - len(cached))
        if seq.swapped_pages:
            data = self.store.pop(seq.request_id)
            if fresh:
                rest = {name: tensor[:, len(cached) :] for name, tensor in data.items()}
                self.page_io.write(fresh, rest)
        seq.block_table = cached + fresh
        seq.swapped_pages = 0
        if seq.enable_prefix_caching and manager.enable_prefix_caching:
            manager.register(seq, len(cached))
        seq.status = SequenceStatus.RUNNING
        return True

    def discard(self, seq: Sequence) -> None:
        """Drop the stored pages of a swapped sequence that was aborted."""
        self.store.delete(seq.request_id)
        seq.swapped_pages = 0
