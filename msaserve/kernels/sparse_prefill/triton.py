"""Sparse prefill attention (docs/design.md §2), KV-block-major, in Triton.

The selection [Tq, Hkv, K] is inverted into work tiles: per (sequence, KV head, block) the queries
that chose it, cut into work items of up to 1024/G queries. A program loads its K/V page once and
loops over sub-tiles of BQ = BLOCK_M/G queries, packing each query's G heads into the M rows of the
MMA; it writes one partial (o, lse) per (query, head, slot). A second kernel merges the
≤ K partials of each (query, KV head) by LSE.

`_launch` takes an optional `prepass` that writes some partials itself before the block-major kernel
runs and hands it the rest of the selection: the tile-dense experiment (benchmarks/kernels/tile_dense.py,
measured slower on the H200 and kept out of the product) plugs in there.
"""

import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from msaserve.kernels.dense.gpu import dense_prefill
from msaserve.kernels.triton_common import (
    INTERPRET,
    check,
    check_last_contiguous,
    check_shape,
    configs,
    lse_merge,
    pow2,
)

_LOG2E = 1.4426950408889634

# ---------------------------------------------------------------- heuristics


def _queries_per_item(group: int) -> int:
    """Queries of one (seq, head, block) per program: 8 sub-tiles of 128 MMA rows. The page is loaded
    once for all of them, and the loop over sub-tiles overlaps the next queries' loads with the MMAs.
    On the H200 at 128K (16K chunks), 2 / 4 / 8 sub-tiles took 58.3 / 55.5 / 54.0 ms."""
    return max(1, 8 * 128 // group)


def _invert_selection(
    selected: torch.Tensor, seq_of_query: torch.Tensor, max_pages: int, queries_per_tile: int,
    max_segments: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """selected [Tq, Hkv, K] → entries sorted by (seq, KV head, block) then query, and the tiles.

    Returns (key [E] int64: (seq·Hkv + head)·max_pages + block, entry [E] int64: flat index into
    [Tq, Hkv, K], tile_start [N] int64, tile_count [N] int32, 0 for unused items). Sync-free.
    """
    num_heads = selected.shape[1]
    heads = torch.arange(num_heads, device=selected.device)
    sel = selected.long()
    invalid = 1 << 62  # a Python scalar: a tensor made from it would be a host-to-device copy per call
    key = (seq_of_query[:, None, None] * num_heads + heads[None, :, None]) * max_pages + sel
    key = torch.where(sel >= 0, key, invalid).flatten()
    key, entry = torch.sort(key, stable=True)  # stable: queries ascend within a block
    index = torch.arange(key.shape[0], device=key.device)
    # Keys are sorted: a segment's bounds are the first and past-the-last positions of its key.
    segment_first = torch.searchsorted(key, key)
    segment_end = torch.searchsorted(key, key, right=True)
    is_start = ((index - segment_first) % queries_per_tile == 0) & (key != invalid)
    # Items are scattered into a fixed upper bound (E / items + distinct segments), so that nothing
    # waits for the host; unused items keep count 0 and their programs exit at once.
    bound = key.shape[0] // queries_per_tile + min(key.shape[0], max_segments)
    dest = torch.where(is_start, torch.cumsum(is_start, 0) - 1, bound)
    counts = torch.clamp(segment_end - index, max=queries_per_tile).to(torch.int32)
    tile_start = torch.zeros(bound + 1, dtype=torch.int64, device=key.device).scatter_(0, dest, index)
    tile_count = torch.zeros(bound + 1, dtype=torch.int32, device=key.device).scatter_(0, dest, counts)
    tile_start, tile_count = tile_start[:bound], tile_count[:bound]
    return key, entry, tile_start, tile_count


# ---------------------------------------------------------------- autotune keyed on shapes

# BLOCK_M: MMA rows (queries × heads) per sub-tile. PREFETCH: load the next sub-tile's query rows (and
# the entries of the one after) into registers while this one computes, instead of relying on the
# compiler's pipelining of the gathers.
# On the H200 at the M3 shape (128K, 16K chunks, all chunks back to back) the prefetched loop at
# 64 rows and 4 warps took 42.4 ms against 49.2 ms for the best compiler-pipelined config.
_CONFIGS = configs([{"BLOCK_M": m, "PREFETCH": 0} for m in (128, 64)], [(8, 2), (4, 2), (8, 1)])
_CONFIGS += [] if INTERPRET else [
    triton.Config({"BLOCK_M": m, "PREFETCH": 1}, num_warps=w, num_stages=s)
    for m, w, s in ((128, 8, 1), (64, 4, 1), (64, 4, 2))
]


# ---------------------------------------------------------------- jit kernels


@triton.jit
def _subtile_entries(entry_ptr, e0, first, count, rows, G: tl.constexpr, BQ: tl.constexpr):
    """Entries (flat (t, h, slot)) of the sub-tile's queries starting at `first`, and its valid rows."""
    q_in_tile = first + rows // G
    row_ok = (rows < BQ * G) & (q_in_tile < count)
    entry = tl.load(entry_ptr + e0 + q_in_tile, mask=row_ok, other=0)  # [BLOCK_M]
    return entry, row_ok


@triton.jit
def _subtile_queries(q_ptr, q_pos_ptr, entry, row_ok, head, offs_d, stride_qt, stride_qh,
                     HKV: tl.constexpr, TOP_K: tl.constexpr):
    """Positions [BLOCK_M] and query rows [BLOCK_M, D] of a sub-tile's entries."""
    t = entry // (HKV * TOP_K)
    pos = tl.load(q_pos_ptr + t, mask=row_ok, other=0)
    q = tl.load(q_ptr + t[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    return pos, q


@triton.jit
def _attend_subtile(q, pos, entry, row_ok, keys_t, values, j, rows, offs_p, offs_d, qk_scale,
                    part_o_ptr, part_lse_ptr, G: tl.constexpr, P: tl.constexpr, D: tl.constexpr):
    """One sub-tile against the page: normalized partial o and its lse (log2 units), stored."""
    logits = tl.dot(q.to(keys_t.dtype), keys_t) * qk_scale  # [BLOCK_M, P], log2 units
    logits = tl.where((j * P + offs_p)[None, :] <= pos[:, None], logits, float("-inf"))
    m = tl.max(logits, axis=1)
    m = tl.where(row_ok, m, 0.0)  # padding rows: keep the arithmetic finite
    probs = tl.exp2(logits - m[:, None])
    denom = tl.sum(probs, axis=1)
    out = tl.dot(probs.to(values.dtype), values) / tl.where(denom > 0, denom, 1.0)[:, None]
    part_row = entry * G + rows % G  # [Tq·Hkv·K·G] rows of the partial buffers
    tl.store(part_o_ptr + part_row[:, None] * D + offs_d[None, :],
             out.to(part_o_ptr.dtype.element_ty), mask=row_ok[:, None])
    tl.store(part_lse_ptr + part_row, m + tl.log2(tl.where(denom > 0, denom, 1.0)), mask=row_ok)


@triton.autotune(configs=_CONFIGS, key=["P", "D", "G"])
@triton.jit
def _block_major_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, q_pos_ptr, key_ptr, entry_ptr, tile_start_ptr, tile_count_ptr,
    part_o_ptr, part_lse_ptr, qk_scale, max_pages,
    stride_qt, stride_qh,
    stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, stride_tb,
    HKV: tl.constexpr, TOP_K: tl.constexpr, G: tl.constexpr, P: tl.constexpr, D: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, PREFETCH: tl.constexpr,
):
    BQ = BLOCK_M // G  # queries per sub-tile (a constexpr)
    tile = tl.program_id(0)
    e0 = tl.load(tile_start_ptr + tile)
    count = tl.load(tile_count_ptr + tile)  # ≤ 1024/G queries, all of one (seq, head, block)
    if count > 0:
        key = tl.load(key_ptr + e0)
        j = key % max_pages
        h = (key // max_pages) % HKV
        b = key // max_pages // HKV
        page = tl.load(tables_ptr + b * stride_tb + j).to(tl.int64)
        offs_d = tl.arange(0, D)
        offs_p = tl.arange(0, P)
        # The page is read once and reused by every sub-tile of queries.
        keys = tl.load(k_ptr + page * stride_kp + h * stride_kh + offs_p[:, None] * stride_kt
                       + offs_d[None, :])  # [P, D]
        values = tl.load(v_ptr + page * stride_vp + h * stride_vh + offs_p[:, None] * stride_vt
                         + offs_d[None, :])
        if UPCAST:
            keys = keys.to(tl.float32)
            values = values.to(tl.float32)
        keys_t = tl.trans(keys)  # [D, P]
        rows = tl.arange(0, BLOCK_M)  # row = query-in-sub-tile · G + head-in-group
        head = h * G + rows % G
        if PREFETCH:
            # Registers hold sub-tile i's query rows and sub-tile i+1's entries: each gather's
            # address is known one sub-tile before its data is needed.
            entry, row_ok = _subtile_entries(entry_ptr, e0, 0, count, rows, G, BQ)
            pos, q = _subtile_queries(q_ptr, q_pos_ptr, entry, row_ok, head, offs_d, stride_qt, stride_qh,
                                      HKV, TOP_K)
            next_entry, next_ok = _subtile_entries(entry_ptr, e0, BQ, count, rows, G, BQ)
            for first in range(0, count, BQ):
                after_entry, after_ok = _subtile_entries(entry_ptr, e0, first + 2 * BQ, count, rows, G, BQ)
                next_pos, next_q = _subtile_queries(q_ptr, q_pos_ptr, next_entry, next_ok, head, offs_d,
                                                    stride_qt, stride_qh, HKV, TOP_K)
                _attend_subtile(q, pos, entry, row_ok, keys_t, values, j, rows, offs_p, offs_d, qk_scale,
                                part_o_ptr, part_lse_ptr, G, P, D)
                entry, row_ok, pos, q = next_entry, next_ok, next_pos, next_q
                next_entry, next_ok = after_entry, after_ok
        else:  # let the compiler pipeline the gathers (num_stages)
            for first in range(0, count, BQ):
                entry, row_ok = _subtile_entries(entry_ptr, e0, first, count, rows, G, BQ)
                pos, q = _subtile_queries(q_ptr, q_pos_ptr, entry, row_ok, head, offs_d, stride_qt, stride_qh,
                                          HKV, TOP_K)
                _attend_subtile(q, pos, entry, row_ok, keys_t, values, j, rows, offs_p, offs_d, qk_scale,
                                part_o_ptr, part_lse_ptr, G, P, D)


# ---------------------------------------------------------------- launcher


def _query_positions(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int):
    """→ (sequence of each query [Tq] int64, position of each query [Tq] int32)."""
    cu = cu_seqlens_q.long()
    tokens = torch.arange(num_tokens, device=cu.device)
    seq = torch.searchsorted(cu[1:], tokens, right=True)
    pos = seq_lens.long()[seq] - (cu[seq + 1] - cu[seq]) + (tokens - cu[seq])
    return seq, pos.to(torch.int32)


Prepass = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""(q, k_cache, v_cache, block_tables, selected, seq, pos, part_o, part_lse, scale) → (the selection
left to the block-major kernel, the merge's valid-partials mask), both [Tq, Hkv, K]; it writes the
partials of the slots it took into part_o / part_lse."""


def _launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    selected: torch.Tensor,
    scale: float,
    prepass: Prepass | None = None,
) -> torch.Tensor:
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    batch = block_tables.shape[0]
    top_k = selected.shape[-1]
    check(num_q_heads % num_kv_heads == 0, f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
    group = num_q_heads // num_kv_heads
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    check_shape("selected", selected, (num_tokens, num_kv_heads, top_k))
    check_shape("seq_lens", seq_lens, (batch,))
    check_shape("cu_seqlens_q", cu_seqlens_q, (batch + 1,))
    check(page_size == pow2(page_size) and head_dim == pow2(head_dim),
          f"page size {page_size} and head dim {head_dim} must be powers of two")
    check_last_contiguous(q=q, k_cache=k_cache, v_cache=v_cache)
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    block_tables = block_tables.to(torch.int32).contiguous()
    check(group <= 64, f"group size G={group} above 64 is not supported by the sub-tile shapes")
    seq, pos = _query_positions(cu_seqlens_q.to(q.device), seq_lens.to(q.device), num_tokens)
    # Partials per (query, KV head, slot, head-in-group); o in q's dtype halves the traffic.
    part_o = q.new_empty((num_tokens * num_kv_heads * top_k, group, head_dim))
    part_lse = q.new_empty((num_tokens * num_kv_heads * top_k, group), dtype=torch.float32)
    valid = selected
    if prepass is not None:
        selected, valid = prepass(q, k_cache, v_cache, block_tables, selected, seq, pos, part_o, part_lse,
                                  scale)
    key, entry, tile_start, tile_count = _invert_selection(
        selected, seq, block_tables.shape[1], _queries_per_item(group),
        max_segments=batch * num_kv_heads * block_tables.shape[1],
    )
    if tile_start.numel():  # zero only when Tq·Hkv·K < one item and no segment can exist
        _block_major_kernel[(tile_start.numel(),)](
            q, k_cache, v_cache, block_tables, pos, key, entry, tile_start, tile_count,
            part_o, part_lse, scale * _LOG2E, block_tables.shape[1],
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
            HKV=num_kv_heads, TOP_K=top_k, G=group, P=page_size, D=head_dim, UPCAST=INTERPRET,
        )
    valid = valid.to(torch.int32).reshape(num_tokens * num_kv_heads, top_k)
    lse_merge(part_o.view(-1, top_k, group, head_dim), part_lse.view(-1, top_k, group), valid, out)
    return out


# ---------------------------------------------------------------- public function


def sparse_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    selected: torch.Tensor | None,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """q: [Tq, Hq, D]; k_cache, v_cache: [num_pages, P, Hkv, D]; block_tables: [B, max_pages];
    seq_lens: [B]; cu_seqlens_q: [B + 1]; selected: [Tq, Hkv, K] logical block ids in any order,
    distinct per row, -1 = none (None = dense causal, served by SDPA) → o [Tq, Hq, D] in q's dtype.
    Query heads h*G .. h*G+G-1 share KV head h.
    """
    if selected is None:
        return dense_prefill(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, softmax_scale)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return _launch(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, selected, scale)
