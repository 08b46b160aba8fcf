"""Copy a bounded list of pages into a page pool, skipping the entries marked -1, with no host sync:
the miss fill of sparse-KV residency (`msaserve/engine/kv/device_working_set.py`).

`gather_pages(dst, dst_slots, src, src_pages)`: for every i with dst_slots[i] ≥ 0,
`dst[dst_slots[i]] = src[src_pages[i]]`. The list has a fixed length (one step's selection, Hkv·K),
so the caller never learns on the host how many pages missed. On CUDA the source may be pinned host
memory seen through `host_view` (UVA): the kernel reads the missed pages straight over PCIe, on the
compute stream, after the indexer that chose them and before the attention that reads them.

Leased pages (`src_offsets`): an adopted session's pages stay where the KV cache service keeps them,
in its pinned arena segments, instead of being copied into the host tier first. Each lies in an
allocation of its own, so it cannot be an element of one src tensor; with src_offsets [N] int64, page
n starts at element src_offsets[n] from src.data_ptr() (negative or outside src's own memory alike:
one address space, UVA on CUDA, plain host memory on CPU) and is laid out as src[0]. src then gives
only the base address, the dtype and the page layout; src_pages (and `present`) index src_offsets.
"""

import torch

from msaserve.kernels.page_gather.naive import gather_head_pages_naive, gather_pages_naive
from msaserve.kernels.page_gather.uva import host_view


def gather_pages(dst: torch.Tensor, dst_slots: torch.Tensor, src: torch.Tensor,
                 src_pages: torch.Tensor, *, src_offsets: torch.Tensor | None = None) -> None:
    """dst [S, ...] and src [N, ...] pages of one shape; dst_slots, src_pages [M] int (-1 in
    dst_slots: skip); src_offsets [N] int64 on dst's device (optional: the pages' element offsets
    from src's address, see above). Triton on CUDA (no host sync), the naive reference elsewhere."""
    if dst.shape[1:] != src.shape[1:] or dst.dtype != src.dtype:
        raise ValueError(f"dst pages {tuple(dst.shape[1:])} {dst.dtype} and src pages {tuple(src.shape[1:])} "
                         f"{src.dtype} differ: allowed the same page shape and dtype")
    if dst.device.type == "cuda":
        from msaserve.kernels.page_gather.triton import gather_pages_triton

        gather_pages_triton(dst, dst_slots, src, src_pages, src_offsets=src_offsets)
    else:
        gather_pages_naive(dst, dst_slots, src, src_pages, src_offsets=src_offsets)


def gather_head_pages(dst: torch.Tensor, dst_slots: torch.Tensor, src: torch.Tensor,
                      src_pages: torch.Tensor, present: torch.Tensor | None = None,
                      skipped: torch.Tensor | None = None, *,
                      src_offsets: torch.Tensor | None = None) -> None:
    """The head-granular miss fill: dst [S, 2, H, P, D] (a pool of head-major slots), src
    [N, 2, P, H, D] (pages as the caches and the host tier hold them); dst_slots, src_pages [H, M]
    (-1 in dst_slots: skip): dst[dst_slots[h, i], :, h] = src[src_pages[h, i], :, :, h], i.e. only
    head h's K and V of the page — a quarter of it at Hkv 4. Triton on CUDA (no host sync; src may
    be pinned host memory through `host_view`), the naive reference elsewhere.
    present [N] bool on dst's device, with skipped [H, M] int64 (both or neither): entries whose page
    is not present are not copied, and skipped holds their slots (-1 elsewhere), so that a step
    replayed before its pages reached the host tier can tell which slots to fill and run again
    (`resident_session.py`).
    src_offsets [N] int64 on dst's device (optional): leased pages, page n at element
    src_offsets[n] from src's address, laid out as src[0] (see above); present is indexed by the
    same page numbers."""
    if dst.dtype != src.dtype:
        raise ValueError(f"dst is {dst.dtype} and src {src.dtype}: allowed one dtype")
    if (present is None) != (skipped is None):
        raise ValueError("present and skipped go together: allowed both or neither")
    if dst.device.type == "cuda":
        from msaserve.kernels.page_gather.triton import gather_head_pages_triton

        gather_head_pages_triton(dst, dst_slots, src, src_pages, present, skipped, src_offsets=src_offsets)
    else:
        gather_head_pages_naive(dst, dst_slots, src, src_pages, present, skipped, src_offsets=src_offsets)


__all__ = ["gather_head_pages", "gather_head_pages_naive", "gather_pages", "gather_pages_naive", "host_view"]
