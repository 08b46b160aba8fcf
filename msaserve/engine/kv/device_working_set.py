"""Sparse-KV residency on the device: every layer's working set as tensors, admitted with no host sync.

The policy is `residency.WorkingSet`'s (write ring, then free slots, then the least recently selected
page; never a page selected in this step), run as fixed-size tensor ops on the selection the indexer
left on the device: the host never learns which pages a step selected or how many missed. Per layer
and step (`admit`):
1. the selection [.., Hkv, K] is flattened to M = Hkv·K entries; the first entry of each distinct
   page counts (an M×M comparison: M is 64 at the M3 shape);
2. entries whose page has a slot (`slot_of`) are hits: their slot is marked used in this step;
3. the r-th miss takes the r-th best victim among the selection slots (`topk` of a key that is free
   first, then least recently used, then the lower slot; slots used in this step never), the page it
   held loses its slot;
4. → (dst_slots, src_pages) [M]: -1 where nothing is to be copied, for `kernels.page_gather`.
Tables have one spare column (index `max_pages` / `num_slots`) that masked scatters write into.
"""

import torch

_NEVER = -1
_FREE = -2


class DeviceWorkingSet:
    def __init__(self, num_layers: int, num_slots: int, ring: int, max_pages: int, device: torch.device) -> None:
        if ring < 2 or num_slots <= ring:
            raise ValueError(f"num_slots={num_slots}, ring={ring} is invalid: allowed ring ≥ 2 and "
                             "num_slots > ring (the ring holds the pages being written)")
        self.num_layers, self.num_slots, self.ring, self.max_pages = num_layers, num_slots, ring, max_pages
        self.device = torch.device(device)
        kw = dict(device=self.device)
        self.slot_of = torch.full((num_layers, max_pages + 1), -1, dtype=torch.int32, **kw)
        """[L, max_pages + 1] the slot each logical page is in (-1: not resident); also the sparse
        attention's page table (a non-resident page's entry is never read: attention reads only
        the selected pages, resident by then)."""
        self.page_in = torch.full((num_layers, num_slots + 1), -1, dtype=torch.int64, **kw)
        self.last_used = torch.full((num_layers, num_slots + 1), _NEVER, dtype=torch.int64, **kw)
        self.fetched = torch.zeros(num_layers, dtype=torch.int64, **kw)
        self.evictions = torch.zeros(num_layers, dtype=torch.int64, **kw)
        self.fetch_events = torch.zeros(num_layers, dtype=torch.int64, **kw)
        """[L] (layer, step) pairs that copied pages in."""
        self._general = torch.arange(ring, num_slots, **kw)
        self._spare_page = torch.tensor(max_pages, **kw)
        self._spare_slot = torch.tensor(num_slots, **kw)

    def table(self, layer: int) -> torch.Tensor:
        """[1, max_pages] int32 logical page → slot of `layer` (a view: always current)."""
        return self.slot_of[layer, None, : self.max_pages]

    def place_write_page(self, page: int) -> int:
        """Page `page` starts receiving tokens in every layer: it takes ring slot page % ring (the
        page there leaves the working set; a copy of `page` in a selection slot is dropped) → slot."""
        slot = page % self.ring
        old = self.page_in[:, slot]  # [L]
        self.slot_of.scatter_(1, torch.where(old >= 0, old, self.max_pages)[:, None], -1)
        stale = self.slot_of[:, page].long()  # [L]
        stale_slot = torch.where(stale >= 0, stale, self.num_slots)[:, None]
        self.page_in.scatter_(1, stale_slot, -1)
        self.last_used.scatter_(1, stale_slot, _NEVER)
        self.page_in[:, slot], self.last_used[:, slot] = page, _NEVER
        self.slot_of[:, page] = slot
        return slot

    def admit(self, layer: int, selected: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """selected [.., Hkv, K] block ids of `layer` (-1 unused), on the device → (dst_slots,
        src_pages) [M]: the misses' slots and pages, -1 / 0 elsewhere. The tables say the pages are
        resident from now on: copy them in before anything reads them."""
        pages = selected.reshape(-1).long()
        valid = pages >= 0
        pages = pages.clamp(min=0)
        same = (pages[:, None] == pages[None, :]) & valid[None, :]
        first = valid & ~torch.tril(same, diagonal=-1).any(dim=1)
        slot_of, page_in, last_used = self.slot_of[layer], self.page_in[layer], self.last_used[layer]
        slots = slot_of[pages].long()
        hit, miss = first & (slots >= 0), first & (slots < 0)
        last_used.index_fill_(0, torch.where(hit, slots, self._spare_slot), step)
        # Victims: free slots, then least recently used, then the lower slot; none used in this step.
        general_used = last_used[self._general]
        key = torch.where(page_in[self._general] < 0, _FREE, general_used)
        key = torch.where(general_used == step, 1 << 40, key)
        key = key * (self.num_slots + 1) + self._general  # distinct keys: a deterministic order
        count = min(pages.numel(), self._general.numel())
        victims = self._general[torch.topk(key, count, largest=False, sorted=True).indices]
        rank = (torch.cumsum(miss.long(), 0) - 1).clamp(0, count - 1)
        dst = torch.where(miss, victims[rank], -1)
        old = page_in[torch.where(miss, dst, self._spare_slot)]
        evicted = miss & (old >= 0)
        slot_of.index_fill_(0, torch.where(evicted, old, self._spare_page), -1)
        target = torch.where(miss, dst, self._spare_slot)
        page_in.scatter_(0, target, pages)
        last_used.index_fill_(0, target, step)
        slot_of.scatter_(0, torch.where(miss, pages, self._spare_page), dst.to(torch.int32))
        self.fetched[layer] += miss.sum()
        self.evictions[layer] += evicted.sum()
        self.fetch_events[layer] += miss.any()
        return dst, pages

    def resident_pages(self, layer: int) -> list[int]:
        """(host sync: tests and reports only)"""
        return sorted(p for p in self.page_in[layer, : self.num_slots].tolist() if p >= 0)
