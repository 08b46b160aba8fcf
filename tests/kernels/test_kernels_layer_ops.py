"""The fused layer ops (`kernels/layer_ops/triton.py`) against their PyTorch spec under
TRITON_INTERPRET=1 at small shapes; tests/gpu runs the same checks compiled."""


import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu tests the compiled kernels", allow_module_level=True)

from kernel_testing import import_interpreted
from test_kernels_layer_ops_cases import (
    check_add_offset_rms_norm,
    check_add_rms_norm,
    check_m3_attention_heads,
    check_rotary_and_write,
    check_silu_mul,
    interpreted_triton_ops,
)

from msaserve.kernels.layer_ops import get_layer_ops
from msaserve.kernels.layer_ops.naive import M3HeadLayout
from msaserve.kernels.rotary import rotary_cos_sin

TRITON = interpreted_triton_ops()
NAIVE = get_layer_ops("cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize(("rows", "cols"), [(5, 64), (3, 100)])
def test_add_rms_norm_matches_spec(rows: int, cols: int, residual: bool, dtype: torch.dtype) -> None:
    check_add_rms_norm(TRITON, rows, cols, dtype, "cpu", residual, seed=rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "rotate", "num_caches"),
                         [(4, True, 0), (3, True, 2), (2, False, 1), (1, True, 1)])
def test_rotary_and_write_matches_spec(heads: int, rotate: bool, num_caches: int, dtype: torch.dtype) -> None:
    check_rotary_and_write(TRITON, 7, heads, 16, rotate, num_caches, dtype, "cpu", seed=heads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "dim", "rotary_dim", "num_caches"),
                         [(4, 16, 8, 0), (3, 32, 16, 2), (1, 32, 8, 1), (2, 16, 16, 1), (2, 32, 6, 0)])
def test_partial_rotary_and_write_matches_spec(heads: int, dim: int, rotary_dim: int, num_caches: int,
                                               dtype: torch.dtype) -> None:
    """M3's partial rotary: the first rotary_dim dims rotate, the rest pass through (main and index heads)."""
    check_rotary_and_write(TRITON, 7, heads, dim, True, num_caches, dtype, "cpu", seed=dim + heads,
                           rotary_dim=rotary_dim)


def test_rotary_and_write_with_many_tokens() -> None:
    """999 tokens of 128 dims, seed 2: the H200 test's draw, where the helper once gave tokens 0 and 256
    one slot and the compiled kernel's write order decided the cache. The interpreter runs programs in
    order, so here only the helper's distinct-slots assertion tells; it failed on that draw."""
    check_rotary_and_write(TRITON, 999, 1, 128, True, 1, torch.float32, "cpu", seed=2, rotary_dim=64)


def test_partial_rotary_spec_matches_transformers_m3() -> None:
    """The spec against transformers' MiniMax-M3 `apply_rotary_pos_emb` (cos/sin rotary_dim wide)."""
    m3 = pytest.importorskip("transformers.models.minimax_m3_vl.modeling_minimax_m3_vl")
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 4, 32, generator=gen), torch.randn(5, 1, 32, generator=gen)
    cos, sin = rotary_cos_sin(torch.tensor([0, 3, 17, 400, 9000]), 16, 5e6, torch.float32)
    # transformers lays heads out [B, H, S, D] with cos, sin [B, S, R]
    want_q, want_k = m3.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             cos[None, :, 0], sin[None, :, 0])
    got_q = NAIVE.rotary_and_write(q.clone(), cos, sin, True, rotary_dim=16)
    got_k = NAIVE.rotary_and_write(k.clone(), cos, sin, True, rotary_dim=16)
    assert torch.equal(got_q, want_q[0].transpose(0, 1)) and torch.equal(got_k, want_k[0].transpose(0, 1))
    assert not torch.equal(got_q[..., :16], q[..., :16])  # and it did rotate


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "cols"), [(4, 96), (1, 1500)])
def test_silu_mul_matches_spec(rows: int, cols: int, dtype: torch.dtype) -> None:
    check_silu_mul(TRITON, rows, cols, dtype, "cpu")


def test_layer_ops_reject_bad_shapes() -> None:
    with pytest.raises(ValueError, match="weight"):
        TRITON.add_rms_norm(torch.randn(2, 8), None, torch.ones(9), 1e-5)
    with pytest.raises(ValueError, match="power-of-two head dim"):
        TRITON.rotary_and_write(torch.randn(2, 1, 12), torch.ones(2, 1, 12), torch.ones(2, 1, 12), True)
    with pytest.raises(ValueError, match="slot_mapping"):
        TRITON.rotary_and_write(torch.randn(2, 1, 8), torch.ones(2, 1, 8), torch.ones(2, 1, 8), True,
                                None, (torch.zeros(4, 8, 1, 8),))
    for ops in (TRITON, NAIVE):
        with pytest.raises(ValueError, match=r"rotary_dim=7 is invalid: allowed an even width"):
            ops.rotary_and_write(torch.randn(2, 1, 8), torch.ones(2, 1, 8), torch.ones(2, 1, 8), True,
                                 rotary_dim=7)
        with pytest.raises(ValueError, match=r"rotary_dim=8 is invalid.*≤ the cos/sin width 4"):
            ops.rotary_and_write(torch.randn(2, 1, 8), torch.ones(2, 1, 4), torch.ones(2, 1, 4), True,
                                 rotary_dim=8)
    with pytest.raises(ValueError, match="gate_up"):
        TRITON.silu_mul(torch.randn(2, 7))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 6144), (3, 64, 128), (2, 4, 128), (5, 1, 40)])
def test_offset_rms_norm_matches_m3s_spec(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """M3's RMSNorm (scale 1 + weight, all in fp32, rounded once) as one Triton launch, under the
    interpreter: a model width, per-head q/k norms (several rows per program), a tail width."""
    from msaserve.kernels.layer_ops import naive as layer_naive
    from msaserve.kernels.layer_ops import triton as layer_triton

    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=gen) * 3).to(dtype)
    weight = (torch.randn(shape[-1], generator=gen) * 0.1).to(dtype)
    out = layer_triton.offset_rms_norm(x, weight, 1e-6)
    want = layer_naive.offset_rms_norm(x, weight, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, rtol=2e-6, atol=2e-6)
    else:  # the interpreter truncates fp32 → bf16 where the GPU rounds to nearest: one step apart
        step = (want.float().abs() * 2**-7).clamp_min(1e-30)
        assert ((out.float() - want.float()).abs() <= step).all()
    with pytest.raises(ValueError, match=r"weight has shape \(3,\), expected \[" + str(shape[-1]) + r"\]"):
        layer_triton.offset_rms_norm(x, weight[:3], 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("shape", [(1, 6144), (5, 100), (3, 4, 32)])
def test_add_offset_rms_norm_matches_spec(shape: tuple[int, ...], residual: bool, dtype: torch.dtype) -> None:
    """M3's residual add + RMSNorm as one launch (the decoder layer's two per layer, and the last)."""
    (module,) = import_interpreted("msaserve.kernels.layer_ops.triton")
    rows, cols = (shape[0] * (shape[1] if len(shape) > 2 else 1)), shape[-1]
    check_add_offset_rms_norm(module, rows, cols, dtype, "cpu", residual, seed=rows + cols)


M3_LAYOUTS = [
    M3HeadLayout(4, 2, 32, 2, 1, 16),  # M3_MINI_SMALL's shape: index heads narrower than the main ones
    M3HeadLayout(5, 1, 16, 1, 1, 32),  # odd head counts; index heads wider
    M3HeadLayout(3, 3, 16),  # a full_attention layer: no index branch
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("layout", "rotary_dim"), [(M3_LAYOUTS[0], 16), (M3_LAYOUTS[1], 8),
                                                    (M3_LAYOUTS[1], 16), (M3_LAYOUTS[2], 16)])
@pytest.mark.parametrize("tokens", [1, 7])
def test_m3_attention_heads_matches_spec(tokens: int, layout: M3HeadLayout, rotary_dim: int,
                                         dtype: torch.dtype) -> None:
    """M3's attention input in one launch: q, k (and index q, index k) normed per head and partly
    rotated, K/V and index K written at their slots; rotary_dim 16 with index dim 16 turns the
    whole index head, and with index dim 32 half of it."""
    (module,) = import_interpreted("msaserve.kernels.layer_ops.triton")
    check_m3_attention_heads(module, tokens, layout, dtype, "cpu", rotary_dim, seed=tokens + rotary_dim)
