"""The reference of `gather_pages`: boolean masking (a host sync on CUDA; none matters on CPU).

With `src_offsets` (leased pages: each page where it lies in another host allocation, at an element
offset from src's address) the reference reads each page it copies from memory by its address, on
the host: the pages are not elements of src, so src cannot be indexed for them."""

import ctypes

import torch


def check_src_offsets(src_offsets: torch.Tensor | None) -> None:
    """src_offsets: None, or an int64 [N] contiguous tensor (element offsets of the pages from src's
    address, indexed by page number)."""
    if src_offsets is None:
        return
    if src_offsets.dtype != torch.int64 or src_offsets.dim() != 1 or not src_offsets.is_contiguous():
        raise ValueError(f"src_offsets is {src_offsets.dtype} {tuple(src_offsets.shape)} strides "
                         f"{src_offsets.stride()}: allowed a contiguous 1-D int64 tensor [N]")


def _leased_pages(src: torch.Tensor, src_offsets: torch.Tensor,
                  pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """→ (the distinct pages of `pages` read from memory, [U, *src.shape[1:]] on the CPU, each
    page laid out with src's strides at element src_offsets[page] from src.data_ptr(); `pages`
    renumbered into that stack). Reads nothing for an empty list."""
    if src.device.type != "cpu":
        raise ValueError(f"src is on {src.device}: the naive gather by offsets reads host memory only; "
                         "allowed a CPU src")
    offsets = src_offsets.cpu()
    unique, inverse = torch.unique(pages.cpu(), return_inverse=True)
    bad = unique[(unique < 0) | (unique >= offsets.numel())]
    if bad.numel():
        raise ValueError(f"src_pages holds page {int(bad[0])} to copy: allowed 0 ≤ page < "
                         f"{offsets.numel()} (the length of src_offsets)")
    shape, strides, size = src.shape[1:], src.stride()[1:], src.element_size()
    span = 1 + sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) if all(shape) else 0
    stack = torch.empty((unique.numel(), *shape), dtype=src.dtype)
    if span == 0:
        return stack, inverse
    base = src.data_ptr()
    for u, offset in enumerate(offsets[unique].tolist()):
        raw = (ctypes.c_uint8 * (span * size)).from_address(base + offset * size)
        flat = torch.frombuffer(raw, dtype=torch.uint8).view(src.dtype)
        stack[u] = flat.as_strided(shape, strides)  # a copy: raw is not kept
    return stack, inverse


def gather_pages_naive(dst: torch.Tensor, dst_slots: torch.Tensor, src: torch.Tensor,
                       src_pages: torch.Tensor, *, src_offsets: torch.Tensor | None = None) -> None:
    """dst[dst_slots[i]] = page src_pages[i] for every i with dst_slots[i] ≥ 0: src[page], or with
    src_offsets the page at element src_offsets[page] from src's address (src on the CPU)."""
    check_src_offsets(src_offsets)
    take = dst_slots >= 0
    if src_offsets is None:
        dst[dst_slots[take].to(dst.device)] = src[src_pages[take].to(src.device)].to(dst.device)
        return
    stack, pages = _leased_pages(src, src_offsets, src_pages[take])
    dst[dst_slots[take].to(dst.device)] = stack[pages].to(dst.device)


def gather_head_pages_naive(dst: torch.Tensor, dst_slots: torch.Tensor, src: torch.Tensor,
                            src_pages: torch.Tensor, present: torch.Tensor | None = None,
                            skipped: torch.Tensor | None = None, *,
                            src_offsets: torch.Tensor | None = None) -> None:
    """dst [S, 2, H, P, D] (head-major slots), src [N, 2, P, H, D] (pages as the caches hold them);
    dst_slots, src_pages [H, M]: for every (h, i) with dst_slots[h, i] ≥ 0, head h's K and V of page
    src_pages[h, i] go to slot dst_slots[h, i]: dst[slot, :, h] = src[page, :, :, h].
    present [N] bool (optional): an entry whose page is not present is not copied; skipped [H, M]
    int64 (with present) gets its slot there (the caller copies it once the page is in), -1 elsewhere.
    src_offsets [N] int64 (optional): page n lies at element src_offsets[n] from src's address,
    laid out as src[0] (src on the CPU); only the pages copied are read."""
    check_src_offsets(src_offsets)
    heads = torch.arange(dst_slots.shape[0], device=dst_slots.device)[:, None].expand_as(dst_slots)
    take = dst_slots >= 0
    if present is not None:
        here = present.to(dst_slots.device)[src_pages.clamp(min=0)]
        if skipped is not None:
            skipped.copy_(torch.where(take & ~here, dst_slots, -1).to(skipped.device))
        take = take & here
    slots, pages, h = dst_slots[take], src_pages[take], heads[take]
    if src_offsets is not None:
        src, pages = _leased_pages(src, src_offsets, pages)
    columns = src[pages.to(src.device), :, :, h.to(src.device)]  # [n, 2, P, D]
    dst[slots.to(dst.device), :, h.to(dst.device)] = columns.to(dst.device)
