"""The reference admission: fixed-size tensor ops (about 50 launches on CUDA, no host sync).

1. the selection is flattened to M = Hkv·K entries; the first entry of each distinct page counts;
2. entries whose page has a slot are hits: their slot is marked used in this step;
3. the r-th miss (in entry order) takes the r-th best selection slot: free first, then the least
   recently used, then the lower slot; never one used in this step; the page it held loses its slot.
"""

import torch

FREE = -2
USED_NOW = 1 << 40
"""Key of a slot selected in this step (above every step number: never a victim)."""


def victim_order(page_in: torch.Tensor, last_used: torch.Tensor, step: int | torch.Tensor,
                 ring: int) -> torch.Tensor:
    """→ [num_slots - ring] selection slots, best victim first."""
    num_slots = page_in.numel() - 1
    general = torch.arange(ring, num_slots, device=page_in.device)
    used = last_used[general]
    key = torch.where(page_in[general] < 0, FREE, used)
    key = torch.where(used == step, USED_NOW, key)
    composite = (key - FREE) * (num_slots + 1) + general  # distinct and ≥ 0: a deterministic order
    return torch.sort(composite).values % (num_slots + 1)


def admit_naive(selected: torch.Tensor, slot_of: torch.Tensor, page_in: torch.Tensor, last_used: torch.Tensor,
                counters: torch.Tensor, step: int | torch.Tensor,
                ring: int) -> tuple[torch.Tensor, torch.Tensor]:
    if slot_of.dim() == 2:  # R working sets, one row each: admitted one after another
        rows = check_rows(selected, slot_of, page_in, last_used, counters)
        out = [_admit_one(selected[r], slot_of[r], page_in[r], last_used[r], counters[r], step, ring)
               for r in range(rows)]
        return torch.stack([d for d, _ in out]), torch.stack([p for _, p in out])
    return _admit_one(selected, slot_of, page_in, last_used, counters, step, ring)


def check_rows(selected: torch.Tensor, slot_of: torch.Tensor, page_in: torch.Tensor, last_used: torch.Tensor,
               counters: torch.Tensor) -> int:
    """The row count of a batched admission, its shapes checked."""
    rows = slot_of.shape[0]
    for name, t in (("selected", selected), ("page_in", page_in), ("last_used", last_used),
                    ("counters", counters)):
        if t.dim() != 2 or t.shape[0] != rows:
            raise ValueError(f"{name} is {tuple(t.shape)} with slot_of {tuple(slot_of.shape)}: allowed "
                             f"[{rows}, n] (one row per working set)")
    return rows


def _admit_one(selected: torch.Tensor, slot_of: torch.Tensor, page_in: torch.Tensor, last_used: torch.Tensor,
               counters: torch.Tensor, step: int | torch.Tensor,
               ring: int) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(step, torch.Tensor):
        step = step.reshape(())  # a 0-dim tensor works wherever the int does, with no host read
    max_pages, num_slots = slot_of.numel() - 1, page_in.numel() - 1
    pages = selected.reshape(-1).long()
    valid = pages >= 0
    pages = pages.clamp(min=0)
    same = (pages[:, None] == pages[None, :]) & valid[None, :]
    first = valid & ~torch.tril(same, diagonal=-1).any(dim=1)
    slots = slot_of[pages].long()
    hit, miss = first & (slots >= 0), first & (slots < 0)
    spare_slot = torch.full_like(pages, num_slots)
    last_used.index_fill_(0, torch.where(hit, slots, spare_slot), step)
    order = victim_order(page_in, last_used, step, ring)
    rank = (torch.cumsum(miss.long(), 0) - 1).clamp(0, order.numel() - 1)
    dst = torch.where(miss, order[rank], -1)
    target = torch.where(miss, dst, spare_slot)
    old = page_in[target]
    evicted = miss & (old >= 0)
    slot_of.index_fill_(0, torch.where(evicted, old, max_pages), -1)
    page_in.scatter_(0, target, pages)
    last_used.index_fill_(0, target, step)
    slot_of.scatter_(0, torch.where(miss, pages, max_pages), dst.to(slot_of.dtype))
    counters += torch.stack([miss.sum(), evicted.sum(), miss.any().long()])
    return dst, pages
