"""The non-attention pieces of a decoder layer: RMSNorm and the SwiGLU MLP."""

import torch
import torch.nn.functional as F
from torch import nn

from msaserve.kernels.layer_ops import LayerOps
from msaserve.kernels.layer_ops import naive as naive_layer_ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """norm(x) by the PyTorch spec (`layer_ops/naive.py`): fp32, cast back before the weight."""
        return naive_layer_ops.add_rms_norm(x, None, self.weight, self.eps)[0]

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, ops: LayerOps
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) in one op; residual None → (norm(x), x)."""
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up_weight: torch.Tensor | None = None
        """[2I, H]: gate's and up's weights in one tensor once `fuse_projections` ran."""

    def fuse_projections(self) -> None:
        """One GEMM for gate and up: their weights move into one tensor (views keep the names)."""
        self.gate_up_weight = fuse_linear_weights(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor, ops: LayerOps | None = None) -> torch.Tensor:
        if self.gate_up_weight is not None and ops is not None:
            return self.down_proj(ops.silu_mul(F.linear(x, self.gate_up_weight)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def fuse_linear_weights(*linears: nn.Linear) -> torch.Tensor:
    """Concatenate the weights of bias-free `linears` ([out_i, in] each) into one [Σ out_i, in]
    tensor and make each linear's weight a view of its rows, so checkpoints still load and save
    by the old names and no weight is held twice. → the fused weight."""
    for linear in linears:
        if linear.bias is not None:
            raise ValueError("fuse_linear_weights takes bias-free linears only")
    fused = torch.cat([linear.weight.detach() for linear in linears], dim=0)
    start = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight = nn.Parameter(fused[start:start + rows], requires_grad=False)
        start += rows
    return fused
