"""XXH3-64 of many equal-length byte rows at once, on the device that holds them.

The KV cache service stores xxh3_64 beside every page and every reader checks it. Adoption's index
load copies a million-token session's index (1 GiB at the M3 shape) from the service's pinned
memory to the GPU; checking it on the host measured 14.8 GB/s with 8 threads on the H200's host
(host memory bound: 16 threads were no faster), which made the checks, not the copy (53 GB/s), the
bound of the load. `xxh3_64_rows` computes the same digests on the GPU from the bytes the copy
wrote (`triton.py`): the check then covers the whole path, host memory and the link included, and
costs the host nothing.

`xxh3_64_rows(rows)`: rows [N, L] uint8 → [N] int64 (the digest's 64 bits; compare with the stored
uint64 values viewed as int64). Triton on CUDA for rows of XXH3's long form that the kernel takes
(`kernel_takes(L)`: L a multiple of 64, at least 256 bytes); the host spec (`naive.py`, the `xxhash`
package) elsewhere.

`verify_pages(...)`: leased pages (an adopted session's pages read where they lie in the service's
pinned arena segments, `kernels.page_gather`'s src_offsets) are checked on the GPU the first time a
step copies them in, by the same kernel reading them through UVA: no host thread hashes the pages a
step needs before the step may use them, and the outcome (failures) is read after the step.
"""

import torch

from msaserve.kernels.checksum.naive import verify_pages_naive, xxh3_64_rows_naive


def kernel_takes(row_bytes: int) -> bool:
    """Rows of this length go through the Triton kernel (XXH3's long form, whole stripes)."""
    return row_bytes >= 256 and row_bytes % 64 == 0


def xxh3_64_rows(rows: torch.Tensor) -> torch.Tensor:
    """[N, L] uint8 → [N] int64: the xxh3_64 (seed 0) of each row, on rows' device, no host sync
    on CUDA."""
    if rows.dim() != 2 or rows.dtype != torch.uint8:
        raise ValueError(f"rows is {rows.dtype} {tuple(rows.shape)}: allowed a 2-D uint8 tensor [N, L]")
    if rows.device.type == "cuda" and kernel_takes(rows.shape[1]):
        from msaserve.kernels.checksum.triton import xxh3_64_rows_triton

        return xxh3_64_rows_triton(rows)
    return xxh3_64_rows_naive(rows)


def verify_pages(base: torch.Tensor, byte_offsets: torch.Tensor, expected: torch.Tensor,
                 verified: torch.Tensor, failures: torch.Tensor, pages: torch.Tensor, wanted: torch.Tensor,
                 page_bytes: int) -> None:
    """Check the pages a step copies in against their stored digests, once each.

    base: any tensor, its data_ptr() the base address (on CUDA a UVA view of pinned memory,
    `page_gather.host_view`); byte_offsets [N] int64: page n's page_bytes bytes start at
    base.data_ptr() + byte_offsets[n] (multiples of 8); expected [N] int64: the stored xxh3_64
    (uint64 bits); verified [N] uint8: 1 once a page is checked; failures [2] int64; pages and wanted
    (int64 or int32, any shape, as many entries; e.g. a step's selected pages and the slots they go
    to).
    For every entry with wanted ≥ 0, pages ≥ 0 and verified[page] 0: the page's xxh3_64 (seed 0)
    equal to expected[page] sets verified[page] = 1; otherwise failures[0] += 1 and failures[1] =
    page (one of the failing pages). A page named by several entries may be hashed more than once.
    Triton on CUDA (no host sync; page_bytes must be one `kernel_takes`), the host spec on CPU."""
    if verified.device.type == "cuda":
        if not kernel_takes(page_bytes):
            raise ValueError(f"page_bytes is {page_bytes} on CUDA: allowed a multiple of 64, at least 256 "
                             "(the kernel's long form)")
        from msaserve.kernels.checksum.triton import verify_pages_triton

        verify_pages_triton(base, byte_offsets, expected, verified, failures, pages, wanted, page_bytes)
    else:
        verify_pages_naive(base, byte_offsets, expected, verified, failures, pages, wanted, page_bytes)


__all__ = ["kernel_takes", "verify_pages", "verify_pages_naive", "xxh3_64_rows", "xxh3_64_rows_naive"]
