"""The XXH3-64 row kernel (`kernels/checksum`) against the spec, the `xxhash` package, under
TRITON_INTERPRET=1 on the CPU: every path of the long form (whole blocks, a partial last block,
no whole block, the last stripe overlapping the partial block), strided rows, one changed bit."""

import numpy as np
import pytest
import torch
import xxhash

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu tests the compiled kernel", allow_module_level=True)

from kernel_testing import import_interpreted

from msaserve.kernels.checksum import kernel_takes, xxh3_64_rows, xxh3_64_rows_naive

(_triton,) = import_interpreted("msaserve.kernels.checksum.triton")


def digests(rows: torch.Tensor) -> list[int]:
    return [xxhash.xxh3_64_intdigest(row) for row in rows.contiguous().numpy()]


def as_uint64(values: torch.Tensor) -> list[int]:
    return values.numpy().view(np.uint64).tolist()


@pytest.mark.parametrize("length", [256, 320, 1024, 1088, 2048, 4096 + 960, 131072])
def test_kernel_equals_xxhash(length):
    rows = torch.randint(0, 256, (2 if length > 8192 else 4, length), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(length))
    want = digests(rows)
    assert as_uint64(_triton.xxh3_64_rows_triton(rows)) == want
    assert as_uint64(xxh3_64_rows_naive(rows)) == want


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
