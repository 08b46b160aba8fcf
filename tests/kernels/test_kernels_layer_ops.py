"""The fused layer ops (`kernels/layer_ops/triton.py`) against their PyTorch spec under
TRITON_INTERPRET=1 at small shapes; tests/gpu runs the same checks compiled."""


import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu tests the compiled kernels", allow_module_level=True)

from test_kernels_layer_ops_cases import (
    check_add_rms_norm,
    check_rotary_and_write,
    check_silu_mul,
    interpreted_triton_ops,
)

TRITON = interpreted_triton_ops()


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
    with pytest.raises(ValueError, match="gate_up"):
        TRITON.silu_mul(torch.randn(2, 7))
