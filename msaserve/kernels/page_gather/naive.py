"""The reference of `gather_pages`: boolean masking (a host sync on CUDA; none matters on CPU)."""

import torch


def gather_pages_naive(dst: torch.Tensor, dst_slots: torch.Tensor, src: torch.Tensor,
                       src_pages: torch.Tensor) -> None:
    take = dst_slots >= 0
    dst[dst_slots[take].to(dst.device)] = src[src_pages[take].to(src.device)].to(dst.device)


def gather_head_pages_naive(dst: torch.Tensor, dst_slots: torch.Tensor, src: torch.Tensor,
                            src_pages: torch.Tensor, present: torch.Tensor | None = None,
                            skipped: torch.Tensor | None = None) -> None:
    """dst [S, 2, H, P, D] (head-major slots), src [N, 2, P, H, D] (pages as the caches hold them);
    dst_slots, src_pages [H, M]: for every (h, i) with dst_slots[h, i] ≥ 0, head h's K and V of page
    src_pages[h, i] go to slot dst_slots[h, i]: dst[slot, :, h] = src[page, :, :, h].
    present [N] bool (optional): an entry whose page is not present is not copied; skipped [H, M]
    int64 (with present) gets its slot there (the caller copies it once the page is in), -1 elsewhere."""
    heads = torch.arange(dst_slots.shape[0], device=dst_slots.device)[:, None].expand_as(dst_slots)
    take = dst_slots >= 0
    if present is not None:
        here = present.to(dst_slots.device)[src_pages.clamp(min=0)]
        if skipped is not None:
            skipped.copy_(torch.where(take & ~here, dst_slots, -1).to(skipped.device))
        take = take & here
    slots, pages, h = dst_slots[take], src_pages[take], heads[take]
    columns = src[pages.to(src.device), :, :, h.to(src.device)]  # [n, 2, P, D]
    dst[slots.to(dst.device), :, h.to(dst.device)] = columns.to(dst.device)
