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

from msaserve.kernels.layer_ops.naive import M3HeadLayout, check_rotary_dim
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
def _offset_rms_norm_kernel(x_ptr, res_ptr, weight_ptr, out_ptr, sum_ptr, n_rows, n_cols, eps,
                            ROWS: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """ROWS contiguous rows: x · rsqrt(mean(x²) + eps) · (1 + weight), all in fp32, rounded once;
    with a residual, x + residual first (rounded to x's dtype, as PyTorch's add, and stored)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    offs = rows[:, None] * n_cols + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(res_ptr + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + offs, x, mask=mask)
    x = x.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    w = tl.load(weight_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    out = (x * inv[:, None]) * (1.0 + w[None, :])
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _round_as(v, dtype):
    """v (fp32) → fp32 holding v rounded to `dtype` (nearest, ties to even), what a cast to dtype and
    back gives. For bf16 in integer arithmetic, which no compiler can fold or round another way and
    the interpreter runs exactly (its casts truncate): compiled for the H200 with casts, 11 % of q's
    values were one step off the spec's, which rounds each product (the cause there is not known)."""
    if dtype == tl.bfloat16:
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # keep the top 16 bits, rounded
        return bits.to(tl.float32, bitcast=True)
    else:
        return v.to(dtype).to(tl.float32)


@triton.jit
def _m3_head_values(src_ptr, heads, ok, w_ptr, cos_ptr, sin_ptr, eps,
                    D: tl.constexpr, R: tl.constexpr, NORM: tl.constexpr, ROTATE: tl.constexpr):
    """Heads [HB, D] of one token's projection row at src_ptr, as fp32 holding values of the row's
    dtype: RMS-normed with (1 + weight) in fp32 and rounded (NORM), then the first R dims rotated
    (ROTATE), each product and the sum rounded as PyTorch's bf16 steps are (`_round_as`). The
    rotation's partner values are loaded and normed again rather than permuted in registers: the
    same arithmetic on the same inputs, so the same bits."""
    offs_d = tl.arange(0, D)
    x = tl.load(src_ptr + heads[:, None] * D + offs_d[None, :], mask=ok, other=0.0)
    dtype = x.dtype
    if NORM:
        x32 = x.to(tl.float32)
        inv = tl.math.rsqrt(tl.sum(x32 * x32, axis=1) / D + eps)
        w = tl.load(w_ptr + offs_d).to(tl.float32)
        x = _round_as((x32 * inv[:, None]) * (1.0 + w[None, :]), dtype)
    else:
        x = x.to(tl.float32)
    if ROTATE:
        half: tl.constexpr = R // 2
        rotated = offs_d < R
        partner_d = tl.where(rotated, (offs_d + half) % R, offs_d)
        partner = tl.load(src_ptr + heads[:, None] * D + partner_d[None, :], mask=ok, other=0.0)
        if NORM:
            w_partner = tl.load(w_ptr + partner_d).to(tl.float32)
            partner = _round_as((partner.to(tl.float32) * inv[:, None]) * (1.0 + w_partner[None, :]), dtype)
        else:
            partner = partner.to(tl.float32)
        partner = tl.where(offs_d[None, :] < half, -partner, partner)  # rotate_half(x[..., :R])
        cos = tl.load(cos_ptr + offs_d, mask=rotated, other=1.0).to(tl.float32)
        sin = tl.load(sin_ptr + offs_d, mask=rotated, other=0.0).to(tl.float32)
        a = _round_as(x * cos[None, :], dtype)
        b = _round_as(partner * sin[None, :], dtype)
        x = tl.where(rotated[None, :], _round_as(a + b, dtype), x)
    return x


@triton.jit
def _m3_store_heads(dst_ptr, stride_head, heads, ok, x, D: tl.constexpr):
    offs_d = tl.arange(0, D)
    ptrs = dst_ptr + heads[:, None] * stride_head + offs_d[None, :]
    tl.store(ptrs, x.to(dst_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _m3_heads(src_ptr, dst_ptr, stride_dst, dst2_ptr, stride_dst2, head0, num_heads, w_ptr, cos_ptr, sin_ptr,
              eps, HB: tl.constexpr, D: tl.constexpr, R: tl.constexpr, NORM: tl.constexpr,
              ROTATE: tl.constexpr, SECOND: tl.constexpr):
    """Heads head0 … head0 + HB − 1 (of num_heads) of one kind: values, stored at dst (and dst2)."""
    heads = head0 + tl.arange(0, HB)
    ok = (heads < num_heads)[:, None]
    x = _m3_head_values(src_ptr, heads, ok, w_ptr, cos_ptr, sin_ptr, eps, D, R, NORM, ROTATE)
    _m3_store_heads(dst_ptr, stride_dst, heads, ok, x, D)
    if SECOND:
        _m3_store_heads(dst2_ptr, stride_dst2, heads, ok, x, D)


@triton.jit
def _m3_attention_heads_kernel(
    proj_ptr, cos_ptr, sin_ptr, kv_slot_ptr, index_slot_ptr, q_ptr, index_q_ptr, index_k_ptr,
    k_cache_ptr, v_cache_ptr, index_cache_ptr, wq_ptr, wk_ptr, wiq_ptr, wik_ptr,
    stride_pt, stride_ct, stride_st, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
    stride_ip, stride_it, stride_ih, kv_page_size, index_page_size, eps,
    HQ: tl.constexpr, HKV: tl.constexpr, HI: tl.constexpr, HKI: tl.constexpr, D: tl.constexpr,
    DI: tl.constexpr, R: tl.constexpr, RI: tl.constexpr, HBQ: tl.constexpr, HBK: tl.constexpr,
    HBI: tl.constexpr, HBIK: tl.constexpr, WRITE_INDEX: tl.constexpr,
):
    """One token, one block of heads of one kind (axis 1: q blocks, k, v, index q, index k). The
    branches only call `_m3_heads`: a runtime branch may not leave values of different shapes."""
    t = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    nb_q: tl.constexpr = (HQ + HBQ - 1) // HBQ
    nb_k: tl.constexpr = (HKV + HBK - 1) // HBK
    nb_i: tl.constexpr = (HI + HBI - 1) // HBI
    row = proj_ptr + t * stride_pt
    cos = cos_ptr + t * stride_ct
    sin = sin_ptr + t * stride_st
    if block < nb_q:
        _m3_heads(row, q_ptr + t * (HQ * D), D, q_ptr, D, block * HBQ, HQ, wq_ptr, cos, sin, eps,
                  HBQ, D, R, True, True, False)
    elif block < nb_q + 2 * nb_k:  # k (normed, rotated) or v (as projected), into their caches
        slot = tl.load(kv_slot_ptr + t)
        page = slot // kv_page_size
        offset = slot % kv_page_size
        if block < nb_q + nb_k:
            _m3_heads(row + HQ * D, k_cache_ptr + page * stride_kp + offset * stride_kt, stride_kh, q_ptr, D,
                      (block - nb_q) * HBK, HKV, wk_ptr, cos, sin, eps, HBK, D, R, True, True, False)
        else:
            _m3_heads(row + (HQ + HKV) * D, v_cache_ptr + page * stride_vp + offset * stride_vt, stride_vh,
                      q_ptr, D, (block - nb_q - nb_k) * HBK, HKV, wk_ptr, cos, sin, eps, HBK, D, R,
                      False, False, False)
    elif block < nb_q + 2 * nb_k + nb_i:
        _m3_heads(row + (HQ + 2 * HKV) * D, index_q_ptr + t * (HI * DI), DI, q_ptr, DI,
                  (block - nb_q - 2 * nb_k) * HBI, HI, wiq_ptr, cos, sin, eps, HBI, DI, RI, True, True, False)
    else:  # index k: returned, and written to the index cache unless the caller quantizes it
        dst2 = index_cache_ptr
        if WRITE_INDEX:
            slot = tl.load(index_slot_ptr + t)
            page = slot // index_page_size
            dst2 = index_cache_ptr + page * stride_ip + (slot % index_page_size) * stride_it
        _m3_heads(row + (HQ + 2 * HKV) * D + HI * DI, index_k_ptr + t * (HKI * DI), DI, dst2, stride_ih,
                  (block - nb_q - 2 * nb_k - nb_i) * HBIK, HKI, wik_ptr, cos, sin, eps, HBIK, DI, RI,
                  True, True, WRITE_INDEX)


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
    return add_offset_rms_norm(x, None, weight, eps)[0]


def add_offset_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`naive.add_offset_rms_norm` as one launch: x (and residual, same shape and dtype) contiguous,
    any shape → (the norm over the last dim of x + residual, x + residual); residual None → x."""
    cols = x.shape[-1]
    check(weight.shape == (cols,),
          f"weight has shape {tuple(weight.shape)}, expected [{cols}] (x's last dim)")
    check(x.is_contiguous(), f"offset_rms_norm takes a contiguous x, got strides {x.stride()}")
    if residual is not None:
        check(residual.shape == x.shape and residual.dtype == x.dtype and residual.is_contiguous(),
              f"residual has shape {tuple(residual.shape)} {residual.dtype}, expected a contiguous "
              f"{tuple(x.shape)} {x.dtype}")
    out = torch.empty_like(x)
    summed = x if residual is None else torch.empty_like(x)
    rows = x.numel() // max(cols, 1)
    if rows == 0:
        return out, summed
    block = pow2(cols)
    per_program = max(1, min(16, 4096 // block))
    _offset_rms_norm_kernel[(triton.cdiv(rows, per_program),)](
        x, residual if residual is not None else x, weight, out, summed, rows, cols, float(eps),
        ROWS=per_program, BLOCK=block, HAS_RESIDUAL=residual is not None,
        num_warps=min(16, max(1, block * per_program // 1024)),
    )
    return out, summed


def _heads_per_program(heads: int, dim: int) -> int:
    """About 2048 elements per program (16 per thread at 4 warps)."""
    return min(pow2(heads), max(1, 2048 // dim))


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
    """`naive.m3_attention_heads` as one launch per layer (it replaces two GEMM-side norms, four
    rotaries of about five launches each and three scatter writes). Head dims must be powers of two;
    the caches take the projection's dtype (no conversion on the way in)."""
    tokens = projected.shape[0]
    d, di = layout.head_dim, layout.index_dim
    indexed = layout.index_heads > 0
    check(projected.dim() == 2 and projected.shape[1] == sum(layout.widths) and projected.stride(1) == 1,
          f"projected has shape {tuple(projected.shape)}, expected [T, {sum(layout.widths)}] with a "
          f"contiguous last dim")
    check(d == pow2(d) and (not indexed or di == pow2(di)),
          f"m3_attention_heads needs power-of-two head dims, got {d} and {di}")
    rotated = check_rotary_dim(d, cos.shape[-1], cos.shape[-1])
    check_last_contiguous(cos=cos, sin=sin)
    for name, cache, heads, dim in (("k_cache", k_cache, layout.num_kv_heads, d),
                                    ("v_cache", v_cache, layout.num_kv_heads, d),
                                    ("index_cache", index_cache, layout.index_key_heads, di)):
        if cache is not None:
            fits = cache.shape[2:] == (heads, dim) and cache.stride(-1) == 1
            check(fits and cache.dtype == projected.dtype,
                  f"{name} has shape {tuple(cache.shape)} {cache.dtype}, expected [pages, P, {heads}, {dim}] "
                  f"{projected.dtype}")
    q = projected.new_empty((tokens, layout.num_heads, d))
    index_q = projected.new_empty((tokens, layout.index_heads, di)) if indexed else None
    index_k = projected.new_empty((tokens, layout.index_key_heads, di)) if indexed else None
    if tokens == 0:
        return q, index_q, index_k
    write_index = indexed and index_cache is not None
    idx_cache = index_cache if write_index else k_cache
    hbq, hbk = _heads_per_program(layout.num_heads, d), _heads_per_program(layout.num_kv_heads, d)
    hbi = _heads_per_program(layout.index_heads, di) if indexed else 1
    hbik = _heads_per_program(layout.index_key_heads, di) if indexed else 1
    blocks = triton.cdiv(layout.num_heads, hbq) + 2 * triton.cdiv(layout.num_kv_heads, hbk)
    if indexed:
        blocks += triton.cdiv(layout.index_heads, hbi) + triton.cdiv(layout.index_key_heads, hbik)
    weights = tuple(norm_weights) + (norm_weights[0],) * (4 - len(norm_weights))
    _m3_attention_heads_kernel[(tokens, blocks)](
        projected, cos, sin, kv_slots, index_slots if write_index else kv_slots, q,
        index_q if indexed else q, index_k if indexed else q, k_cache, v_cache, idx_cache, *weights,
        projected.stride(0), cos.stride(0), sin.stride(0), *k_cache.stride()[:3], *v_cache.stride()[:3],
        *idx_cache.stride()[:3], k_cache.shape[1], idx_cache.shape[1], float(eps),
        HQ=layout.num_heads, HKV=layout.num_kv_heads, HI=layout.index_heads, HKI=layout.index_key_heads,
        D=d, DI=di if indexed else d, R=rotated, RI=min(rotated, di) if indexed else rotated,
        HBQ=hbq, HBK=hbk, HBI=hbi, HBIK=hbik, WRITE_INDEX=write_index, num_warps=4,
    )
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
