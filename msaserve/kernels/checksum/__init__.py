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
"""

import torch

from msaserve.kernels.checksum.naive import xxh3_64_rows_naive


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


__all__ = ["kernel_takes", "xxh3_64_rows", "xxh3_64_rows_naive"]
