"""The decode ops' merges compiled on a CUDA GPU at the split counts the H200 gives the M3 decode
shapes (264 splits at batch 1, 33 at batch 8, 9 at batch 32; sparse decode 16, 8, 3 parts): every
split merge exactly as the selection rule, every LSE merge within fp32 rounding of the formula."""

import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))

from decode_merge_cases import candidates, lse_merge_formula, partials, selection_rule

from msaserve.kernels.indexer_decode import merge
from msaserve.kernels.triton_common import lse_merge


@pytest.mark.parametrize(("batch", "splits", "num_q"), [(1, 264, 1), (2, 264, 8), (8, 33, 1), (3, 9, 8),
                                                        (2, 100, 2)])
def test_split_merges(batch: int, splits: int, num_q: int) -> None:
    vals, ids = candidates(batch, 1, splits, num_q * 4, 16, seed=splits + num_q)
    want = selection_rule(vals, ids, num_q, 4, 16).cuda()
    vals, ids = vals.cuda(), ids.cuda()
    for method in merge.SPLIT_MERGES:
        out = torch.full_like(want, 7)
        merge.merge_splits(vals, ids, out, 4, method)
        assert torch.equal(out, want), f"{method}: {(out != want).nonzero()[:4].tolist()}"


@pytest.mark.parametrize(("rows", "parts", "heads_per_row"),
                         [(4, 16, 4), (32, 8, 4), (128, 3, 4), (4, 128, 4), (512, 16, 4)])
@pytest.mark.parametrize("with_valid", [False, True])
def test_lse_merges(rows: int, parts: int, heads_per_row: int, with_valid: bool) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        part_o, part_lse, valid = partials(rows, parts, 16, 128, dtype, seed=rows + parts)
        valid = valid if with_valid else None
        want = lse_merge_formula(part_o.float(), part_lse, valid, heads_per_row).cuda()
        args = (part_o.cuda(), part_lse.cuda(), None if valid is None else valid.cuda())
        for method in ("serial", "parts", "auto"):
            out = torch.full(want.shape, float("nan"), device="cuda")
            lse_merge(*args, out, method)
            torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
