"""Sparse-KV residency on the device: every layer's working set as tensors, admitted with no host sync.

The policy is `residency.WorkingSet`'s (write ring, then free slots, then the least recently selected
page; never a page selected in this step), run on the device on the selection the indexer left there
(`kernels.residency.admit`: one Triton launch per layer on CUDA, its KV heads' working sets
in one launch when each head has its own): the host never learns which pages
a step selected or how many missed. Tables have one spare entry (index `max_pages` / `num_slots`)
that masked writes go to.
"""

import torch

from msaserve.kernels.residency import admit

_NEVER = -1


class DeviceWorkingSet:
    def __init__(self, num_layers: int, num_slots: int, ring: int, max_pages: int,
                 device: torch.device) -> None:
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
        self.counters = torch.zeros(num_layers, 3, dtype=torch.int64, **kw)
        """[L, 3] pages fetched, pages evicted, steps that fetched pages."""

    def reset(self) -> None:
        """Nothing resident, every counter zero (in place: a captured step keeps reading these)."""
        self.slot_of.fill_(-1)
        self.page_in.fill_(-1)
        self.last_used.fill_(_NEVER)
        self.counters.zero_()

    @property
    def fetched(self) -> torch.Tensor:
        return self.counters[:, 0]

    @property
    def evictions(self) -> torch.Tensor:
        return self.counters[:, 1]

    @property
    def fetch_events(self) -> torch.Tensor:
        return self.counters[:, 2]

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

    def admit(self, layer: int, selected: torch.Tensor,
              step: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """selected [.., Hkv, K] block ids of `layer` (-1 unused), on the device → (dst_slots,
        src_pages) [M]: the misses' slots and pages, -1 / any elsewhere. The tables say the pages
        are resident from now on: copy them in before anything reads them."""
        return admit(selected, self.slot_of[layer], self.page_in[layer], self.last_used[layer],
                     self.counters[layer], step, self.ring)

    def admit_rows(self, first: int, selected: torch.Tensor,
                   step: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Working sets first … first + R - 1 at once (each its own, e.g. a layer's KV heads):
        selected [R, M] block ids (-1 unused) → (dst_slots, src_pages) [R, M] (on CUDA one launch)."""
        rows = slice(first, first + selected.shape[0])
        return admit(selected, self.slot_of[rows], self.page_in[rows], self.last_used[rows],
                     self.counters[rows], step, self.ring)

    def forget(self, rows: torch.Tensor, pages: torch.Tensor, slots: torch.Tensor) -> None:
        """(rows[i], pages[i]) leave the working set, freeing slots[i] — entries whose slot was given
        to the page but never got its bytes (`ResidentSession.repair`). Host tensors, any length."""
        if rows.numel() == 0:
            return
        rows, pages, slots = (t.to(self.device, torch.int64) for t in (rows, pages, slots))
        self.slot_of[rows, pages] = -1
        self.page_in[rows, slots] = -1
        self.last_used[rows, slots] = _NEVER

    def resident_pages(self, layer: int) -> list[int]:
        """(host sync: tests and reports only)"""
        return sorted(p for p in self.page_in[layer, : self.num_slots].tolist() if p >= 0)
