"""An experiment, kept out of the product: a tile-dense prepass for sparse prefill (plugged into
`msaserve/kernels/sparse_prefill/triton.py` through its `prepass` hook) that leaves fewer partials per
query. `sparse_prefill_tile_dense` is the whole op with it; bench_msa.py times it beside the default.

The KV-block-major kernel writes one partial (o, lse) per (query, head, selected block), and the
merge reads them all back: at the M3 shape that traffic, not the MMAs, bounds it. Consecutive
queries choose many of the same blocks, so here each tile of BQ consecutive queries of one sequence
(BQ · G = up to 128 MMA rows) and KV head finds the blocks that at least `min_share` of its queries
(and at least two) chose, and one program runs flash-attention style over just those blocks, with
the online softmax in registers, masking per row the blocks its query did not choose and the
causal limit. Each query then has one partial for its tile's common blocks plus one per other
block, which the block-major kernel computes as before.

Every (query, block) pair is computed exactly once, by one side or the other. The price is the
masked MMA work on common blocks a query did not choose (bounded by 1/min_share − 1 of it). On
bench_msa's data at the M3 shape (tiles of 8 queries) the plan leaves 5.3 partials per (query,
KV head) instead of 16 at min_share 0.5, for 19 % more MMA work, and 8.2 at 0.75 for 5 % more
(benchmarks/kernels/msa_coselection.py, CPU). On the H200 it is nonetheless slower end to end
(0.83–0.92× of block-major alone; this kernel reaches ≈ 260 useful TFLOP/s, no more than the
block-major kernel, and the merge does not shrink in proportion): off by default.
"""

import math

import torch
import triton
import triton.language as tl

from msaserve.kernels.sparse_prefill import triton as sparse_prefill_triton
from msaserve.kernels.triton_common import INTERPRET, check, configs, pow2

_LOG2E = 1.4426950408889634


def queries_per_tile(group: int) -> int:
    """Queries per tile: up to 128 MMA rows, and at most 16 queries: the larger the tile, the less
    its queries share (benchmarks/results/msa_coselection.json: on bench_msa's data, tiles of 8
    queries have 14.7 blocks chosen by at least half of them and 5.5 chosen by all)."""
    return max(1, min(16, 128 // group))


def max_dense_blocks(top_k: int, min_share: float) -> int:
    """Common blocks per tile can't exceed K / min_share: each has ≥ min_share of the n·K choices."""
    return math.floor(top_k / min_share) + 1


def plan_tiles(
    selected: torch.Tensor, seq_of_query: torch.Tensor, max_pages: int, bq: int, min_share: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """selected [Tq, Hkv, K] (distinct ids per row, -1 pad), sequence of each query [Tq] (ascending).

    Returns (tail [Tq, Hkv, K]: the selection minus the tile's common blocks, for the block-major
    kernel; dense_ids [tiles, Hkv, DMAX] int32 common blocks, -1 pad; dense_count [tiles, Hkv] int32;
    dense_slot [Tq, Hkv] int32: the slot whose partial holds the common blocks, -1 none;
    merge_valid [Tq, Hkv, K] int32: ≥ 0 where the merge reads a partial). Sync-free.
    """
    num_tokens, num_heads, top_k = selected.shape
    device = selected.device
    tiles = triton.cdiv(num_tokens, bq)
    dmax = max_dense_blocks(top_k, min_share)
    sel = selected.long()
    tile_of = torch.arange(num_tokens, device=device) // bq
    first = torch.arange(tiles, device=device) * bq
    # A tile shares blocks only within one sequence: block ids are per sequence.
    one_seq = seq_of_query[first] == seq_of_query[torch.clamp(first + bq - 1, max=num_tokens - 1)]
    n_queries = torch.clamp(num_tokens - first, max=bq)
    threshold = torch.clamp(torch.ceil(min_share * n_queries), min=2)  # [tiles]
    # Entries sorted by (tile, head, block): a block's count in its tile is its segment's length.
    group = tile_of[:, None, None] * num_heads + torch.arange(num_heads, device=device)[None, :, None]
    stride = max_pages + 1
    key = torch.where(sel >= 0, group * stride + sel, group * stride + max_pages).flatten()
    key, order = torch.sort(key)
    index = torch.arange(key.shape[0], device=device)
    seg_first = torch.searchsorted(key, key)
    count = torch.searchsorted(key, key, right=True) - seg_first
    key_group, block = key // stride, key % stride
    key_tile = key_group // num_heads
    dense_sorted = (block < max_pages) & (count >= threshold[key_tile]) & one_seq[key_tile]
    is_dense = torch.empty_like(dense_sorted).scatter_(0, order, dense_sorted).view(sel.shape)
    # One representative per common block, ranked within its (tile, head) group.
    rep = dense_sorted & (index == seg_first)
    reps_before = torch.cat([rep.new_zeros(1, dtype=torch.int64), torch.cumsum(rep, 0)])
    groups = torch.arange(tiles * num_heads, device=device)
    group_start = torch.searchsorted(key, groups * stride)
    group_end = torch.searchsorted(key, (groups + 1) * stride)
    dense_count = (reps_before[group_end] - reps_before[group_start]).to(torch.int32)
    rank = reps_before[index] - reps_before[group_start[key_group]]
    dump = tiles * num_heads * dmax  # non-representatives write here, sliced off below
    dest = torch.where(rep, key_group * dmax + rank, dump)
    dense_ids = torch.full((dump + 1,), -1, dtype=torch.int32, device=device)
    dense_ids = dense_ids.scatter_(0, dest, block.to(torch.int32))[:dump].view(tiles, num_heads, dmax)
    has_dense = is_dense.any(-1)
    dense_slot = torch.where(has_dense, is_dense.to(torch.int32).argmax(-1), -1).to(torch.int32)
    tail = torch.where(is_dense, -1, sel).to(torch.int32)
    slots = torch.arange(top_k, device=device)
    merge_valid = torch.where((tail >= 0) | (slots == dense_slot[..., None]), 0, -1).to(torch.int32)
    return tail, dense_ids, dense_count.view(tiles, num_heads), dense_slot, merge_valid


# Rows = BQ · G ≤ 128 is fixed by the plan; the autotuner picks warps and pipelining.
_CONFIGS = configs([{}], [(8, 2), (4, 2), (8, 3), (4, 3)])


@triton.autotune(configs=_CONFIGS, key=["P", "D", "G", "BLOCK_M"])
@triton.jit
def tile_dense_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, q_pos_ptr, seq_ptr, sel_ptr, dense_ids_ptr, dense_count_ptr,
    dense_slot_ptr, part_o_ptr, part_lse_ptr, qk_scale, num_tokens,
    stride_qt, stride_qh,
    stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, stride_tb,
    HKV: tl.constexpr, TOP_K: tl.constexpr, KP: tl.constexpr, G: tl.constexpr, P: tl.constexpr,
    D: tl.constexpr, DMAX: tl.constexpr, BQ: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """One (tile of BQ queries, KV head): its common blocks, one partial per (query, head)."""
    tile = tl.program_id(0)
    h = tl.program_id(1)
    n_dense = tl.load(dense_count_ptr + tile * HKV + h)
    if n_dense > 0:
        rows = tl.arange(0, BLOCK_M)  # row = query-in-tile · G + head-in-group
        t = tile * BQ + rows // G
        row_ok = (rows < BQ * G) & (t < num_tokens)
        offs_d = tl.arange(0, D)
        offs_p = tl.arange(0, P)
        offs_k = tl.arange(0, KP)
        pos = tl.load(q_pos_ptr + t, mask=row_ok, other=0)
        head = h * G + rows % G
        q = tl.load(q_ptr + t[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None], other=0.0)  # [BLOCK_M, D]
        chosen = tl.load(sel_ptr + (t[:, None] * HKV + h) * TOP_K + offs_k[None, :],
                         mask=row_ok[:, None] & (offs_k[None, :] < TOP_K), other=-1)  # [BLOCK_M, KP]
        slot = tl.load(dense_slot_ptr + t * HKV + h, mask=row_ok, other=-1)
        b = tl.load(seq_ptr + tile * BQ)
        if UPCAST:
            q = q.to(tl.float32)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        for i in range(0, n_dense):
            j = tl.load(dense_ids_ptr + (tile * HKV + h) * DMAX + i)
            page = tl.load(tables_ptr + b * stride_tb + j).to(tl.int64)
            keys = tl.load(k_ptr + page * stride_kp + h * stride_kh + offs_p[:, None] * stride_kt
                           + offs_d[None, :])
            values = tl.load(v_ptr + page * stride_vp + h * stride_vh + offs_p[:, None] * stride_vt
                             + offs_d[None, :])  # [P, D]
            if UPCAST:
                keys = keys.to(tl.float32)
                values = values.to(tl.float32)
            logits = tl.dot(q, tl.trans(keys)) * qk_scale  # [BLOCK_M, P], log2 units
            member = tl.max(tl.where(chosen == j, 1, 0), axis=1) > 0  # the row's query chose block j
            allowed = member[:, None] & ((j * P + offs_p)[None, :] <= pos[:, None])
            logits = tl.where(allowed, logits, float("-inf"))
            m_new = tl.maximum(m, tl.max(logits, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - m_safe)
            probs = tl.exp2(logits - m_safe[:, None])
            denom = denom * alpha + tl.sum(probs, axis=1)
            acc = acc * alpha[:, None] + tl.dot(probs.to(values.dtype), values)
            m = m_new
        seen = denom > 0
        out = acc / tl.where(seen, denom, 1.0)[:, None]
        lse = tl.where(seen, m + tl.log2(tl.where(seen, denom, 1.0)), float("-inf"))
        store = row_ok & (slot >= 0)
        # int64: a 32K-token chunk at the M3 shape has 2^32 partial elements.
        part_row = ((t * HKV + h) * TOP_K + slot).to(tl.int64) * G + rows % G
        tl.store(part_o_ptr + part_row[:, None] * D + offs_d[None, :], out.to(part_o_ptr.dtype.element_ty),
                 mask=store[:, None])
        tl.store(part_lse_ptr + part_row, lse, mask=store)


def block_rows(group: int) -> int:
    """MMA rows of a tile program (BQ · G rounded up to a power of two, at least 16)."""
    return pow2(queries_per_tile(group) * group, 16)


def tile_dense_prepass(min_share: float):
    """The prepass for `sparse_prefill_triton._launch`: run the tile-dense kernel on each tile's
    common blocks, writing their partials; → (the selection left to the block-major kernel, the
    merge's valid-partials mask), both [Tq, Hkv, K]."""

    def prepass(q, k_cache, v_cache, block_tables, selected, seq, pos, part_o, part_lse, scale):
        num_tokens, num_kv_heads, top_k = selected.shape
        group = q.shape[1] // num_kv_heads
        bq = queries_per_tile(group)
        tail, dense_ids, dense_count, dense_slot, merge_valid = plan_tiles(
            selected, seq, block_tables.shape[1], bq, min_share)
        tile_dense_kernel[(dense_count.shape[0], num_kv_heads)](
            q, k_cache, v_cache, block_tables, pos, seq, selected.to(torch.int32).contiguous(), dense_ids,
            dense_count, dense_slot, part_o, part_lse, scale * _LOG2E, num_tokens,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
            HKV=num_kv_heads, TOP_K=top_k, KP=pow2(top_k), G=group, P=k_cache.shape[1], D=q.shape[2],
            DMAX=max_dense_blocks(top_k, min_share), BQ=bq, UPCAST=INTERPRET, BLOCK_M=block_rows(group),
        )
        return tail, merge_valid

    return prepass


def sparse_prefill_tile_dense(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, selected: torch.Tensor, share: float,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """`sparse_prefill` (same shapes) with each tile's blocks chosen by ≥ `share` of its queries
    computed tile-dense first."""
    check(0.0 < share <= 1.0, f"tile_dense_share is {share}; allowed a share in (0, 1]")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return sparse_prefill_triton._launch(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, selected,
                                         scale, prepass=tile_dense_prepass(share))
