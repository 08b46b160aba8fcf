"""The compiled XXH3-64 row kernel (`kernels/checksum`) against the `xxhash` package on the GPU,
at the index page sizes adoption checks (M3: 128 KiB with 4 layers; fp8 index with scales)."""

import numpy as np
import pytest
import torch
import xxhash

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from msaserve.kernels.checksum import xxh3_64_rows


@pytest.mark.parametrize("length", [256, 1088, 32768, 65536 + 2048, 131072])
def test_gpu_digests_equal_xxhash(length):
    generator = torch.Generator().manual_seed(length)
    rows = torch.randint(0, 256, (300, length), dtype=torch.uint8, generator=generator)
    got = xxh3_64_rows(rows.cuda()).cpu().numpy().view(np.uint64).tolist()
    assert got == [xxhash.xxh3_64_intdigest(row) for row in rows.numpy()]

