"""`gather_pages` as one Triton launch: program (i, c) copies chunk c of entry i's page, or returns at
once when dst_slots[i] < 0. The source may be pinned host memory through a UVA view (`uva.py`).

HAS_OFFSETS (leased pages): a page starts at element src_offsets[page] from src's address instead of
at page · (page stride), so one launch reads pages that lie in other pinned allocations (the KV cache
service's arena segments), all in the one address space UVA gives host memory."""

import math

import torch
import triton
import triton.language as tl

from msaserve.kernels.page_gather.naive import check_src_offsets

BLOCK = 4096
"""Elements per program: 8 KiB of bf16, so a 256 KiB M3 page is 32 programs in flight."""


@triton.jit
def _gather_pages_kernel(dst, src, dst_slots, src_pages, src_offsets, page_elems, BLOCK: tl.constexpr,
                         HAS_OFFSETS: tl.constexpr):
    i = tl.program_id(0)
    chunk = tl.program_id(1)
    slot = tl.load(dst_slots + i).to(tl.int64)
    if slot >= 0:
        page = tl.load(src_pages + i).to(tl.int64)
        start = tl.load(src_offsets + page) if HAS_OFFSETS else page * page_elems
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        mask = offs < page_elems
        x = tl.load(src + start + offs, mask=mask)
        tl.store(dst + slot * page_elems + offs, x, mask=mask)


def _page_contiguous(t: torch.Tensor) -> bool:
    """Whether one page of t (t[0]'s layout; t may hold no page) is contiguous."""
    expected = 1
    for size, stride in reversed(list(zip(t.shape[1:], t.stride()[1:], strict=True))):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _check_offsets_device(src_offsets: torch.Tensor | None, dst: torch.Tensor) -> None:
    check_src_offsets(src_offsets)
    if src_offsets is not None and src_offsets.device != dst.device:
        raise ValueError(f"src_offsets is on {src_offsets.device}: allowed dst's device {dst.device} "
                         "(the kernel reads it)")


def gather_pages_triton(dst: torch.Tensor, dst_slots: torch.Tensor, src: torch.Tensor,
                        src_pages: torch.Tensor, *, src_offsets: torch.Tensor | None = None) -> None:
    """dst [S, ...], src [N, ...]: each page contiguous, pages at a stride of one page; with
    src_offsets [N] int64 (on dst's device), page n at element src_offsets[n] from src's address
    (src's page stride then does not matter)."""
    _check_offsets_device(src_offsets, dst)
    page_elems = math.prod(dst.shape[1:])
    for name, t in (("dst", dst), ("src", src)):
        stride_ok = t.stride(0) == page_elems or (name == "src" and src_offsets is not None)
        if not _page_contiguous(t) or not stride_ok:
            at = "" if name == "src" and src_offsets is not None else f" at a stride of {page_elems}"
            raise ValueError(f"{name} has strides {t.stride()}: allowed contiguous pages{at}")
    if dst_slots.shape != src_pages.shape or dst_slots.dim() != 1:
        raise ValueError(f"dst_slots {tuple(dst_slots.shape)} and src_pages {tuple(src_pages.shape)}: "
                         "allowed two 1-D tensors of one length")
    if dst_slots.numel() == 0:
        return
    grid = (dst_slots.numel(), triton.cdiv(page_elems, BLOCK))
    has_offsets = src_offsets is not None
    _gather_pages_kernel[grid](dst, src, dst_slots, src_pages, src_offsets if has_offsets else dst_slots,
                               page_elems, BLOCK=BLOCK, HAS_OFFSETS=has_offsets)


@triton.jit
def _gather_head_pages_kernel(dst, src, dst_slots, src_pages, present, skipped, src_offsets, M,
                              P: tl.constexpr, D: tl.constexpr, ds0, ds1, ds2, ds3, ss0, ss1, ss2, ss3,
                              BLOCK_P: tl.constexpr, CHECK: tl.constexpr, HAS_OFFSETS: tl.constexpr):
    """Program (i, kv, chunk): rows chunk·BLOCK_P.. of entry i's head column (K or V) → its slot.
    CHECK: an entry whose page is not `present` is not copied; program (i, 0, 0) writes its slot
    to `skipped[i]` then (-1 for every other entry). HAS_OFFSETS: the page starts at element
    src_offsets[page] from src (read only for an entry that is copied)."""
    i = tl.program_id(0)
    kv = tl.program_id(1)
    chunk = tl.program_id(2)
    slot = tl.load(dst_slots + i).to(tl.int64)
    page = tl.load(src_pages + i).to(tl.int64)
    if CHECK:
        absent = tl.load(present + tl.maximum(page, 0)) == 0
        if (kv == 0) & (chunk == 0):
            tl.store(skipped + i, tl.where((slot >= 0) & absent, slot, -1))
        slot = tl.where(absent, -1, slot)
    if slot >= 0:
        head = (i // M).to(tl.int64)
        rows = chunk * BLOCK_P + tl.arange(0, BLOCK_P)
        cols = tl.arange(0, D)
        mask = (rows < P)[:, None]
        start = tl.load(src_offsets + page) if HAS_OFFSETS else page * ss0
        x = tl.load(src + start + kv * ss1 + rows[:, None] * ss2 + head * ss3 + cols[None, :], mask=mask)
        tl.store(dst + slot * ds0 + kv * ds1 + head * ds2 + rows[:, None] * ds3 + cols[None, :], x, mask=mask)


def gather_head_pages_triton(dst: torch.Tensor, dst_slots: torch.Tensor, src: torch.Tensor,
                             src_pages: torch.Tensor, present: torch.Tensor | None = None,
                             skipped: torch.Tensor | None = None, *,
                             src_offsets: torch.Tensor | None = None) -> None:
    """dst [S, 2, H, P, D], src [N, 2, P, H, D] (last dim contiguous); dst_slots, src_pages [H, M];
    present [N] bool and skipped [H, M] int64 (both or neither); src_offsets [N] int64 on dst's
    device (optional: page n at element src_offsets[n] from src's address, laid out as src[0]):
    see `gather_head_pages`."""
    _check_offsets_device(src_offsets, dst)
    if (present is None) != (skipped is None):
        raise ValueError("present and skipped go together: allowed both or neither")
    if skipped is not None and (skipped.shape != dst_slots.shape or skipped.dtype != torch.int64
                                or not skipped.is_contiguous()):
        raise ValueError(f"skipped is {skipped.dtype} {tuple(skipped.shape)}: allowed contiguous int64 "
                         f"{tuple(dst_slots.shape)}")
    _, two, heads, page_size, dim = dst.shape
    if src.shape[1:] != (two, page_size, heads, dim) or dst.stride(-1) != 1 or src.stride(-1) != 1:
        raise ValueError(f"dst {tuple(dst.shape)} and src {tuple(src.shape)}: allowed dst [S, 2, H, P, D] "
                         "and src [N, 2, P, H, D] with a contiguous last dim")
    if dst_slots.shape != src_pages.shape or dst_slots.dim() != 2 or dst_slots.shape[0] != heads:
        raise ValueError(f"dst_slots {tuple(dst_slots.shape)} and src_pages {tuple(src_pages.shape)}: "
                         f"allowed two [{heads}, M] tensors")
    m = dst_slots.shape[1]
    if m == 0:
        return
    block_p = min(page_size, max(1, BLOCK // dim))
    grid = (heads * m, two, triton.cdiv(page_size, block_p))
    check = present is not None
    flags = present.view(torch.uint8) if check and present.dtype == torch.bool else present
    _gather_head_pages_kernel[grid](dst, src, dst_slots.contiguous(), src_pages.contiguous(),
                                    flags if check else dst_slots, skipped if check else dst_slots,
                                    src_offsets if src_offsets is not None else dst_slots, m,
                                    P=page_size, D=dim, ds0=dst.stride(0), ds1=dst.stride(1),
                                    ds2=dst.stride(2), ds3=dst.stride(3), ss0=src.stride(0),
                                    ss1=src.stride(1), ss2=src.stride(2), ss3=src.stride(3), BLOCK_P=block_p,
                                    CHECK=check, HAS_OFFSETS=src_offsets is not None)
