"""Prefill indexer (docs/design.md §2) in Triton: causal block-max scores of a chunk of queries against the
paged index cache (prefix + chunk), fused with the top-K selection per (query, KV group).

Each program owns a tile of rows = (query, index head sharing one key head) of one sequence and
one key head; it streams the sequence's index pages 0..c_max once (`q @ keysᵀ`, a causal GEMM),
reduces each page to its block-max and folds it into a running top-K held in registers, so no
[Tq, num_blocks] score tensor is ever written. Only the query's own block c can hold keys after
it, and c is always forced (n_local ≥ 1), so scores need no causal mask inside a page.
"""

from typing import Literal

import torch
import triton
import triton.language as tl

from msaserve.kernels.indexer_prefill.naive import check_forced_blocks
from msaserve.kernels.indexer_prefill.query_groups import indexer_prefill_by_groups
from msaserve.kernels.triton_common import (
    EMPTY_ID_BASE,
    INTERPRET,
    check,
    check_last_contiguous,
    check_shape,
    configs,
    num_sms,
    pow2,
    sorted_selection,
    topk_insert,
)

# ---------------------------------------------------------------- heuristics


def _block_rows(page_size: int, index_dim: int) -> int:
    """Rows (query × head) per program: a 128-row MMA tile on the GPU, smaller under the interpreter."""
    if INTERPRET:
        return 32
    return 128 if page_size * index_dim <= 128 * 128 else 64


def _tile_map(cu_seqlens_q: torch.Tensor, queries_per_tile: int, max_tiles: int) -> torch.Tensor:
    """Per tile (padded to max_tiles): [seq, first query] int32, seq = -1 for unused tiles.

    Computed on the device so that the launcher never waits for the host.
    """
    lengths = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    tiles = (lengths + queries_per_tile - 1) // queries_per_tile  # [B]
    ends = torch.cumsum(tiles, 0)
    tile_ids = torch.arange(max_tiles, device=cu_seqlens_q.device)
    seq = torch.searchsorted(ends, tile_ids, right=True)  # [max_tiles]
    used = seq < lengths.shape[0]
    seq_c = seq.clamp(max=lengths.shape[0] - 1)
    first = cu_seqlens_q[seq_c].long() + (tile_ids - (ends[seq_c] - tiles[seq_c])) * queries_per_tile
    return torch.stack([torch.where(used, seq_c, -1), first], dim=1).to(torch.int32)


Path = Literal["auto", "tiles", "groups"]
PATHS: tuple[Path, ...] = ("auto", "tiles", "groups")
GROUPS_MAX_QUERIES = 1024
"""Chunks of at most this many queries (all sequences of the call) go through `query_groups`.

Measured on the H200 (benchmarks/kernels/profile_production_case.py, git 3de437b, one sequence,
CUDA graphs, ms tile kernel / groups): at 64K tokens 64 q 0.61 / 0.09, 171 q 0.62 / 0.14, 512 q
0.62 / 0.25, 1024 q 0.64 / 0.51, 2048 q 0.63 / 0.83; at 128K 1024 q 1.60 / 0.91, 2048 q 1.64 / 1.49,
4096 q 1.67 / 2.57. The groups re-read the prefix once per 16 queries, the tiles once per 32 but
with too few programs; 1024 is below both crossovers."""


def choose_path(num_tokens: int, batch: int, key_heads: int, num_heads: int, page_size: int, index_dim: int,
                device: torch.device) -> Path:
    """"groups" for chunks of at most GROUPS_MAX_QUERIES queries whose tile grid (tiles × key heads,
    from shapes alone) is under one wave of the GPU's SMs: the tile kernel's programs each stream a
    whole sequence, so a short chunk over a long prefix leaves most SMs idle. "tiles" on the CPU
    interpreter and otherwise."""
    if INTERPRET or device.type != "cuda" or num_tokens > GROUPS_MAX_QUERIES:
        return "tiles"
    heads_per_key = num_heads // key_heads
    queries_per_tile = max(_block_rows(page_size, index_dim), pow2(heads_per_key)) // heads_per_key
    programs = (triton.cdiv(num_tokens, queries_per_tile) + batch) * key_heads
    return "groups" if programs < num_sms(device) else "tiles"


DEFAULT_GATE = False
"""Skip a page's top-K insertion when no row of the tile enters (the decode kernel does; the
selections are the same, tested against the spec). Off by default until it is timed on a GPU:
`benchmarks/kernels/ab_indexer_prefill_tiles.py` compares it, and 256-row tiles, with this kernel."""

# ---------------------------------------------------------------- autotune keyed on shapes

_CONFIGS = configs([{}], [(8, 3), (4, 3), (8, 2)])


# ---------------------------------------------------------------- jit kernel


@triton.autotune(configs=_CONFIGS, key=["P", "DI", "BLOCK_M", "KP", "HAS_SCALE", "GATE"])
@triton.jit
def _indexer_prefill_kernel(
    q_ptr, cache_ptr, scale_ptr, tables_ptr, seq_lens_ptr, cu_q_ptr, tile_map_ptr, out_ptr,
    stride_qt, stride_qh,
    stride_cp, stride_ct, stride_ch,
    stride_sp, stride_st, stride_sh,
    stride_tb, stride_ot, stride_oh,
    HPK: tl.constexpr, BQ: tl.constexpr, BLOCK_M: tl.constexpr, P: tl.constexpr, DI: tl.constexpr,
    KP: tl.constexpr, TOP_K: tl.constexpr, N_INIT: tl.constexpr, N_LOCAL: tl.constexpr,
    HAS_SCALE: tl.constexpr, UPCAST: tl.constexpr, GATE: tl.constexpr,
):
    tile = tl.program_id(0)
    hk = tl.program_id(1)
    b = tl.load(tile_map_ptr + 2 * tile)
    if b >= 0:
        q_first = tl.load(tile_map_ptr + 2 * tile + 1)
        q_start = tl.load(cu_q_ptr + b)
        q_end = tl.load(cu_q_ptr + b + 1)
        seq_len = tl.load(seq_lens_ptr + b)
        rows = tl.arange(0, BLOCK_M)  # row = query-in-tile · HPK + head-in-key-group
        t = q_first + rows // HPK
        row_ok = (rows < BQ * HPK) & (t < q_end)
        pos = seq_len - (q_end - q_start) + (t - q_start)  # [BLOCK_M]
        local = pos // P
        h = hk * HPK + rows % HPK
        offs_d = tl.arange(0, DI)
        offs_p = tl.arange(0, P)
        q = tl.load(q_ptr + t[:, None].to(tl.int64) * stride_qt + h[:, None] * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None], other=0.0)  # [BLOCK_M, DI]
        if UPCAST:
            q = q.to(tl.float32)
        elif HAS_SCALE:  # fp8 keys widen to fp16 natively; bf16 queries are exact in fp16's range
            q = q.to(tl.float16)
        vals = tl.full([BLOCK_M, KP], float("-inf"), tl.float32)
        ids = EMPTY_ID_BASE + tl.zeros([BLOCK_M, KP], tl.int32) + tl.arange(0, KP)[None, :]
        # Slots past TOP_K (KP is a power of two) hold +inf so they are never evicted.
        vals = tl.where(tl.arange(0, KP)[None, :] < TOP_K, vals, float("inf"))
        last_block = tl.max(tl.where(row_ok, local, 0), axis=0)
        worst = tl.min(vals, axis=1)  # [BLOCK_M] each row's entry a new block must beat (GATE)
        for j in range(0, last_block + 1):
            page = tl.maximum(tl.load(tables_ptr + b * stride_tb + j), 0)
            keys = tl.load(cache_ptr + page.to(tl.int64) * stride_cp + hk * stride_ch
                           + offs_p[:, None] * stride_ct + offs_d[None, :])  # [P, DI]
            logits = tl.dot(q, tl.trans(keys.to(q.dtype)))  # [BLOCK_M, P] fp32
            if HAS_SCALE:
                key_scale = tl.load(scale_ptr + page.to(tl.int64) * stride_sp + hk * stride_sh
                                    + offs_p * stride_st)
                logits = logits * key_scale[None, :]
            score = tl.max(logits, axis=1)
            # forced: the N_LOCAL blocks ending at c and the blocks < N_INIT (only j ≤ c enters below)
            score = tl.where((j > local - N_LOCAL) | (j < N_INIT), float("inf"), score)
            valid = row_ok & (j <= local)
            if GATE:  # once the rows' top-K have filled, most pages enter none: skip the insertion
                if tl.max((valid & (score > worst)).to(tl.int32), axis=0) > 0:
                    vals, ids = topk_insert(vals, ids, score, j, valid)
                    worst = tl.min(vals, axis=1)
            else:
                vals, ids = topk_insert(vals, ids, score, j, valid)
        chosen = sorted_selection(ids, EMPTY_ID_BASE)  # [BLOCK_M, KP]
        offs_k = tl.arange(0, KP)
        ptrs = out_ptr + t[:, None].to(tl.int64) * stride_ot + h[:, None] * stride_oh + offs_k[None, :]
        tl.store(ptrs, chosen, mask=row_ok[:, None] & (offs_k[None, :] < TOP_K))


# ---------------------------------------------------------------- launcher


def _launch(
    q_index: torch.Tensor,
    index_cache: torch.Tensor,
    index_scale: torch.Tensor | None,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    top_k: int,
    n_init: int,
    n_local: int,
    gate: bool = DEFAULT_GATE,
    block_rows: int | None = None,
) -> torch.Tensor:
    """gate: skip a page's top-K insertion when no row enters (same selections); block_rows: rows
    (query × head) per program, a power of two (default `_block_rows`): more rows read each key
    page once for more queries."""
    num_tokens, num_heads, index_dim = q_index.shape
    num_pages, page_size, key_heads, _ = index_cache.shape
    batch = block_tables.shape[0]
    check(key_heads in (1, num_heads), f"index_cache has HkI={key_heads}; allowed 1 or Hkv={num_heads}")
    check_shape("index_cache", index_cache, (num_pages, page_size, key_heads, index_dim))
    check_shape("seq_lens", seq_lens, (batch,))
    check_shape("cu_seqlens_q", cu_seqlens_q, (batch + 1,))
    check_forced_blocks(top_k, n_init, n_local)
    check(page_size == pow2(page_size) and index_dim == pow2(index_dim),
          f"page size {page_size} and index dim {index_dim} must be powers of two")
    check_last_contiguous(q_index=q_index, index_cache=index_cache)
    if index_scale is not None:
        check_shape("index_scale", index_scale, (num_pages, page_size, key_heads))
    block_tables = block_tables.to(torch.int32).contiguous()
    out = torch.full((num_tokens, num_heads, top_k), -1, device=q_index.device, dtype=torch.int32)
    if num_tokens == 0:
        return out
    heads_per_key = num_heads // key_heads
    check(block_rows is None or (block_rows >= 16 and block_rows == pow2(block_rows)),
          f"block_rows is {block_rows}; allowed None or a power of two ≥ 16")
    block_m = max(block_rows or _block_rows(page_size, index_dim), pow2(heads_per_key))
    queries_per_tile = block_m // heads_per_key
    max_tiles = triton.cdiv(num_tokens, queries_per_tile) + batch
    tile_map = _tile_map(cu_seqlens_q.to(q_index.device), queries_per_tile, max_tiles)
    scale = index_scale if index_scale is not None else out.new_empty((1, 1, 1), dtype=torch.float32)
    _indexer_prefill_kernel[(max_tiles, key_heads)](
        q_index, index_cache, scale, block_tables, seq_lens.to(torch.int32),
        cu_seqlens_q.to(torch.int32), tile_map, out,
        q_index.stride(0), q_index.stride(1),
        index_cache.stride(0), index_cache.stride(1), index_cache.stride(2),
        scale.stride(0), scale.stride(1), scale.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        HPK=heads_per_key, BQ=queries_per_tile, BLOCK_M=block_m, P=page_size, DI=index_dim,
        KP=pow2(top_k), TOP_K=top_k, N_INIT=n_init, N_LOCAL=n_local, HAS_SCALE=index_scale is not None,
        UPCAST=INTERPRET, GATE=gate,
    )
    return out


# ---------------------------------------------------------------- public function


def indexer_prefill(
    q_index: torch.Tensor,
    index_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    top_k: int,
    n_init: int = 1,
    index_scale: torch.Tensor | None = None,
    n_local: int = 1,
    *,
    path: Path = "auto",
) -> torch.Tensor:
    """q_index: [Tq, Hkv, DI]; index_cache: [num_pages, P, HkI, DI] (bf16/fp16/fp32, or fp8-e4m3 with
    index_scale [num_pages, P, HkI] fp32); block_tables: [B, max_pages] int32; seq_lens: [B];
    cu_seqlens_q: [B + 1] → selected [Tq, Hkv, top_k] int32 (ascending, -1 pad); n_init, n_local as in
    the spec's `select_blocks`. The chunk's own index keys must already be written to the cache.
    path: "tiles" (this module's kernel), "groups" (`query_groups`: the decode kernels over groups of
    16 queries) or "auto" (`choose_path`).
    """
    check(path in PATHS, f"path is {path!r}; allowed {', '.join(PATHS)}")
    if path == "auto":
        path = choose_path(q_index.shape[0], block_tables.shape[0], index_cache.shape[2], q_index.shape[1],
                           index_cache.shape[1], index_cache.shape[3], q_index.device)
    if path == "groups":
        return indexer_prefill_by_groups(q_index, index_cache, index_scale, block_tables, seq_lens,
                                         cu_seqlens_q, top_k, n_init, n_local)
    return _launch(q_index, index_cache, index_scale, block_tables, seq_lens, cu_seqlens_q, top_k, n_init,
                   n_local)
