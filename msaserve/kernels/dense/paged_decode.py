"""Dense paged decode attention in Triton (flash-decoding): the dense baseline's decode on CUDA.

Every query attends to all keys of its sequence up to its own position, read straight from the
paged cache through the block table (no gather into a contiguous K/V). (sequence, query, KV head)
is the batch axis; the group's G query heads share one tile (rows of the MMA), so each page is read
once per group. When the batch is too small to fill the GPU, each row's pages are split across
`num_splits` CTAs, each writing a partial (o, lse), merged by LSE afterwards.

The page count of each sequence is read on the device (from `seq_lens`) and the grid depends only
on the batch size and the block table's width, so a decode step holds no host synchronisation and
CUDA graphs can capture it: one graph then serves every context length.
"""

import math

import torch
import triton
import triton.language as tl

from msaserve.kernels.triton_common import (
    INTERPRET,
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


def default_num_splits(rows: int, max_pages: int, device: torch.device) -> int:
    """About four CTAs per SM: split each row's pages when rows alone do not fill the GPU. The K/V
    loads of one page are not software-pipelined (Triton keeps them synchronous here), so latency
    is hidden by several resident CTAs per SM, and a short tail by many of them.

    A power of two (≤ max_pages) so that eager steps of varying width compile few merge variants.
    """
    want = min(triton.cdiv(4 * num_sms(device), rows), max(1, max_pages))
    return 1 << (want.bit_length() - 1)


# ---------------------------------------------------------------- autotune keyed on shapes

_CONFIGS = configs([{}], [(4, 2), (4, 3), (8, 2)])


# ---------------------------------------------------------------- jit kernel


@triton.autotune(configs=_CONFIGS, key=["P", "D", "GP", "NUM_Q", "DIRECT"])
@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, seq_lens_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    qk_scale, num_splits,
    stride_qb, stride_qq, stride_qh,
    stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
    stride_tb, stride_ob, stride_oq, stride_oh,
    NUM_Q: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, P: tl.constexpr, D: tl.constexpr,
    DIRECT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    bq = tl.program_id(0)  # sequence · NUM_Q + query
    h = tl.program_id(1)
    split = tl.program_id(2)
    b = bq // NUM_Q
    q_i = bq % NUM_Q
    pos = tl.load(seq_lens_ptr + b) - NUM_Q + q_i  # this query's position: it sees keys ≤ pos
    num_pages = (pos + P) // P  # pages holding keys 0..pos
    per_split = tl.cdiv(num_pages, num_splits)
    first = split * per_split
    last = tl.minimum(first + per_split, num_pages)
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
    table_row = tables_ptr + b.to(tl.int64) * stride_tb
    for j in range(first, last):
        page = tl.load(table_row + j)
        # A sequence's pages are all resident under the dense backend; a -1 entry would still
        # read page 0 (a real page, finite values) with its keys masked out, never address -1.
        resident = page >= 0
        page = tl.maximum(page, 0).to(tl.int64)
        kv_off = offs_p[:, None] * stride_kt + offs_d[None, :]
        keys = tl.load(k_ptr + page * stride_kp + h * stride_kh + kv_off)  # [P, D]
        values = tl.load(v_ptr + page * stride_vp + h * stride_vh + offs_p[:, None] * stride_vt
                         + offs_d[None, :])  # [P, D]
        logits = tl.dot(q, tl.trans(keys.to(q.dtype)), input_precision=PRECISION) * qk_scale  # [GP, P], log2
        visible = ((j * P + offs_p) <= pos) & resident
        logits = tl.where(visible[None, :], logits, float("-inf"))
        m_new = tl.maximum(m, tl.max(logits, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        probs = tl.exp2(logits - m_safe[:, None])
        denom = denom * alpha + tl.sum(probs, axis=1)
        acc = acc * alpha[:, None] + tl.dot(probs.to(q.dtype), values.to(q.dtype), input_precision=PRECISION)
        m = m_new
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    if DIRECT:
        ptrs = out_ptr + b * stride_ob + q_i * stride_oq + (h * G + offs_g)[:, None] * stride_oh
        tl.store(ptrs + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=mask_g[:, None])
    else:  # an empty split (more splits than pages) writes lse = -inf, which the merge weighs 0
        row = ((bq * tl.num_programs(1) + h) * num_splits + split).to(tl.int64)
        tl.store(part_o_ptr + row * G * D + offs_g[:, None] * D + offs_d[None, :], out, mask=mask_g[:, None])
        tl.store(part_lse_ptr + row * G + offs_g, m + tl.log2(tl.where(denom > 0, denom, 1.0)), mask=mask_g)


# ---------------------------------------------------------------- launcher


def _check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: torch.Tensor) -> None:
    batch, _, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, k_dim = k_cache.shape
    check(k_dim == head_dim, f"k_cache head dim {k_dim} differs from q's {head_dim}")
    check(num_q_heads % num_kv_heads == 0, f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    check_shape("seq_lens", seq_lens, (batch,))
    check(block_tables.dim() == 2 and block_tables.shape[0] == batch,
          f"block_tables has shape {tuple(block_tables.shape)}, expected [{batch}, max_pages]")
    check(page_size == pow2(page_size) and head_dim == pow2(head_dim) and min(page_size, head_dim) >= 16,
          f"page size {page_size} and head dim {head_dim} must be powers of two ≥ 16")
    check_last_contiguous(q=q, k_cache=k_cache, v_cache=v_cache)


def dense_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """q: [B, Q, Hq, D]; caches [num_pages, P, Hkv, D]; block_tables: [B, max_pages] int32;
    seq_lens: [B] int32 (including the Q queries) → o [B, Q, Hq, D] in q's dtype.

    Query i of a sequence (position seq_len - Q + i) attends to every key at positions ≤ its own.
    num_splits: CTAs per (sequence, query, KV head); default from the batch and the GPU's SMs.
    """
    _check_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    batch, num_q, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    block_tables, seq_lens = block_tables.to(torch.int32).contiguous(), seq_lens.to(torch.int32)
    out = torch.empty(q.shape, device=q.device, dtype=q.dtype)  # contiguous: the merge views it
    rows = batch * num_q * num_kv_heads
    if num_splits is None:
        num_splits = default_num_splits(rows, block_tables.shape[1], q.device)
    check(num_splits >= 1, f"num_splits={num_splits} is invalid: allowed an integer ≥ 1")
    direct = num_splits == 1
    part_o = q.new_empty((rows, num_splits, group, head_dim) if not direct else (1,), dtype=torch.float32)
    part_lse = q.new_empty((rows, num_splits, group) if not direct else (1,), dtype=torch.float32)
    _paged_decode_kernel[(batch * num_q, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_o, part_lse,
        scale * _LOG2E, num_splits,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), out.stride(2),
        NUM_Q=num_q, G=group, GP=pow2(group, 16), P=k_cache.shape[1], D=head_dim,
        DIRECT=direct, UPCAST=INTERPRET,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 stays fp32 (no TF32 rounding)
    )
    if not direct:
        valid = torch.zeros((rows, num_splits), device=q.device, dtype=torch.int32)
        lse_merge(part_o, part_lse, valid, out.view(batch * num_q, num_q_heads, head_dim))
    return out
