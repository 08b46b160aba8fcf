"""The per-layer elementwise ops of a decoder layer in PyTorch: the spec of `layer_ops/triton.py`.

These are the steps of HF Llama's layer written as functions: the residual add before each
RMSNorm, rotary embedding of the projected heads with the writes of K, V and index-K into the
paged caches, and SwiGLU's `silu(gate) * up`. Rounding follows HF: the residual add, the rotary
products and sum, and silu each round to the activation dtype. MiniMax-M3's forms follow
transformers' MiniMaxM3VL modules: its RMSNorm (`offset_rms_norm`, also after a residual add) and
the attention input of a layer (`m3_attention_heads`: per-head norms, partial rotary, cache writes).
"""

from dataclasses import dataclass

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


def add_offset_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """M3's residual add and RMSNorm: x, residual [T, H] → (offset_rms_norm(x + residual), x + residual),
    the sum rounded to x's dtype as PyTorch's add does; residual None → (offset_rms_norm(x), x)."""
    summed = x if residual is None else x + residual
    return offset_rms_norm(summed, weight, eps), summed


@dataclass(frozen=True)
class M3HeadLayout:
    """How a row of M3's fused attention projection splits into heads: q [Hq, D], k [Hkv, D],
    v [Hkv, D], then (layers with an index branch) index q [Hi, DI] and index k [HkI, DI]."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    index_heads: int = 0
    """0: no index branch (a `full_attention` layer)."""
    index_key_heads: int = 0
    index_dim: int = 0

    @property
    def widths(self) -> tuple[int, ...]:
        """Columns of q, k, v, index q, index k (the last two 0 without an index branch)."""
        d, di = self.head_dim, self.index_dim
        return (self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d,
                self.index_heads * di, self.index_key_heads * di)


def m3_attention_heads(
    projected: torch.Tensor,
    layout: M3HeadLayout,
    norm_weights: tuple[torch.Tensor, ...],
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    index_slots: torch.Tensor | None = None,
    index_cache: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The attention input of an M3 layer from its fused projection (transformers' MiniMaxM3VL
    attention and indexer, in that order of rounding).

    projected [T, Σ layout.widths]; norm_weights: the q, k (and index q, index k) RMSNorm weights
    [D] / [DI]; cos, sin [T, 1, R] (R ≤ D: partial rotary, the index heads turn min(R, DI) dims).
    q and k are RMS-normed per head then rotated, and so are index q and index k; k and v go to
    k_cache, v_cache [pages, P, Hkv, D] at kv_slots [T], index k (if index_cache is given) to
    index_cache [pages, P, HkI, DI] at index_slots [T].
    → (q [T, Hq, D], index q [T, Hi, DI] or None, index k [T, HkI, DI] or None), new tensors."""
    tokens = projected.shape[0]
    counts = (layout.num_heads, layout.num_kv_heads, layout.num_kv_heads, layout.index_heads,
              layout.index_key_heads)
    dims = (layout.head_dim,) * 3 + (layout.index_dim,) * 2
    parts = projected.split(list(layout.widths), dim=-1)
    q, k, v, index_q, index_k = (part.reshape(tokens, n, d)
                                 for part, n, d in zip(parts, counts, dims, strict=True))
    rotated = cos.shape[-1]
    q = rotary_and_write(offset_rms_norm(q, norm_weights[0], eps), cos, sin, True, rotary_dim=rotated)
    k = rotary_and_write(offset_rms_norm(k, norm_weights[1], eps), cos, sin, True, kv_slots, (k_cache,),
                         rotary_dim=rotated)
    rotary_and_write(v, cos, sin, False, kv_slots, (v_cache,))
    if not layout.index_heads:
        return q, None, None
    index_rotated = min(rotated, layout.index_dim)
    index_q = rotary_and_write(offset_rms_norm(index_q, norm_weights[2], eps), cos, sin, True,
                               rotary_dim=index_rotated)
    caches = (index_cache,) if index_cache is not None else ()
    index_k = rotary_and_write(offset_rms_norm(index_k, norm_weights[3], eps), cos, sin, True,
                               index_slots if caches else None, caches, rotary_dim=index_rotated)
    return q, index_q, index_k


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
