"""The per-layer elementwise ops of `layer_ops/naive.py` as one Triton kernel each.

Why: at decode batch sizes a layer's GEMMs read weights for a few rows, and the unfused
PyTorch steps around them (the RMSNorm's five ops, rotary's five per tensor, the cache writes'
index arithmetic and scatters) launched about forty small kernels per layer. Each kernel here
reads its input once and rounds where the PyTorch steps round, so results match them bit for
bit up to the order of the RMSNorm's sum.
"""

import torch
import triton
import triton.language as tl

from msaserve.kernels.layer_ops.naive import check_rotary_dim
from msaserve.kernels.triton_common import check, check_last_contiguous, pow2

# ---------------------------------------------------------------- jit kernels


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, stride_x, stride_r, stride_o, stride_s, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    """One row: s = x + residual (rounded to x's dtype), out = weight · (s / rms(s) rounded)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * stride_s + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, axis=0) / n_cols + eps)
    normed = (x32 * rstd).to(x.dtype).to(tl.float32)
    weight = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_write_kernel(
    x_ptr, cos_ptr, sin_ptr, slot_ptr, cache_a_ptr, cache_b_ptr,
    stride_xt, stride_xh, stride_ct, stride_st,
    stride_ap, stride_at, stride_ah, stride_bp, stride_bt, stride_bh,
    num_heads, page_size,
    D: tl.constexpr, R: tl.constexpr, HB: tl.constexpr, ROTATE: tl.constexpr, NUM_CACHES: tl.constexpr,
):
    """HB heads of one token: rotate the first R of D dims in place (HF rotate_half over those R; the
    rest pass through), then store into up to two caches."""
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HB + tl.arange(0, HB)
    offs_d = tl.arange(0, D)
    ok = (heads < num_heads)[:, None]
    ptrs = x_ptr + t * stride_xt + heads[:, None] * stride_xh + offs_d[None, :]
    x = tl.load(ptrs, mask=ok, other=0.0)  # [HB, D]
    if ROTATE:
        half: tl.constexpr = R // 2
        rotated = offs_d < R
        partner_d = tl.where(rotated, (offs_d + half) % R, offs_d)
        partner = tl.load(x_ptr + t * stride_xt + heads[:, None] * stride_xh + partner_d[None, :],
                          mask=ok, other=0.0).to(tl.float32)
        partner = tl.where(offs_d[None, :] < half, -partner, partner)  # rotate_half(x[..., :R])
        cos = tl.load(cos_ptr + t * stride_ct + offs_d, mask=rotated, other=1.0).to(tl.float32)
        sin = tl.load(sin_ptr + t * stride_st + offs_d, mask=rotated, other=0.0).to(tl.float32)
        # Products of two values of the activation dtype are exact in fp32; round each as
        # PyTorch does (x·cos, rotate_half(x)·sin, their sum).
        a = (x.to(tl.float32) * cos[None, :]).to(x.dtype).to(tl.float32)
        b = (partner * sin[None, :]).to(x.dtype).to(tl.float32)
        x = tl.where(rotated[None, :], (a + b).to(x.dtype), x)
        tl.store(ptrs, x, mask=ok)
    if NUM_CACHES > 0:
        slot = tl.load(slot_ptr + t)
        page, offset = slot // page_size, slot % page_size
        tl.store(cache_a_ptr + page * stride_ap + offset * stride_at + heads[:, None] * stride_ah
                 + offs_d[None, :], x.to(cache_a_ptr.dtype.element_ty), mask=ok)
        if NUM_CACHES > 1:
            tl.store(cache_b_ptr + page * stride_bp + offset * stride_bt + heads[:, None] * stride_bh
                     + offs_d[None, :], x.to(cache_b_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _offset_rms_norm_kernel(x_ptr, weight_ptr, out_ptr, n_rows, n_cols, eps, ROWS: tl.constexpr,
                            BLOCK: tl.constexpr):
    """ROWS contiguous rows: x · rsqrt(mean(x²) + eps) · (1 + weight), all in fp32, rounded once."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    offs = rows[:, None] * n_cols + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    w = tl.load(weight_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    out = (x * inv[:, None]) * (1.0 + w[None, :])
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, stride_g, stride_o, n_cols, BLOCK: tl.constexpr):
    """BLOCK columns of one row: silu(gate) rounded, times up, rounded."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(gate_up_ptr + row * stride_g + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_g + n_cols + cols, mask=mask, other=0.0)
    g32 = gate.to(tl.float32)
    silu = (g32 / (1.0 + tl.exp(-g32))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (silu * up.to(tl.float32)).to(gate.dtype), mask=mask)


# ---------------------------------------------------------------- public functions


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, H] → (RMSNorm(x + residual) · weight, x + residual); residual None → x."""
    check(x.dim() == 2 and weight.shape == (x.shape[1],),
          f"add_rms_norm takes x [T, H] and weight [H], got {tuple(x.shape)} and {tuple(weight.shape)}")
    check_last_contiguous(x=x)
    rows, cols = x.shape
    out = torch.empty((rows, cols), device=x.device, dtype=torch.result_type(weight, x))
    summed = x
    if residual is not None:
        check(residual.shape == x.shape and residual.dtype == x.dtype,
              f"residual has shape {tuple(residual.shape)} {residual.dtype}, "
              f"expected {tuple(x.shape)} {x.dtype}")
        check_last_contiguous(residual=residual)
        summed = torch.empty_like(x)
    if rows == 0:
        return out, summed
    block = pow2(cols)
    _add_rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out, summed,
        x.stride(0), (residual if residual is not None else x).stride(0), out.stride(0), summed.stride(0),
        cols, eps, HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 512)),
    )
    return out, summed


def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`naive.offset_rms_norm` (MiniMax-M3's RMSNorm over the last dim) as one launch: x of any
    shape, contiguous; several rows per program when rows are short (M3's per-head q/k norms)."""
    cols = x.shape[-1]
    check(weight.shape == (cols,),
          f"weight has shape {tuple(weight.shape)}, expected [{cols}] (x's last dim)")
    check(x.is_contiguous(), f"offset_rms_norm takes a contiguous x, got strides {x.stride()}")
    out = torch.empty_like(x)
    rows = x.numel() // max(cols, 1)
    if rows == 0:
        return out
    block = pow2(cols)
    per_program = max(1, min(16, 4096 // block))
    _offset_rms_norm_kernel[(triton.cdiv(rows, per_program),)](
        x, weight, out, rows, cols, float(eps), ROWS=per_program, BLOCK=block,
        num_warps=min(16, max(1, block * per_program // 1024)),
    )
    return out


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
    Only the first R = rotary_dim dims are rotated (None: all D), as in the spec."""
    tokens, num_heads, dim = heads.shape
    rotated_dim = check_rotary_dim(dim, cos.shape[-1], rotary_dim) if rotate else dim
    check(dim == pow2(dim), f"rotary_and_write needs a power-of-two head dim, got {dim}")
    check(len(caches) <= 2, f"rotary_and_write writes at most two caches, got {len(caches)}")
    check_last_contiguous(heads=heads, cos=cos, sin=sin)
    for cache in caches:
        check(cache.shape[2:] == (num_heads, dim) and cache.stride(-1) == 1,
              f"cache has shape {tuple(cache.shape)}, expected [num_pages, P, {num_heads}, {dim}]")
    if caches:
        check(slot_mapping is not None and slot_mapping.shape == (tokens,),
              f"slot_mapping must be [{tokens}] when caches are written")
    if tokens == 0:
        return heads
    a = caches[0] if caches else heads.unsqueeze(0)
    b = caches[1] if len(caches) > 1 else a
    slots = slot_mapping if slot_mapping is not None else heads
    heads_per_program = min(pow2(num_heads), max(1, 2048 // dim))
    _rotary_write_kernel[(tokens, triton.cdiv(num_heads, heads_per_program))](
        heads, cos, sin, slots, a, b,
        heads.stride(0), heads.stride(1), cos.stride(0), sin.stride(0),
        a.stride(0), a.stride(1), a.stride(2), b.stride(0), b.stride(1), b.stride(2),
        num_heads, a.shape[1],
        D=dim, R=rotated_dim, HB=heads_per_program, ROTATE=rotate, NUM_CACHES=len(caches), num_warps=4,
    )
    return heads


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate first) → silu(gate) · up [T, I]."""
    check(gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0,
          f"silu_mul takes gate_up [T, 2I], got {tuple(gate_up.shape)}")
    check_last_contiguous(gate_up=gate_up)
    rows, cols = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, cols), device=gate_up.device, dtype=gate_up.dtype)
    if rows == 0:
        return out
    block = min(1024, pow2(cols))
    _silu_mul_kernel[(rows, triton.cdiv(cols, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), cols, BLOCK=block, num_warps=4,
    )
    return out
