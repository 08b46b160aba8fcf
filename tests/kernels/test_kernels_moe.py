"""The grouped MoE path (msaserve/kernels/moe/grouped.py) against the per-expert loop: the spec
(moe/naive.py), transformers' MiniMaxM3VL modules as the oracle where installed, and a float64
loop written from the contract; its Triton kernels
(moe/triton.py) against the PyTorch arithmetic under Triton's interpreter. Odd token counts,
experts that get no token, top-k 1..4."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

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

HAS_HF_M3 = importlib.util.find_spec("transformers.models.minimax_m3_vl") is not None
FP32_TOL = 1e-5  # fp32 sums in another order than the float64 reference


def _hf_modules(case, top_k: int):
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import (
        MiniMaxM3VLExperts,
        MiniMaxM3VLTopKRouter,
    )

    num_experts, two_inter, hidden = case.gate_up.shape
    config = MiniMaxM3VLTextConfig(
        hidden_size=hidden, intermediate_size=two_inter // 2, num_local_experts=num_experts,
        num_experts_per_tok=top_k, swiglu_alpha=ALPHA, swiglu_limit=LIMIT, experts_implementation="eager",
    )
    router, experts = MiniMaxM3VLTopKRouter(config), MiniMaxM3VLExperts(config)
    router.e_score_correction_bias.copy_(case.correction_bias)
    experts.gate_up_proj.data.copy_(case.gate_up)
    experts.down_proj.data.copy_(case.down)
    return router, experts


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("top_k", [1, 2, 3, 4])
@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_route_matches_reference(tokens: int, top_k: int, with_bias: bool) -> None:
    case = random_case(tokens, 16, 8, 12, torch.float32, "cpu", seed=tokens * 10 + top_k)
    bias = case.correction_bias if with_bias else None
    weights, ids = grouped.route(case.router_logits, bias, top_k)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (tokens, top_k)
    ref_weights, ref_ids = reference_route(case.router_logits, bias, top_k)
    weights, ids = sorted_by_id(weights, ids)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights.double(), ref_weights, rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(not HAS_HF_M3, reason="transformers without minimax_m3_vl")
@pytest.mark.parametrize("top_k", [1, 2, 3, 4])
@torch.no_grad()
def test_route_and_experts_match_transformers(top_k: int) -> None:
    """The HF router's logits through our route, HF's expert loop against ours, fp32."""
    case = random_case(37, 32, 16, 8, torch.float32, "cpu", seed=top_k)
    router, hf_experts = _hf_modules(case, top_k)
    torch.nn.init.normal_(router.weight, std=0.5)
    logits, hf_weights, hf_ids = router(case.x)
    weights, ids = grouped.route(logits, case.correction_bias, top_k)
    hf_weights, hf_ids = sorted_by_id(hf_weights, hf_ids)
    sorted_weights, sorted_ids = sorted_by_id(weights, ids)
    assert torch.equal(sorted_ids, hf_ids)
    torch.testing.assert_close(sorted_weights, hf_weights, rtol=1e-6, atol=1e-7)
    out = grouped.experts(case.x, case.gate_up, case.down, ids, weights, ALPHA, LIMIT)
    assert relative_error(out, hf_experts(case.x, ids, weights)) < FP32_TOL
    assert relative_error(out, reference_experts(case.x, case.gate_up, case.down, ids, weights)) < FP32_TOL


@pytest.mark.parametrize("top_k", [1, 2, 3, 4])
@pytest.mark.parametrize("tokens", [1, 5, 37])
def test_experts_match_loop_fp32(tokens: int, top_k: int) -> None:
    case = random_case(tokens, 32, 24, 9, torch.float32, "cpu", seed=tokens + 100 * top_k)
    weights, ids = grouped.route(case.router_logits, case.correction_bias, top_k)
    out = grouped.experts(case.x, case.gate_up, case.down, ids, weights, ALPHA, LIMIT)
    assert out.shape == case.x.shape and out.dtype == torch.float32
    assert relative_error(out, reference_experts(case.x, case.gate_up, case.down, ids, weights)) < FP32_TOL


@pytest.mark.parametrize("unused", [(), (0, 3, 10)])
@pytest.mark.parametrize("top_k", [1, 2, 3, 4])
@pytest.mark.parametrize("tokens", [1, 6, 29])
def test_route_and_experts_match_the_spec(tokens: int, top_k: int, unused: tuple[int, ...]) -> None:
    """moe/naive.py's route and loop against grouped's, fp32 (odd T, experts with no token)."""
    case = random_case(tokens, 40, 24, 11, torch.float32, "cpu", seed=tokens * 7 + top_k,
                       unused_experts=unused)
    spec_weights, spec_ids = naive.route(case.router_logits, case.correction_bias, top_k)
    weights, ids = grouped.route(case.router_logits, case.correction_bias, top_k)
    spec_weights, spec_ids = sorted_by_id(spec_weights, spec_ids)
    sorted_weights, sorted_ids = sorted_by_id(weights, ids)
    assert torch.equal(sorted_ids, spec_ids)
    torch.testing.assert_close(sorted_weights, spec_weights, rtol=1e-6, atol=1e-7)
    out = grouped.experts(case.x, case.gate_up, case.down, ids, weights, ALPHA, LIMIT)
    spec = naive.experts(case.x, case.gate_up, case.down, ids, weights, ALPHA, LIMIT)
    assert relative_error(out, spec) < FP32_TOL


@pytest.mark.parametrize("top_k", [1, 4])
def test_experts_with_no_tokens_are_skipped(top_k: int) -> None:
    """Experts 0, 3 and the last get no token: empty groups at the start, middle and end."""
    case = random_case(11, 32, 16, 8, torch.float32, "cpu", seed=5, unused_experts=(0, 3, 7))
    weights, ids = grouped.route(case.router_logits, case.correction_bias, top_k)
    layout = grouped.expert_rows(ids, 8)
    counts = torch.diff(layout.expert_ends, prepend=layout.expert_ends.new_zeros(1))
    assert counts[[0, 3, 7]].tolist() == [0, 0, 0] and int(counts.sum()) == 11 * top_k
    out = grouped.experts(case.x, case.gate_up, case.down, ids, weights, ALPHA, LIMIT)
    assert relative_error(out, reference_experts(case.x, case.gate_up, case.down, ids, weights)) < FP32_TOL


def test_expert_rows_layout() -> None:
    ids = torch.tensor([[2, 0], [2, 1], [0, 2], [4, 1], [2, 0]])
    layout = grouped.expert_rows(ids, 6)
    assert layout.expert_ends.tolist() == [3, 5, 9, 9, 10, 10]
    flat = ids.reshape(-1)
    rows_expert = flat[layout.row_of_slot.argsort()]  # expert of each row, in row order
    assert rows_expert.tolist() == sorted(flat.tolist())
    assert torch.equal(layout.token_of_row[layout.row_of_slot], torch.arange(5).repeat_interleave(2))


def test_unaligned_widths_fall_back_to_the_loop() -> None:
    """H = 18, I = 5 in fp32: rows of 72 and 20 bytes are not 16-byte aligned, which
    torch._grouped_mm refuses; the per-expert fallback must give the same function."""
    case = random_case(13, 18, 5, 6, torch.float32, "cpu", seed=9, unused_experts=(2,))
    weights, ids = grouped.route(case.router_logits, case.correction_bias, 3)
    assert not grouped._grouped_mm_serves(case.x, case.gate_up.transpose(1, 2))
    out = grouped.experts(case.x, case.gate_up, case.down, ids, weights, ALPHA, LIMIT)
    assert relative_error(out, reference_experts(case.x, case.gate_up, case.down, ids, weights)) < FP32_TOL


def test_experts_bf16() -> None:
    case = random_case(29, 64, 32, 8, torch.bfloat16, "cpu", seed=3)
    weights, ids = grouped.route(case.router_logits, case.correction_bias, 4)
    out = grouped.experts(case.x, case.gate_up, case.down, ids, weights, ALPHA, LIMIT)
    assert out.dtype == torch.bfloat16
    assert relative_error(out, reference_experts(case.x, case.gate_up, case.down, ids, weights)) < 1e-2


def test_zero_tokens() -> None:
    case = random_case(0, 16, 8, 4, torch.float32, "cpu", seed=1)
    weights, ids = grouped.route(case.router_logits, case.correction_bias, 2)
    assert weights.shape == ids.shape == (0, 2)
    assert grouped.experts(case.x, case.gate_up, case.down, ids, weights, ALPHA, LIMIT).shape == (0, 16)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"down": torch.zeros(4, 16, 9)}, "down has shape"),
        ({"gate_up": torch.zeros(4, 15, 16)}, "gate_up has shape"),
        ({"x": torch.zeros(3, 16, dtype=torch.bfloat16)}, "share a dtype"),
        ({"weights": torch.zeros(3, 3)}, "weights has shape"),
        ({"ids": torch.zeros(3, 2)}, "ids has shape"),
    ],
)
def test_experts_errors_name_the_field(change: dict, message: str) -> None:
    args = {"x": torch.zeros(3, 16), "gate_up": torch.zeros(4, 16, 16), "down": torch.zeros(4, 16, 8),
            "ids": torch.zeros(3, 2, dtype=torch.int64), "weights": torch.zeros(3, 2)}
    args.update(change)
    with pytest.raises(ValueError, match=message):
        grouped.experts(**args, swiglu_alpha=ALPHA, swiglu_limit=LIMIT)


def test_route_rejects_top_k_out_of_range() -> None:
    with pytest.raises(ValueError, match=r"top_k is 5, allowed 1\.\.4"):
        grouped.route(torch.zeros(2, 4), None, 5)


# ---------------------------------------------------------------- Triton kernels (interpreter on CPU)


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize(("tokens", "num_experts", "top_k"), [(1, 8, 1), (9, 12, 3), (17, 128, 4), (5, 6, 6)])
def test_triton_route_matches_reference(tokens: int, num_experts: int, top_k: int, with_bias: bool) -> None:
    case = random_case(tokens, 8, 8, num_experts, torch.float32, "cpu", seed=tokens + num_experts)
    bias = case.correction_bias if with_bias else None
    weights, ids = moe_triton.route(case.router_logits, bias, top_k)
    ref_weights, ref_ids = reference_route(case.router_logits, bias, top_k)
    weights, ids = sorted_by_id(weights, ids)
    clear = clear_margin(case.router_logits, bias, top_k)
    assert bool(clear.any())
    assert torch.equal(ids[clear], ref_ids[clear])
    torch.testing.assert_close(weights[clear].double(), ref_weights[clear], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "inter"), [(1, 8), (7, 24), (13, 1100)])
def test_triton_clamped_swiglu_matches_torch(rows: int, inter: int, dtype: torch.dtype) -> None:
    gate_up = (torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(rows)) * 6).to(dtype)
    out = moe_triton.clamped_swiglu(gate_up, ALPHA, LIMIT)
    gate, up = gate_up.double().chunk(2, dim=-1)
    gate, up = gate.clamp(max=LIMIT), up.clamp(-LIMIT, LIMIT)
    ref = (up + 1.0) * gate * torch.sigmoid(ALPHA * gate)
    assert out.dtype == dtype and relative_error(out, ref) < (FP32_TOL if dtype == torch.float32 else 1e-2)
    torch.testing.assert_close(out, grouped.clamped_swiglu(gate_up, ALPHA, LIMIT))  # dtype defaults


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "inter"), [(1, 8), (7, 24), (2, 1100)])
def test_triton_clamped_swiglu_round_steps_matches_spec(rows: int, inter: int, dtype: torch.dtype) -> None:
    """round_steps (M3's dense MLP and shared expert on CUDA) rounds where the spec's seven PyTorch
    ops do: fp32 equal up to sigmoid's last bit; bf16 within a step, which here is the interpreter's
    truncation (compiled, tests/gpu checks that nearly every value is equal)."""
    gate_up = (torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(rows + 1)) * 6).to(dtype)
    out = moe_triton.clamped_swiglu(gate_up, ALPHA, LIMIT, round_steps=True)
    want = naive.clamped_swiglu(gate_up, ALPHA, LIMIT)
    assert out.dtype == dtype and out.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    else:  # each of five roundings may truncate: a few steps of the output's size at most
        torch.testing.assert_close(out.float(), want.float(), rtol=4 * 2**-7, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "top_k", "width"), [(1, 1, 8), (7, 3, 40), (5, 4, 1500)])
def test_triton_combine_matches_torch(tokens: int, top_k: int, width: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(tokens * top_k)
    rows = torch.randn(tokens * top_k, width, generator=gen).to(dtype)
    row_of_slot = torch.randperm(tokens * top_k, generator=gen)
    weights = torch.rand(tokens, top_k, generator=gen)
    out = moe_triton.combine(rows, row_of_slot, weights, dtype)
    ref = (rows.double()[row_of_slot].view(tokens, top_k, width) * weights.double()[..., None]).sum(1)
    assert out.dtype == dtype and relative_error(out, ref) < (FP32_TOL if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "top_k", "hidden", "inter"),
                         [(1, 4, 40, 24), (2, 3, 1100, 530), (1, 1, 16, 8)])
def test_triton_decode_experts_match_the_reference(tokens: int, top_k: int, hidden: int, inter: int,
                                                   dtype: torch.dtype) -> None:
    """The decode path (two weight-streaming launches, no sort or grouped GEMM) against the float64
    loop of the contract, and against the grouped path's own arithmetic on the CPU; widths that
    are not multiples of its tiles (masked tails), a repeated expert, top-k 1..4."""
    case = random_case(tokens, hidden, inter, 12, dtype, "cpu", seed=hidden + top_k)
    weights, ids = reference_route(case.router_logits, case.correction_bias, top_k)
    weights = weights.float()
    if tokens == 2:
        ids[1, 0] = ids[0, 0]  # two slots on one expert
    out = moe_triton.decode_experts(case.x, case.gate_up, case.down, ids, weights, ALPHA, LIMIT)
    ref = reference_experts(case.x, case.gate_up, case.down, ids, weights)
    assert out.dtype == dtype and out.shape == case.x.shape
    assert relative_error(out, ref) < (FP32_TOL if dtype == torch.float32 else 2e-2)
    grouped_out = grouped.experts(case.x, case.gate_up, case.down, ids, weights, ALPHA, LIMIT)
    assert relative_error(out, grouped_out) < (FP32_TOL if dtype == torch.float32 else 2e-2)


def test_get_moe_ops_picks_grouped_on_cuda_and_the_spec_elsewhere() -> None:
    from msaserve.kernels.moe import get_moe_ops

    assert get_moe_ops("cuda").experts is grouped.experts and get_moe_ops("cuda").route is grouped.route
    assert get_moe_ops("cpu").experts is naive.experts and get_moe_ops("cpu").name == "naive"
    assert get_moe_ops("cpu", "grouped").name == "grouped"
    with pytest.raises(ValueError, match="'loop' is not one of naive, grouped"):
        get_moe_ops("cpu", "loop")
