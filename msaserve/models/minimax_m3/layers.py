"""MiniMax-M3's non-attention pieces: its RMSNorm (scaled by 1 + weight), the dense clamped-SwiGLU
MLP and the mixture of experts (sigmoid router with a correction bias, one shared expert).

Parameter names are transformers' (`gate_up_proj` fused gate-then-up, `experts.gate_up_proj`
[E, 2I, H], `experts.down_proj` [E, H, I]), so its checkpoints load by name.
"""

import functools

import torch
import torch.nn.functional as F
from torch import nn

from msaserve.kernels.layer_ops.naive import add_offset_rms_norm, offset_rms_norm
from msaserve.kernels.moe import MoeOps, get_moe_ops
from msaserve.kernels.moe import naive as moe
from msaserve.models.minimax_m3.config import M3Config


def m3_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' MiniMaxM3VLRMSNorm: normalise in fp32, multiply by (1 + weight) in fp32, then
    cast to x's dtype (a zero weight is the identity scale). The spec is
    `layer_ops.naive.offset_rms_norm`; on CUDA one fused launch (`layer_ops.triton`) instead of
    PyTorch's eight (about 25 norms per decode step of m3-mini)."""
    if x.is_cuda and x.is_contiguous() and x.numel():
        from msaserve.kernels.layer_ops import triton as layer_triton

        return layer_triton.offset_rms_norm(x, weight, eps)
    return offset_rms_norm(x, weight, eps)


def m3_add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(m3_rms_norm(x + residual), x + residual), the sum rounded as PyTorch's add; residual None →
    (m3_rms_norm(x), x). On CUDA one launch for the add and the norm (`layer_ops.triton`)."""
    same = residual is None or (residual.is_contiguous() and residual.dtype == x.dtype
                                and residual.shape == x.shape)
    if x.is_cuda and x.is_contiguous() and x.numel() and same:
        from msaserve.kernels.layer_ops import triton as layer_triton

        return layer_triton.add_offset_rms_norm(x, residual, weight, eps)
    return add_offset_rms_norm(x, residual, weight, eps)


class M3RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return m3_rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) in one op; residual None → (norm(x), x)."""
        return m3_add_rms_norm(x, residual, self.weight, self.eps)


def m3_clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """`moe.naive.clamped_swiglu` (the spec: seven PyTorch ops, each rounding to the input dtype);
    on CUDA one launch that rounds after the same steps."""
    if gate_up.is_cuda and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
        from msaserve.kernels.moe import triton as moe_triton

        return moe_triton.clamped_swiglu(gate_up, alpha, limit, round_steps=True)
    return moe.clamped_swiglu(gate_up, alpha, limit)


class M3DenseMLP(nn.Module):
    """down(clamped_swiglu(gate_up(x))): the dense layers' MLP and the MoE's shared expert."""

    def __init__(self, hidden_size: int, intermediate_size: int, alpha: float, limit: float) -> None:
        super().__init__()
        self.alpha, self.limit = alpha, limit
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(m3_clamped_swiglu(self.gate_up_proj(x), self.alpha, self.limit))


@functools.cache
def _moe_ops(device_type: str) -> MoeOps:
    """The MoE ops for the device: the grouped path on CUDA (no loop over experts, no host sync,
    capturable in CUDA graphs), the reference elsewhere (`kernels/moe`)."""
    return get_moe_ops(device_type)


class M3Router(nn.Module):
    def __init__(self, config: M3Config) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(config.num_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] → (weights [T, k] fp32, ids [T, k] int64)."""
        logits = F.linear(x.to(self.weight.dtype), self.weight)
        return _moe_ops(x.device.type).route(logits, self.e_score_correction_bias, self.top_k)


class M3Experts(nn.Module):
    def __init__(self, config: M3Config) -> None:
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.intermediate_size
        self.alpha, self.limit = config.swiglu_alpha, config.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        ops = _moe_ops(x.device.type)
        return ops.experts(x, self.gate_up_proj, self.down_proj, ids, weights, self.alpha, self.limit)


class M3SparseMoE(nn.Module):
    """routed_scaling_factor · Σ_k w_k · expert_k(x) + shared_expert(x)."""

    def __init__(self, config: M3Config) -> None:
        super().__init__()
        self.routed_scaling_factor = config.routed_scaling_factor
        self.gate = M3Router(config)
        self.experts = M3Experts(config)
        self.shared_experts = M3DenseMLP(
            config.hidden_size, config.shared_intermediate_size, config.swiglu_alpha, config.swiglu_limit
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared_experts(x)
        weights, ids = self.gate(x)
        return self.experts(x, ids, weights) * self.routed_scaling_factor + shared


def make_mlp(config: M3Config, layer: int) -> nn.Module:
    if config.mlp_layer_types[layer] == "sparse":
        return M3SparseMoE(config)
    return M3DenseMLP(
        config.hidden_size, config.dense_intermediate_size, config.swiglu_alpha, config.swiglu_limit
    )
