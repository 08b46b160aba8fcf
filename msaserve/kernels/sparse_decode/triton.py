"""Paged sparse decode attention (docs/design.md §2) in Triton.

(sequence, query, KV head) is flattened into the batch axis of a paged-attention kernel whose
page-table row is the selection; the group's G query heads share one tile (rows of the MMA), so
each selected page is read once per group. When the batch is small the K selected pages are split
across CTAs, each writing a partial (o, lse), merged by LSE afterwards.
"""

import math

import torch
import triton
import triton.language as tl

from msaserve.kernels.dense.gpu import dense_decode
from msaserve.kernels.triton_common import (
    INTERPRET,
    LseMerge,
    check,
    check_last_contiguous,
    check_shape,
    configs,
    lse_merge,
    num_sms,
    pow2,
)

_LOG2E = 1.4426950408889634

# ---------------------------------------------------------------- heuristics


def _num_splits(rows: int, top_k: int, device: torch.device) -> int:
    """Split the K pages so that about two waves of CTAs run; one split when the batch fills the GPU."""
    want = triton.cdiv(2 * num_sms(device), rows)
    return max(1, min(want, top_k))


# ---------------------------------------------------------------- autotune keyed on shapes

_CONFIGS = configs([{}], [(4, 2), (8, 2)])


# ---------------------------------------------------------------- jit kernel


@triton.autotune(configs=_CONFIGS, key=["P", "D", "GP", "TOP_K", "DIRECT"])
@triton.jit
def _sparse_decode_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, seq_lens_ptr, sel_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    qk_scale, slots_per_split,
    stride_qb, stride_qq, stride_qh,
    stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
    stride_tb, stride_sb, stride_sq, stride_sh,
    stride_ob, stride_oq, stride_oh,
    NUM_Q: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, P: tl.constexpr, D: tl.constexpr,
    TOP_K: tl.constexpr, DIRECT: tl.constexpr, UPCAST: tl.constexpr,
):
    bq = tl.program_id(0)  # sequence · NUM_Q + query
    h = tl.program_id(1)
    split = tl.program_id(2)
    b = bq // NUM_Q
    q_i = bq % NUM_Q
    pos = tl.load(seq_lens_ptr + b) - NUM_Q + q_i
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, D)
    offs_p = tl.arange(0, P)
    mask_g = offs_g < G
    q = tl.load(q_ptr + b * stride_qb + q_i * stride_qq + (h * G + offs_g)[:, None] * stride_qh
                + offs_d[None, :], mask=mask_g[:, None], other=0.0)  # [GP, D]
    if UPCAST:
        q = q.to(tl.float32)
    m = tl.full([GP], float("-inf"), tl.float32)
    denom = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    first = split * slots_per_split
    for slot in range(first, tl.minimum(first + slots_per_split, TOP_K)):
        j = tl.load(sel_ptr + b * stride_sb + q_i * stride_sq + h * stride_sh + slot)
        if j >= 0:
            page = tl.load(tables_ptr + b * stride_tb + j).to(tl.int64)
            kv_off = offs_p[:, None] * stride_kt + offs_d[None, :]
            keys = tl.load(k_ptr + page * stride_kp + h * stride_kh + kv_off)  # [P, D]
            values = tl.load(v_ptr + page * stride_vp + h * stride_vh + offs_p[:, None] * stride_vt
                             + offs_d[None, :])
            logits = tl.dot(q, tl.trans(keys.to(q.dtype))) * qk_scale  # [GP, P], log2 units
            logits = tl.where((j * P + offs_p)[None, :] <= pos, logits, float("-inf"))
            m_new = tl.maximum(m, tl.max(logits, axis=1))
            alpha = tl.exp2(m - m_new)
            probs = tl.exp2(logits - m_new[:, None])
            denom = denom * alpha + tl.sum(probs, axis=1)
            acc = acc * alpha[:, None] + tl.dot(probs.to(q.dtype), values.to(q.dtype))
            m = m_new
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    if DIRECT:
        ptrs = out_ptr + b * stride_ob + q_i * stride_oq + (h * G + offs_g)[:, None] * stride_oh
        tl.store(ptrs + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=mask_g[:, None])
    else:
        row = (bq * tl.num_programs(1) + h) * tl.num_programs(2) + split
        tl.store(part_o_ptr + row * G * D + offs_g[:, None] * D + offs_d[None, :], out, mask=mask_g[:, None])
        tl.store(part_lse_ptr + row * G + offs_g, m + tl.log2(tl.where(denom > 0, denom, 1.0)), mask=mask_g)


# ---------------------------------------------------------------- launcher


def _launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    selected: torch.Tensor,
    scale: float,
    merge: LseMerge,
    num_splits: int | None,
) -> torch.Tensor:
    batch, num_q, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    top_k = selected.shape[-1]
    check(num_q_heads % num_kv_heads == 0, f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
    group = num_q_heads // num_kv_heads
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    check_shape("selected", selected, (batch, num_q, num_kv_heads, top_k))
    check_shape("seq_lens", seq_lens, (batch,))
    check(block_tables.dim() == 2 and block_tables.shape[0] == batch,
          f"block_tables has shape {tuple(block_tables.shape)}, expected [{batch}, max_pages]")
    check(page_size == pow2(page_size) and head_dim == pow2(head_dim),
          f"page size {page_size} and head dim {head_dim} must be powers of two")
    block_tables, seq_lens = block_tables.to(torch.int32).contiguous(), seq_lens.to(torch.int32)
    selected = selected.to(torch.int32)
    check_last_contiguous(q=q, k_cache=k_cache, v_cache=v_cache, selected=selected)
    out = torch.empty_like(q)
    rows = batch * num_q * num_kv_heads
    check(num_splits is None or num_splits >= 1,
          f"num_splits is {num_splits}; allowed None or an integer ≥ 1")
    splits = min(num_splits or _num_splits(rows, top_k, q.device), top_k)
    slots_per_split = triton.cdiv(top_k, splits)
    splits = triton.cdiv(top_k, slots_per_split)
    direct = splits == 1
    part_o = q.new_empty((rows, splits, group, head_dim) if not direct else (1,), dtype=torch.float32)
    part_lse = q.new_empty((rows, splits, group) if not direct else (1,), dtype=torch.float32)
    _sparse_decode_kernel[(batch * num_q, num_kv_heads, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, selected, out, part_o, part_lse,
        scale * _LOG2E, slots_per_split,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), selected.stride(0), selected.stride(1), selected.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        NUM_Q=num_q, G=group, GP=pow2(group, 16), P=page_size, D=head_dim, TOP_K=top_k,
        DIRECT=direct, UPCAST=INTERPRET,
    )
    if not direct:  # every split counts (an empty one has lse -inf): no valid tensor to fill
        lse_merge(part_o, part_lse, None, out.view(batch * num_q, num_q_heads, head_dim), merge)
    return out


# ---------------------------------------------------------------- public function


def sparse_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    selected: torch.Tensor | None,
    softmax_scale: float | None = None,
    *,
    merge: LseMerge = "auto",
    num_splits: int | None = None,
) -> torch.Tensor:
    """q: [B, Q, Hq, D]; caches [num_pages, P, Hkv, D]; block_tables: [B, max_pages];
    seq_lens: [B] (including the Q queries); selected: [B, Q, Hkv, K] logical block ids in any
    order, -1 = none (None = dense, served by the paged dense kernel) → o [B, Q, Hq, D] in q's dtype.
    merge: how split partials are merged (`lse_merge`'s method); num_splits: CTAs per (sequence,
    query, KV head) over the K slots, default about two waves over the SMs.
    """
    if selected is None:
        return dense_decode(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return _launch(q, k_cache, v_cache, block_tables, seq_lens, selected, scale, merge, num_splits)
