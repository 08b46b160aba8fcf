"""The decode experts path on CUDA (`moe/triton.py::decode_experts`, chosen by `grouped.experts` up to
`DECODE_MAX_SLOTS` slots) at M3's widths against the fp32 loop and the grouped GEMM path (its
capture in a CUDA graph: test_gpu_moe.py's decode step at one token)."""

import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))

from test_kernels_moe_cases import ALPHA, LIMIT, random_case, reference_experts, relative_error

from msaserve.kernels.moe import grouped
from msaserve.kernels.moe import triton as moe_triton


@pytest.mark.parametrize(("tokens", "top_k"), [(1, 4), (1, 1), (2, 2)])
def test_decode_experts_at_m3_widths(tokens: int, top_k: int) -> None:
    case = random_case(tokens, 6144, 3072, 16, torch.bfloat16, "cuda", seed=tokens * 7 + top_k)
    weights, ids = grouped.route(case.router_logits, case.correction_bias, top_k)
    assert ids.numel() <= grouped.DECODE_MAX_SLOTS
    out = grouped.experts(case.x, case.gate_up, case.down, ids, weights, ALPHA, LIMIT)  # the decode path
    direct = moe_triton.decode_experts(case.x, case.gate_up, case.down, ids, weights, ALPHA, LIMIT)
    assert torch.equal(out, direct)
    ref = reference_experts(case.x, case.gate_up, case.down, ids, weights, dtype=torch.float32)
    assert relative_error(out, ref) < 2e-2
    gemm = grouped.experts_grouped_gemm(case.x, case.gate_up, case.down, ids, weights, ALPHA, LIMIT)
    assert relative_error(out, gemm) < 2e-2
