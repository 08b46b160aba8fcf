"""The grouped MoE path on CUDA (bf16, CUTLASS grouped GEMM via torch._grouped_mm, the Triton
routing / SwiGLU / combine kernels) against the per-expert loop in fp32 and the spec (moe/naive.py)
at M3's widths (hidden 6144, intermediate 3072), and a decode step captured in a CUDA graph against
the same step run eagerly."""

import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))

from test_kernels_moe_cases import (
    ALPHA,
    LIMIT,
    clear_margin,
    random_case,
    reference_experts,
    reference_route,
    relative_error,
    sorted_by_id,
)

from msaserve.kernels.moe import grouped, naive
from msaserve.kernels.moe import triton as moe_triton

BF16 = torch.bfloat16


@pytest.mark.parametrize("tokens", [1, 64, 999])
def test_grouped_experts_bf16_at_m3_widths(tokens: int) -> None:
    """8 experts of M3's size (expert 5 never chosen), top-4. Four bf16 roundings (gate_up rows,
    SwiGLU, down rows, output) against an fp32 loop: about 5e-3 expected, 2e-2 allowed."""
    case = random_case(tokens, 6144, 3072, 8, BF16, "cuda", seed=tokens, unused_experts=(5,))
    weights, ids = grouped.route(case.router_logits, case.correction_bias, 4)
    out = grouped.experts(case.x, case.gate_up, case.down, ids, weights, ALPHA, LIMIT)
    assert out.dtype == BF16 and out.shape == case.x.shape
    ref = reference_experts(case.x, case.gate_up, case.down, ids, weights, dtype=torch.float32)
    assert relative_error(out, ref) < 2e-2
    spec = naive.experts(case.x, case.gate_up, case.down, ids, weights, ALPHA, LIMIT)  # the bf16 loop
    assert relative_error(out, spec) < 2e-2


def test_fused_route_on_gpu() -> None:
    case = random_case(4099, 8, 8, 128, torch.float32, "cuda", seed=7)
    weights, ids = moe_triton.route(case.router_logits, case.correction_bias, 4)
    ref_weights, ref_ids = reference_route(case.router_logits, case.correction_bias, 4)
    weights, ids = sorted_by_id(weights, ids)
    clear = clear_margin(case.router_logits, case.correction_bias, 4)
    assert int(clear.sum()) > 4000
    assert torch.equal(ids[clear], ref_ids[clear])
    torch.testing.assert_close(weights[clear].double(), ref_weights[clear], rtol=1e-6, atol=1e-6)


def test_fp32_on_cuda_falls_back_and_matches() -> None:
    case = random_case(37, 64, 32, 8, torch.float32, "cuda", seed=2, unused_experts=(0,))
    weights, ids = grouped.route(case.router_logits, case.correction_bias, 3)
    out = grouped.experts(case.x, case.gate_up, case.down, ids, weights, ALPHA, LIMIT)
    ref = reference_experts(case.x.cpu(), case.gate_up.cpu(), case.down.cpu(), ids.cpu(), weights.cpu())
    assert relative_error(out, ref) < 1e-5


@pytest.mark.parametrize("tokens", [64, 1])
@torch.inference_mode()
def test_decode_step_is_cuda_graph_capturable(tokens: int) -> None:
    """route + experts captured once (64 tokens: the grouped GEMMs; 1 token: the decode path);
    replayed on new logits and activations copied into the captured buffers, it must give what an
    eager call on them gives."""
    first = random_case(tokens, 512, 256, 32, BF16, "cuda", seed=11)
    second = random_case(tokens, 512, 256, 32, BF16, "cuda", seed=12)
    logits, x = first.router_logits.clone(), first.x.clone()

    def step() -> torch.Tensor:
        weights, ids = grouped.route(logits, first.correction_bias, 4)
        return grouped.experts(x, first.gate_up, first.down, ids, weights, ALPHA, LIMIT)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    logits.copy_(second.router_logits)
    x.copy_(second.x)
    graph.replay()
    eager = step()
    torch.cuda.synchronize()
    assert relative_error(captured, eager) < 1e-6
    weights, ids = grouped.route(second.router_logits, first.correction_bias, 4)
    ref = reference_experts(second.x, first.gate_up, first.down, ids, weights, dtype=torch.float32)
    assert relative_error(captured, ref) < 2e-2


@pytest.mark.parametrize("rows", [1, 300])
def test_clamped_swiglu_round_steps_compiled_matches_the_spec(rows: int) -> None:
    """M3's dense MLP and shared expert run the SwiGLU in one launch that rounds where the spec's
    bf16 PyTorch ops do (12288 wide: the dense MLP's): nearly every value equal, none over a step."""
    gen = torch.Generator(device="cuda").manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 12288, generator=gen, device="cuda") * 6).to(torch.bfloat16)
    out = moe_triton.clamped_swiglu(gate_up, ALPHA, LIMIT, round_steps=True)
    want = naive.clamped_swiglu(gate_up, ALPHA, LIMIT)
    step = (want.float().abs() * 2**-7).clamp_min(1e-30) * 1.01
    assert ((out.float() - want.float()).abs() <= step).all()
    assert (out != want).float().mean() < 0.01
