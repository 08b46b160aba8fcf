"""The per-layer elementwise ops of a decoder layer in PyTorch: the spec of `layer_ops/triton.py`.

These are the steps of HF Llama's layer written as functions: the residual add before each
RMSNorm, rotary embedding of the projected heads with the writes of K, V and index-K into the
paged caches, and SwiGLU's `silu(gate) * up`. Rounding follows HF: the residual add, the rotary
products and sum, and silu each round to the activation dtype.
"""

import torch
import torch.nn.functional as F

from msaserve.kernels.rotary import apply_rotary


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, H] → (RMSNorm(x + residual) · weight, x + residual); residual None → x."""
    summed = x if residual is None else x + residual
    x32 = summed.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(summed.dtype), summed


def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """MiniMax-M3's RMSNorm (transformers' MiniMaxM3VLRMSNorm) over the last dim: normalise in fp32,
    multiply by (1 + weight) in fp32, then cast to x's dtype (a zero weight is the identity scale)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * (1.0 + weight.float())).to(x.dtype)


def rotary_and_write(
    heads: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rotate: bool,
    slot_mapping: torch.Tensor | None = None,
    caches: tuple[torch.Tensor, ...] = (),
    rotary_dim: int | None = None,
) -> torch.Tensor:
    """heads [T, H, D] (rotated in place when `rotate`); cos, sin [T, 1, ≥ R]; each cache
    [num_pages, P, H, D] gets the (rotated) heads at slot_mapping [T] int64 → the heads.

    Partial rotary (MiniMax-M3): only the first R = rotary_dim dims of each head are rotated, with the
    first R entries of cos and sin, and dims R..D-1 pass through unchanged; None rotates all D.
    """
    if rotate:
        dim = check_rotary_dim(heads.shape[-1], cos.shape[-1], rotary_dim)
        part = heads[..., :dim]
        part.copy_(apply_rotary(part, cos[..., :dim], sin[..., :dim]))
    if caches:
        assert slot_mapping is not None, "caches are written at slot_mapping"
        page_size = caches[0].shape[1]
        pages, offsets = slot_mapping // page_size, slot_mapping % page_size
        for cache in caches:
            cache[pages, offsets] = heads.to(cache.dtype)
    return heads


def check_rotary_dim(head_dim: int, cos_dim: int, rotary_dim: int | None) -> int:
    """The rotated width R: rotary_dim, or the whole head when None; even, ≤ the head and ≤ cos's width."""
    dim = head_dim if rotary_dim is None else rotary_dim
    if dim <= 0 or dim % 2 or dim > head_dim or dim > cos_dim:
        raise ValueError(
            f"rotary_dim={rotary_dim} is invalid: allowed an even width 0 < rotary_dim ≤ head dim {head_dim} "
            f"and ≤ the cos/sin width {cos_dim}"
        )
    return dim


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate first) → silu(gate) · up [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
