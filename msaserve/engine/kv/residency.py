"""Sparse-KV residency: one layer's GPU working set of K/V pages, and which page it evicts.

MSA reads, per step and KV head, the K/V of only `top_k` blocks (docs/design.md §2): 16 of ~8,192
for a 1M-token M3 session. A session can therefore decode with every index page on the GPU (the
indexer scans them all) and only a small working set of K/V pages there; the rest lives in the
host tier (`host_tier.py`) and is copied in when selected (`resident_session.py`).

Each layer's K/V pool has `num_slots` pages:
- slots `[0, ring)` are the **write ring**: page c, the one new tokens go into, sits at slot
  `c % ring` in every layer (so one slot mapping serves all layers) with the pages just before it;
  a page leaves the ring `ring` pages after it started, long after it was written back to the host
  tier (write-behind when it filled), so dropping it loses nothing;
- slots `[ring, num_slots)` hold **selected pages**: a selected page not resident takes a free
  slot, else the slot of the page least recently selected (never one selected in this step).
The local pages (the `n_local` blocks ending at the query's, always selected) stay: the newest
`ring ≥ n_local + 1` pages are in the ring, and a page selected again keeps its slot.
"""

import numpy as np


class ResidencyBudgetError(ValueError):
    """A step selected more distinct pages than the working set can hold."""


class WorkingSet:
    """One layer's K/V slots on the GPU: the logical page in each, and the eviction policy."""

    def __init__(self, num_slots: int, ring: int) -> None:
        if ring < 2 or num_slots <= ring:
            raise ValueError(f"num_slots={num_slots}, ring={ring} is invalid: allowed ring ≥ 2 and "
                             "num_slots > ring (the ring holds the pages being written)")
        self.num_slots, self.ring = num_slots, ring
        self.page_in = np.full(num_slots, -1, dtype=np.int64)
        """[num_slots] the logical page each slot holds (-1: free)."""
        self.last_selected = np.full(num_slots, -1, dtype=np.int64)
        """[num_slots] the step its page was last selected in (-1: never)."""
        self.slot_of: dict[int, int] = {}
        self.evictions = 0

    def place_write_page(self, page: int) -> tuple[int, int]:
        """Page `page` starts receiving tokens: it takes ring slot page % ring → (slot, the page
        it displaced or -1). A copy of the page in a selection slot is dropped (stale now)."""
        slot = page % self.ring
        old = int(self.page_in[slot])
        if old >= 0:
            del self.slot_of[old]
        stale = self.slot_of.pop(page, None)
        if stale is not None:
            self.page_in[stale], self.last_selected[stale] = -1, -1
        self.page_in[slot], self.last_selected[slot] = page, -1
        self.slot_of[page] = slot
        return slot, old

    def admit(self, pages: list[int], step: int) -> list[tuple[int, int]]:
        """This step selected `pages` (distinct): mark them used and give the non-resident ones a
        slot, evicting least recently selected pages → [(page, slot)] to fill, in `pages` order."""
        for page in pages:
            slot = self.slot_of.get(page)
            if slot is not None:
                self.last_selected[slot] = step
        missing = [p for p in pages if p not in self.slot_of]
        if not missing:
            return []
        general = np.arange(self.ring, self.num_slots)
        free_to_take = self.last_selected[general] < step  # not selected in this step
        candidates = general[free_to_take]
        if len(candidates) < len(missing):
            raise ResidencyBudgetError(
                f"a step selected {len(pages)} pages ({len(missing)} not resident) but only "
                f"{len(candidates)} of the {self.num_slots - self.ring} selection slots are free to "
                f"take: allowed a page budget ≥ ring + Hkv·top_k")
        # Free slots first (page -1 sorts as step -2), then the least recently selected.
        keys = np.where(self.page_in[candidates] < 0, -2, self.last_selected[candidates])
        victims = candidates[np.argsort(keys, kind="stable")[: len(missing)]]
        filled = []
        for page, slot in zip(missing, victims.tolist(), strict=True):
            old = int(self.page_in[slot])
            if old >= 0:
                del self.slot_of[old]
                self.evictions += 1
            self.page_in[slot], self.last_selected[slot] = page, step
            self.slot_of[page] = slot
            filled.append((page, slot))
        return filled

    def resident_pages(self) -> list[int]:
        return sorted(self.slot_of)
