"""The page gathers by element offsets (`kernels/page_gather`, src_offsets: leased pages that lie in
other host allocations, read at an offset from src's address) under TRITON_INTERPRET=1 on the CPU:
the Triton kernels against the naive reference and against the pages themselves, with pages in a
separate arena, before src in its own allocation (negative offsets) and inside src, -1 entries,
absent pages (whose offsets are never read) and the argument checks."""

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu tests the compiled kernels", allow_module_level=True)

from kernel_testing import import_interpreted

from msaserve.kernels.page_gather import (
    gather_head_pages,
    gather_head_pages_naive,
    gather_pages,
    gather_pages_naive,
)


@pytest.fixture
def triton_gather():
    (module,) = import_interpreted("msaserve.kernels.page_gather.triton")
    module.BLOCK = 64  # several programs per page under the interpreter
    return module


def leased(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list]:
    """→ (src: 3 bf16 pages of `shape`, src_offsets [10] int64, table [10, *shape]: page n's values,
    the allocations to keep alive). Pages 0-4 lie in an arena tensor of their own at scattered
    element offsets, pages 5-7 in the allocation that src is the tail of, before src (negative
    offsets), pages 8-9 are src[2] and src[0]."""
    generator = torch.Generator().manual_seed(seed)
    elems = torch.Size(shape).numel()
    arena = torch.zeros(2 * (7 * elems + 96), dtype=torch.uint8).view(torch.bfloat16)  # leased pages
    block = torch.zeros(6 * elems + 40, dtype=torch.bfloat16)  # [pages 5-7 .. | src: 3 pages]
    src = block[-3 * elems :].view(3, *shape)
    src.copy_(torch.randn(3, *shape, generator=generator))
    starts = {0: 5 * elems + 7, 1: 3, 2: 2 * elems + 50, 3: 6 * elems + 11, 4: elems + 21,
              5: 2 * elems + 30, 6: 9, 7: elems + 17}
    pages = []
    for page, start in starts.items():
        memory = (arena if page < 5 else block)[start : start + elems].view(shape)
        memory.copy_(torch.randn(shape, generator=generator))
        pages.append(memory)
    pages += [src[2], src[0]]
    offsets = torch.tensor([(p.data_ptr() - src.data_ptr()) // 2 for p in pages], dtype=torch.int64)
    assert (offsets[5:8] < 0).all() and offsets[8] == 2 * elems and offsets[9] == 0
    return src, offsets, torch.stack(pages), [arena, block]


def test_gather_pages_by_offsets_equals_the_pages(triton_gather):
    shape = (2, 4, 3, 8)
    src, offsets, table, _keep = leased(shape, 0)
    dst_slots = torch.tensor([4, -1, 0, -1, 2, 1, 5, 3])
    src_pages = torch.tensor([7, 1, 9, -1, 3, 0, 8, 5])
    want = torch.zeros(6, *shape, dtype=torch.bfloat16)
    for slot, page in zip(dst_slots.tolist(), src_pages.tolist(), strict=True):
        if slot >= 0:
            want[slot] = table[page]
    naive, got, routed = want.new_zeros(want.shape), want.new_zeros(want.shape), want.new_zeros(want.shape)
    gather_pages_naive(naive, dst_slots, src, src_pages, src_offsets=offsets)
    triton_gather.gather_pages_triton(got, dst_slots, src, src_pages, src_offsets=offsets)
    gather_pages(routed, dst_slots, src, src_pages, src_offsets=offsets)  # CPU: the reference
    assert torch.equal(naive, want) and torch.equal(got, want) and torch.equal(routed, want)


def test_gather_pages_by_offsets_ignores_src_page_stride(triton_gather):
    """src only gives the address, the dtype and the page layout: a src whose pages are not at a
    stride of one page (one page of a wider tensor) is taken with offsets, refused without."""
    shape = (2, 4, 3, 8)
    wide = torch.randn(2, 2, *shape).to(torch.bfloat16)
    src = wide[:, 0]  # page stride 2 pages
    offsets = torch.tensor([0, 2 * 192, 192], dtype=torch.int64)  # wide[0, 0], wide[1, 0], wide[0, 1]
    got = torch.zeros(3, *shape, dtype=torch.bfloat16)
    triton_gather.gather_pages_triton(got, torch.tensor([2, 0, 1]), src, torch.tensor([0, 1, 2]),
                                      src_offsets=offsets)
    assert torch.equal(got[2], wide[0, 0]) and torch.equal(got[0], wide[1, 0])
    assert torch.equal(got[1], wide[0, 1])
    with pytest.raises(ValueError, match=r"src has strides .*allowed contiguous pages at a stride of 192"):
        triton_gather.gather_pages_triton(got, torch.tensor([0]), src, torch.tensor([0]))


@pytest.mark.parametrize("check_present", [False, True])
def test_gather_head_pages_by_offsets_equals_the_pages(triton_gather, check_present):
    shape = (2, 16, 4, 8)  # [2, P, H, D]
    src, offsets, table, _keep = leased(shape, 1)
    dst_slots = torch.tensor([[4, -1, 0], [-1, 2, 4], [1, -1, 3], [5, 3, -1]])
    src_pages = torch.tensor([[7, 1, 9], [-1, 3, 2], [8, 0, 6], [6, 5, 4]])
    present = skipped = None
    if check_present:
        present = torch.ones(10, dtype=torch.bool)
        present[[6, 9]] = False
        offsets[6] = 1 << 40  # an absent page's offset is never read
        skipped = torch.full((4, 3), 7, dtype=torch.int64)
    want = torch.zeros(6, 2, 4, 16, 8, dtype=torch.bfloat16)
    for h in range(4):
        for slot, page in zip(dst_slots[h].tolist(), src_pages[h].tolist(), strict=True):
            if slot >= 0 and (present is None or present[page]):
                want[slot, :, h] = table[page, :, :, h]
    results = []
    for gather in (gather_head_pages_naive, triton_gather.gather_head_pages_triton, gather_head_pages):
        got = torch.zeros_like(want)
        flags = None if skipped is None else skipped.clone()
        gather(got, dst_slots, src, src_pages, present, flags, src_offsets=offsets)
        results.append((got, flags))
    for got, flags in results:
        assert torch.equal(got, want)
        if check_present:
            assert flags.tolist() == [[-1, -1, 0], [-1, -1, -1], [-1, -1, 3], [5, -1, -1]]
    assert torch.equal(want[4, :, 0], table[7, :, :, 0]) and torch.equal(want[4, :, 1], table[2, :, :, 1])


def test_offsets_are_checked(triton_gather):
    src = torch.randn(3, 2, 4).to(torch.bfloat16)
    dst = torch.zeros(2, 2, 4, dtype=torch.bfloat16)
    slots, pages = torch.tensor([0, 1]), torch.tensor([1, 0])
    cases = [(torch.tensor([0, 8], dtype=torch.int32), "src_offsets is torch.int32 \\(2,\\)"),
             (torch.zeros(2, 2, dtype=torch.int64), "src_offsets is torch.int64 \\(2, 2\\)"),
             (torch.zeros(4, dtype=torch.int64)[::2], "allowed a contiguous 1-D int64 tensor")]
    for offsets, message in cases:
        for gather in (gather_pages, gather_pages_naive, triton_gather.gather_pages_triton):
            with pytest.raises(ValueError, match=message):
                gather(dst, slots, src, pages, src_offsets=offsets)
    with pytest.raises(ValueError, match="src_pages holds page 2 to copy: allowed 0 ≤ page < 2"):
        gather_pages_naive(dst, slots, src, torch.tensor([1, 2]), src_offsets=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="the naive gather by offsets reads host memory only"):
        gather_pages_naive(dst, slots, src.to("meta"), pages, src_offsets=torch.tensor([0, 8]))
    gather_pages_naive(dst, torch.tensor([-1, -1]), src, torch.tensor([5, -1]),
                       src_offsets=torch.tensor([0, 8]))  # nothing to copy: no page checked or read
    assert not dst.any()
