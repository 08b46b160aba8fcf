"""`gather_pages` as one Triton launch: program (i, c) copies chunk c of entry i's page, or returns at
once when dst_slots[i] < 0. The source may be pinned host memory through a UVA view (`uva.py`)."""

import torch
import triton
import triton.language as tl

BLOCK = 4096
"""Elements per program: 8 KiB of bf16, so a 256 KiB M3 page is 32 programs in flight."""


@triton.jit
def _gather_pages_kernel(dst, src, dst_slots, src_pages, page_elems, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    chunk = tl.program_id(1)
    slot = tl.load(dst_slots + i).to(tl.int64)
    if slot >= 0:
        page = tl.load(src_pages + i).to(tl.int64)
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        mask = offs < page_elems
        x = tl.load(src + page * page_elems + offs, mask=mask)
        tl.store(dst + slot * page_elems + offs, x, mask=mask)


def gather_pages_triton(dst: torch.Tensor, dst_slots: torch.Tensor, src: torch.Tensor,
                        src_pages: torch.Tensor) -> None:
    """dst [S, ...], src [N, ...]: each page contiguous, pages at a stride of one page."""
    page_elems = dst[0].numel()
    for name, t in (("dst", dst), ("src", src)):
        if not t[0].is_contiguous() or t.stride(0) != page_elems:
            raise ValueError(f"{name} has page stride {t.stride(0)}: allowed contiguous pages "
                             f"(stride {page_elems})")
    if dst_slots.shape != src_pages.shape or dst_slots.dim() != 1:
        raise ValueError(f"dst_slots {tuple(dst_slots.shape)} and src_pages {tuple(src_pages.shape)}: "
                         "allowed two 1-D tensors of one length")
    if dst_slots.numel() == 0:
        return
    grid = (dst_slots.numel(), triton.cdiv(page_elems, BLOCK))
    _gather_pages_kernel[grid](dst, src, dst_slots, src_pages, page_elems, BLOCK=BLOCK)
