"""The XXH3-64 row kernel (`kernels/checksum`) against the spec, the `xxhash` package, under
TRITON_INTERPRET=1 on the CPU: every path of the long form (whole blocks, a partial last block,
no whole block, the last stripe overlapping the partial block), whole groups of blocks and a partial
last group, strided rows, one changed bit; and the page check of leased pages (`verify_pages`), the
kernel against the host spec, on pages lying at byte offsets in an arena and in the base itself."""

import numpy as np
import pytest
import torch
import xxhash

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu tests the compiled kernel", allow_module_level=True)

from kernel_testing import import_interpreted

from msaserve.kernels.checksum import (
    kernel_takes,
    verify_pages,
    verify_pages_naive,
    xxh3_64_rows,
    xxh3_64_rows_naive,
)

(_triton,) = import_interpreted("msaserve.kernels.checksum.triton")


def digests(rows: torch.Tensor) -> list[int]:
    return [xxhash.xxh3_64_intdigest(row) for row in rows.contiguous().numpy()]


def as_uint64(values: torch.Tensor) -> list[int]:
    return values.numpy().view(np.uint64).tolist()


@pytest.fixture
def group():
    """Restores the kernels' groups of blocks after a test that changes them."""
    saved = _triton.GROUP, _triton.ROWS_GROUP
    yield
    _triton.GROUP, _triton.ROWS_GROUP = saved


# With groups of 4 blocks: 8 KiB + 64: two whole groups, no partial block; 9 KiB: two groups, a
# 15-stripe block; 17 KiB: four groups; 128 KiB: 31 groups and a partial group of 3.
@pytest.mark.parametrize("length", [256, 320, 1024, 1088, 2048, 4096 + 960, 8192 + 64, 9216, 17408, 131072])
def test_kernel_equals_xxhash(length):
    rows = torch.randint(0, 256, (2 if length > 8192 else 4, length), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(length))
    want = digests(rows)
    assert as_uint64(_triton.xxh3_64_rows_triton(rows)) == want
    assert as_uint64(xxh3_64_rows_naive(rows)) == want


@pytest.mark.parametrize("blocks", [1, 2, 4])
def test_grouped_blocks_equal_xxhash(group, blocks):
    """Groups of 1, 2 and 4 blocks over 7 whole blocks: whole groups only, and with a partial last
    group of 1 and of 3."""
    _triton.ROWS_GROUP = blocks
    rows = torch.randint(0, 256, (3, 7 * 1024 + 192), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(blocks))
    assert as_uint64(_triton.xxh3_64_rows_triton(rows)) == digests(rows)


def test_strided_rows_and_one_flipped_bit():
    generator = torch.Generator().manual_seed(1)
    base = torch.randint(0, 256, (6, 2048 + 64), dtype=torch.uint8, generator=generator)
    rows = base[1:5, 64:]  # strided rows, an offset of 64 bytes
    assert as_uint64(_triton.xxh3_64_rows_triton(rows)) == digests(rows)
    flipped = rows.clone()
    flipped[2, 1500] ^= 0x04
    got = as_uint64(_triton.xxh3_64_rows_triton(flipped))
    assert got == digests(flipped) and got[2] != digests(rows)[2] and got[:2] == digests(rows)[:2]


def test_dispatch_and_bad_inputs():
    assert kernel_takes(131072) and kernel_takes(256) and not kernel_takes(240) and not kernel_takes(1000)
    odd = torch.randint(0, 256, (3, 100), dtype=torch.uint8)
    assert as_uint64(xxh3_64_rows(odd)) == digests(odd)  # the host spec: any length
    with pytest.raises(ValueError, match="allowed a 2-D uint8 tensor"):
        xxh3_64_rows(torch.zeros(4, 256))
    with pytest.raises(ValueError, match="row length 1000 bytes: allowed a multiple of 64"):
        _triton.xxh3_64_rows_triton(torch.zeros(2, 1000, dtype=torch.uint8))


def leased_pages(page_bytes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list]:
    """→ (base: 2 pages of bytes, byte_offsets [8] int64, expected [8] int64, the pages' memory).
    Pages 0-5 lie in an arena tensor of their own at scattered 64-byte aligned offsets (some before
    and some after base in memory, as allocated), pages 6 and 7 are base's second and first page."""
    generator = torch.Generator().manual_seed(seed)
    arena = torch.randint(0, 256, (8 * page_bytes,), dtype=torch.uint8, generator=generator)
    base = torch.randint(0, 256, (2, page_bytes), dtype=torch.uint8, generator=generator)
    starts = [5 * page_bytes + 64, 128, 3 * page_bytes + 320, 7 * page_bytes - 64 * 3, 2 * page_bytes,
              page_bytes + 192]
    pages = [arena[s : s + page_bytes] for s in starts] + [base[1], base[0]]
    offsets = torch.tensor([p.data_ptr() - base.data_ptr() for p in pages], dtype=torch.int64)
    expected = torch.from_numpy(np.array([xxhash.xxh3_64_intdigest(p.numpy()) for p in pages],
                                         dtype=np.uint64).view(np.int64))
    return base, offsets, expected, [arena, base]


# Groups of 4 (the default) and others: 2 KiB, one whole block and a partial one; 3 KiB + 64: three
# whole blocks (a partial group only with 4, a group and a partial one with 2); 9 KiB + 192: nine.
@pytest.mark.parametrize(("page_bytes", "blocks"), [(2048, 4), (3072 + 64, 4), (3072 + 64, 2),
                                                    (9216 + 192, 4), (9216 + 192, 8)])
def test_verify_pages_kernel_equals_the_host_spec(group, page_bytes, blocks):
    """One page corrupt (its stored digest off by one bit): counted once, named; the good pages
    named by a wanted entry verified; pages named twice (and one both wanted and not) checked once
    in effect; a page named only by unwanted (-1) entries, or by -1, untouched; a pre-verified page
    not hashed (its digest is wrong, yet no failure)."""
    _triton.GROUP = blocks
    base, offsets, expected, _keep = leased_pages(page_bytes, page_bytes)
    expected[3] ^= 1  # corrupt: the stored digest disagrees with the bytes
    expected[5] ^= 1  # also wrong, but page 5 counts as checked already
    verified = torch.zeros(8, dtype=torch.uint8)
    verified[5] = 1
    pages = torch.tensor([[0, 3, 6, 0, 7], [2, 4, 5, -1, 6]])
    wanted = torch.tensor([[9, 1, -1, 4, 2], [0, -1, 3, 5, 8]])  # page 4 only unwanted; 1 never named
    results = []
    for check in (verify_pages_naive, _triton.verify_pages_triton, verify_pages):
        flags, failures = verified.clone(), torch.zeros(2, dtype=torch.int64)
        check(base, offsets, expected, flags, failures, pages, wanted, page_bytes)
        results.append((flags.tolist(), failures.tolist()))
    assert results[0] == ([1, 0, 1, 0, 0, 1, 1, 1], [1, 3])
    assert results[1] == results[0] and results[2] == results[0]


def test_verify_pages_checks_each_entry_again_until_verified():
    """A failing page stays unverified, so every step that copies it counts it again; a page that
    passes is hashed once (after that its bytes may change unnoticed: the check is of first use)."""
    base, offsets, expected, _keep = leased_pages(2048, 1)
    verified, failures = torch.zeros(8, dtype=torch.uint8), torch.zeros(2, dtype=torch.int64)
    expected[2] ^= 1 << 63
    for _ in range(2):
        _triton.verify_pages_triton(base, offsets, expected, verified, failures, torch.tensor([2, 6]),
                                    torch.tensor([0, 1]), 2048)
    assert failures.tolist() == [2, 2] and verified.tolist() == [0, 0, 0, 0, 0, 0, 1, 0]
    base[1, 0] ^= 0xFF  # page 6, verified: not hashed again
    _triton.verify_pages_triton(base, offsets, expected, verified, failures, torch.tensor([6]),
                                torch.tensor([0]), 2048)
    assert failures.tolist() == [2, 2]


def test_verify_pages_bad_inputs():
    base, offsets, expected, _keep = leased_pages(2048, 2)
    verified, failures = torch.zeros(8, dtype=torch.uint8), torch.zeros(2, dtype=torch.int64)
    pages, wanted = torch.tensor([1, 2]), torch.tensor([0, 1])
    args = dict(base=base, byte_offsets=offsets, expected=expected, verified=verified, failures=failures,
                pages=pages, wanted=wanted, page_bytes=2048)
    cases = [(dict(verified=verified.bool()),
              r"verified is torch.bool \(8,\): allowed a contiguous torch.uint8"),
             (dict(expected=expected[:7]), r"expected is torch.int64 \(7,\): .*byte_offsets \(8\)"),
             (dict(failures=failures[:1]), r"failures is torch.int64 \(1,\): allowed a contiguous int64 "),
             (dict(wanted=wanted[:1]), r"pages \(2,\) and wanted \(1,\): allowed the same number"),
             (dict(pages=pages.float()), "pages is torch.float32: allowed int64"),
             (dict(page_bytes=0), "page_bytes is 0: allowed a positive int"),
             (dict(base=base.to("meta")), "base is on meta: allowed verified's device cpu")]
    for change, message in cases:
        for check in (verify_pages, _triton.verify_pages_triton):
            with pytest.raises(ValueError, match=message):
                check(**{**args, **change})
    with pytest.raises(ValueError, match="page_bytes is 1000: allowed a multiple of 64, at least 256"):
        _triton.verify_pages_triton(**{**args, "page_bytes": 1000})
    with pytest.raises(ValueError, match="pages holds page 8: allowed -1 or 0 ≤ page < 8"):
        verify_pages_naive(**{**args, "pages": torch.tensor([1, 8])})
    assert failures.tolist() == [0, 0]
    verify_pages(**{**args, "page_bytes": 1000})  # the host spec takes any length (here: all fail)
    assert failures.tolist() == [2, 2] and not verified.any()
