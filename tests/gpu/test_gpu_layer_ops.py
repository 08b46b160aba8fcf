"""The compiled fused layer ops against their PyTorch spec at the m3-proxy sizes (hidden 6144,
64 + 4 + 4 heads of 128, MLP 8192), bf16, and a whole model forward with them against PyTorch's."""

import copy
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))

from reference_decode import SequenceState, step_metadata
from test_kernels_layer_ops_cases import (
    check_add_offset_rms_norm,
    check_add_rms_norm,
    check_m3_attention_heads,
    check_rotary_and_write,
    check_silu_mul,
)

from msaserve.kernels.layer_ops import get_layer_ops
from msaserve.kernels.layer_ops import triton as layer_triton
from msaserve.kernels.layer_ops.naive import M3HeadLayout
from msaserve.models.loader import load_model

TRITON, NAIVE = get_layer_ops("cuda"), get_layer_ops("cpu")  # the spec runs on any device
BF16 = torch.bfloat16


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("rows", [1, 8, 1000])
def test_add_rms_norm(rows: int, residual: bool) -> None:
    check_add_rms_norm(TRITON, rows, 6144, BF16, "cuda", residual, seed=rows)


@pytest.mark.parametrize(("heads", "rotate", "num_caches"), [(64, True, 0), (4, True, 2), (4, False, 1),
                                                             (1, True, 1)])
@pytest.mark.parametrize("tokens", [8, 999])
def test_rotary_and_write(tokens: int, heads: int, rotate: bool, num_caches: int) -> None:
    check_rotary_and_write(TRITON, tokens, heads, 128, rotate, num_caches, BF16, "cuda", seed=heads)


@pytest.mark.parametrize(("heads", "num_caches"), [(64, 0), (4, 2), (1, 1)])
@pytest.mark.parametrize("tokens", [8, 999])
def test_partial_rotary_and_write(tokens: int, heads: int, num_caches: int) -> None:
    """MiniMax-M3's partial rotary: 64 of 128 dims rotate (query, key and index heads), the rest pass."""
    check_rotary_and_write(TRITON, tokens, heads, 128, True, num_caches, BF16, "cuda", seed=heads + 1,
                           rotary_dim=64)


@pytest.mark.parametrize("rows", [8, 1000])
def test_silu_mul(rows: int) -> None:
    check_silu_mul(TRITON, rows, 8192, BF16, "cuda")


@pytest.mark.parametrize(("backend", "min_cosine"), [("dense", 0.9995), ("msa", 0.99)])
@torch.inference_mode()
def test_model_forward_with_fused_ops_matches_pytorch_ops(backend: str, min_cosine: float) -> None:
    """m3-proxy (2 layers), 3000 prompt tokens in two chunks + 2 decode steps: the fused kernels
    and fused projections against the unfused model with the PyTorch ops. Dense attention has
    no selection, so only bf16 rounding separates the two; with MSA's random index weights many
    page scores are near ties, and rounding flips some selections (docs/design.md §2, property 4)."""
    model = load_model("m3-proxy", device="cuda", dtype=BF16, attention_backend=backend, progress=False,
                       num_layers=2).model
    fused = copy.deepcopy(model)
    fused.fuse_projections()
    ids = torch.randint(3, 30000, (3002,), generator=torch.Generator().manual_seed(0)).cuda()
    steps = ((0, 2000, False), (2000, 3000, False), (3000, 3001, True), (3001, 3002, True))
    outputs = []
    for net, layer_ops in ((model, NAIVE), (fused, TRITON)):
        state, hidden = SequenceState(net, 3100), []
        for start, end, decode in steps:
            meta = step_metadata(start, end - start, state.max_pages, net.config.page_size, decode, "cuda")
            hidden.append(net(ids[start:end], meta, state.caches, layer_ops=layer_ops))
        outputs.append(hidden + [t for c in state.caches for t in (c.k_cache, c.v_cache, c.index_cache)])
    # bf16 through 2 layers, and cuBLAS may pick another kernel for a fused GEMM's shape: compare
    # directions, hidden states of each step and every cache.
    for i, (want, got) in enumerate(zip(*outputs, strict=True)):
        cosine = torch.nn.functional.cosine_similarity(got.float().flatten(), want.float().flatten(), dim=0)
        assert cosine > min_cosine, f"output {i}: cosine similarity {float(cosine):.6f}"


@pytest.mark.parametrize("shape", [(1, 6144), (1, 64, 128), (1, 4, 128), (300, 6144)])
def test_offset_rms_norm_compiled_matches_m3s_spec(shape: tuple[int, ...]) -> None:
    """M3's RMSNorm fused (what `m3_rms_norm` runs on CUDA) against the PyTorch spec on the GPU: bf16
    outputs at most one step apart (fp32 sums in another order), and rarely."""
    from msaserve.kernels.layer_ops import naive as layer_naive
    from msaserve.kernels.layer_ops import triton as layer_triton
    from msaserve.models.minimax_m3.layers import m3_rms_norm

    gen = torch.Generator(device="cuda").manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=gen, device="cuda") * 3).to(torch.bfloat16)
    weight = (torch.randn(shape[-1], generator=gen, device="cuda") * 0.1).to(torch.bfloat16)
    out = layer_triton.offset_rms_norm(x, weight, 1e-6)
    want = layer_naive.offset_rms_norm(x, weight, 1e-6)
    assert torch.equal(m3_rms_norm(x, weight, 1e-6), out)
    step = (want.float().abs() * 2**-7).clamp_min(1e-30)
    assert ((out.float() - want.float()).abs() <= step).all()
    assert (out != want).float().mean() < 0.02


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("rows", [1, 300])
def test_add_offset_rms_norm_compiled(rows: int, residual: bool) -> None:
    """M3's residual add + RMSNorm in one launch at the model width: the sum exact, the norm a step
    at most from the spec's."""
    check_add_offset_rms_norm(layer_triton, rows, 6144, BF16, "cuda", residual, seed=rows)


@pytest.mark.parametrize("layout", [M3HeadLayout(64, 4, 128, 4, 1, 128), M3HeadLayout(64, 4, 128)])
@pytest.mark.parametrize("tokens", [1, 999])
def test_m3_attention_heads_compiled(tokens: int, layout: M3HeadLayout) -> None:
    """M3's attention input at the M3 shape (64 + 4 + 4 heads of 128, 4 index queries and one index
    key of 128, 64 dims rotated) in one launch against the spec's PyTorch steps."""
    check_m3_attention_heads(layer_triton, tokens, layout, BF16, "cuda", 64, seed=tokens)
