"""Decode indexer (docs/design.md §2) in Triton: block-max scores of 1–16 queries per sequence against
every resident index page, and the top-K selection with the forced local/init blocks (n_local, n_init).

Shape of the work: the key axis is long (up to 8K pages of P tokens) and the query axis tiny
(Q · heads-per-key-head ≤ 64 rows), so the keys sit on the MMA's M side (`keys @ qᵀ`) and the
pages are split across CTAs. Stage 1: each CTA streams its pages once, keeps a running top-K
per row in registers and writes K candidates. Stage 2 merges the splits' candidates. The grid
depends only on (B, max_pages, heads), never on the lengths, so a CUDA graph can capture it.

fp8-e4m3 index keys can be scanned two ways (`Fp8Scan`):
- "widen-keys": every key tile is widened to fp16 for an fp16 MMA (one conversion per key element);
- "split-query": the keys stay fp8 and the query is split into fp8 terms, q = s · Σ_t term_t · 16⁻ᵗ
  with s a power of two per row, so the MMA reads the keys as stored and nothing is converted per
  key. Each term keeps 4 significant bits: two terms are exact for bf16 queries, three for fp16,
  and leave < 2⁻¹¹ of relative error per element for fp32 ones.
"""

from typing import Literal

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from msaserve.kernels.indexer_decode.merge import SplitMerge, merge_splits
from msaserve.kernels.indexer_prefill.naive import check_forced_blocks
from msaserve.kernels.triton_common import (
    EMPTY_ID_BASE,
    INTERPRET,
    check,
    check_last_contiguous,
    check_shape,
    num_sms,
    pow2,
    topk_insert,
)

Fp8Scan = Literal["widen-keys", "split-query"]
FP8_SCANS: tuple[Fp8Scan, ...] = ("widen-keys", "split-query")
# "split-query" won every row of the H200 decode table (benchmarks/results/kernels.json, decode; the
# other scan's columns are *_widen): at 1M x 8 the fp8 index is read at 3.14 TB/s instead of 2.47 (d7fd8a4).
DEFAULT_FP8_SCAN: Fp8Scan = "split-query"
KeyLoad = Literal["pointer", "tma"]
KEY_LOADS: tuple[KeyLoad, ...] = ("pointer", "tma")
# How a page of index keys reaches the MMA. "pointer": gathered through per-element addresses (the
# compiler pipelines them into shared memory); "tma": one tensor-memory-access box per page straight
# into shared memory (Hopper and later; the interpreter emulates it). On the H200, alternating the two
# over three rounds (benchmarks/results/indexer_decode_key_loads.json, e022016): bf16 keys at 1M x 8
# 0.4926 ms both; fp8 keys 0.344 ms by pointers, 0.373 by TMA; at 128K x 32 bf16 tied again and fp8
# TMA won by 4 %. The fp8 scan is bound by its per-page MMAs and epilogue, not by how the page
# arrives, so the default stays with pointers, which need no Hopper.
DEFAULT_KEY_LOAD: KeyLoad = "pointer"
# fp8 terms that represent a query of this dtype exactly (fp32: to 12 significant bits).
_QUERY_TERMS = {torch.bfloat16: 2, torch.float16: 3, torch.float32: 3}

# ---------------------------------------------------------------- heuristics


def _num_splits(batch: int, key_heads: int, max_pages: int, device: torch.device) -> int:
    """Enough CTAs for two waves over the SMs, never more splits than pages."""
    want = triton.cdiv(2 * num_sms(device), batch * key_heads)
    return max(1, min(want, max_pages))


# ---------------------------------------------------------------- autotune keyed on shapes

# PAGES: pages per loop iteration (more bytes in flight, fewer reductions per byte).
# PREFETCH: double-buffer the next pages in registers instead of relying on the compiler's pipelining.
_CONFIGS = [triton.Config({"PAGES": pages, "PREFETCH": prefetch}, num_warps=warps, num_stages=stages)
            for pages, prefetch, warps, stages in (
                (2, 1, 4, 1), (2, 0, 4, 3), (1, 0, 4, 4), (4, 0, 8, 2), (4, 1, 8, 1), (2, 1, 8, 1),
                (1, 1, 4, 1), (4, 0, 4, 3), (4, 0, 8, 3), (2, 0, 8, 3))]
# Deeper compiler pipelines, for TMA copies (PREFETCH does not apply to them) and pointer loads alike:
# at 1M x 8 both loads of bf16 keys picked (1 page, 4 warps, 6 stages), 0.4926 ms (e022016); the
# earlier list's pick (4 stages) measured 0.502-0.509 ms in the d7fd8a4 sweep, timed without warm-up.
_CONFIGS += [triton.Config({"PAGES": pages, "PREFETCH": 0}, num_warps=warps, num_stages=stages)
             for pages, warps, stages in ((1, 4, 6), (2, 4, 4), (1, 8, 4), (2, 8, 3), (4, 4, 2))]
_CONFIGS = _CONFIGS[:1] if INTERPRET else _CONFIGS


def _prune_configs(configs: list, named_args: dict, **kwargs) -> list:
    """Register prefetching only exists for pointer loads; TMA ones are pipelined by the compiler."""
    tma = kwargs.get("TMA", named_args.get("TMA"))
    return [c for c in configs if not (tma and c.kwargs["PREFETCH"])] or configs[:1]


# ---------------------------------------------------------------- jit kernels


@triton.jit
def _load_pages(cache_ptr, scale_ptr, tables_ptr, j0, end, stride_cp, stride_ct, stride_sp, stride_st,
                P: tl.constexpr, DI: tl.constexpr, PAGES: tl.constexpr, HAS_SCALE: tl.constexpr):
    """Keys [PAGES·P, DI] (zeros past `end`) and their scales [PAGES·P] (ones without fp8)."""
    offs_r = tl.arange(0, PAGES * P)  # key row: page · P + token
    offs_t = offs_r % P
    in_range = j0 + offs_r // P < end
    page = tl.load(tables_ptr + j0 + offs_r // P, mask=in_range, other=0)
    page = tl.maximum(page, 0).to(tl.int64)
    keys = tl.load(cache_ptr + page[:, None] * stride_cp + offs_t[:, None] * stride_ct
                   + tl.arange(0, DI)[None, :], mask=in_range[:, None], other=0.0)
    if HAS_SCALE:
        key_scale = tl.load(scale_ptr + page * stride_sp + offs_t * stride_st, mask=in_range, other=0.0)
    else:
        key_scale = tl.full([PAGES * P], 1.0, tl.float32)
    return keys, key_scale


@triton.jit
def _truncate_to_e4m3(x):
    """x (fp32) cut to sign, exponent and 3 mantissa bits: exact in fp8-e4m3 in its normal range,
    so the conversion after it never rounds, and x − result is exact in fp32."""
    return (x.to(tl.int32, bitcast=True) & -1048576).to(tl.float32, bitcast=True)  # 0xFFF00000


@triton.jit
def _split_query(q, TERMS: tl.constexpr):
    """q [NR, DI] → (t0, t1, t2) fp8-e4m3 [NR, DI] and s [NR], q ≈ s · (t0 + t1/16 + t2/256)
    (t2 is zero when TERMS = 2). s is a power of two that puts each row's max below 256 (e4m3 holds
    448), so q / s is exact; each term is the previous remainder times 16, which stays below 256."""
    x = q.to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)  # [NR]
    exp_bits = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF  # amax < 2^(exp_bits − 126)
    usable = exp_bits >= 8  # rows below 2⁻¹¹⁹ (padding: zeros) keep s = 1
    inv_scale = tl.where(usable, ((261 - exp_bits) << 23).to(tl.float32, bitcast=True), 1.0)
    scale = tl.where(usable, ((exp_bits - 7) << 23).to(tl.float32, bitcast=True), 1.0)
    x = x * inv_scale[:, None]
    t0 = _truncate_to_e4m3(x)
    x = (x - t0) * 16.0
    t1 = _truncate_to_e4m3(x)
    t2 = tl.zeros_like(t1)
    if TERMS > 2:
        t2 = _truncate_to_e4m3((x - t1) * 16.0)
    return t0.to(tl.float8e4nv), t1.to(tl.float8e4nv), t2.to(tl.float8e4nv), scale


@triton.jit
def _page_logits(keys, key_scale, q_t, q_t1, q_t2, HAS_SCALE: tl.constexpr, Q_TERMS: tl.constexpr):
    """keys [PAGES·P, DI] · queries → logits [PAGES·P, NR] fp32, key scales applied. With query terms
    the row's power-of-two scale is left out: it changes no row's ranking, ties included, and only
    ranks within a row leave this kernel."""
    if Q_TERMS > 0:  # fp8 keys as stored against the query's fp8 terms; the smallest term first
        logits = tl.dot(keys, q_t1, tl.dot(keys, q_t2) * 0.0625) if Q_TERMS > 2 else tl.dot(keys, q_t1)
        logits = tl.dot(keys, q_t, logits * 0.0625)
    else:
        logits = tl.dot(keys.to(q_t.dtype), q_t)  # fp8 keys widen to fp16 here
    if HAS_SCALE:
        logits = logits * key_scale[:, None]
    return logits


@triton.jit
def _tma_page_scores(key_desc, scale_ptr, tables_ptr, j0, end, col, stride_sp, stride_st, q_t, q_t1, q_t2,
                     P: tl.constexpr, NR: tl.constexpr, PAGES: tl.constexpr, HAS_SCALE: tl.constexpr,
                     Q_TERMS: tl.constexpr):
    """Block maxima [PAGES, NR] of pages j0 … j0+PAGES−1, each page copied by TMA as one [P, DI] box
    (pages past `end` read page 0; their scores are masked by the caller)."""
    offs_pg = tl.arange(0, PAGES)
    scores = tl.zeros([PAGES, NR], tl.float32)
    for i in tl.static_range(PAGES):
        in_range = j0 + i < end
        page = tl.maximum(tl.load(tables_ptr + j0 + i, mask=in_range, other=0), 0)
        keys = key_desc.load([page * P, col])  # [P, DI]
        if HAS_SCALE:
            key_scale = tl.load(scale_ptr + page.to(tl.int64) * stride_sp + tl.arange(0, P) * stride_st)
        else:
            key_scale = tl.full([P], 1.0, tl.float32)
        logits = _page_logits(keys, key_scale, q_t, q_t1, q_t2, HAS_SCALE, Q_TERMS)  # [P, NR]
        scores = tl.where(offs_pg[:, None] == i, tl.max(logits, axis=0)[None, :], scores)
    return scores


@triton.jit
def _fold_pages(vals, ids, keys, key_scale, q_t, q_t1, q_t2, j0, end, local, row_ok,
                P: tl.constexpr, NR: tl.constexpr, PAGES: tl.constexpr, N_INIT: tl.constexpr,
                N_LOCAL: tl.constexpr, HAS_SCALE: tl.constexpr, Q_TERMS: tl.constexpr):
    """Block maxima of PAGES pages for the NR rows, folded into the running top-K (vals, ids)."""
    logits = _page_logits(keys, key_scale, q_t, q_t1, q_t2, HAS_SCALE, Q_TERMS)  # [PAGES·P, NR]
    scores = tl.max(tl.reshape(logits, [PAGES, P, NR]), axis=1)  # [PAGES, NR] block maxima
    return _fold_scores(vals, ids, scores, j0, end, local, row_ok, NR, PAGES, N_INIT, N_LOCAL)


@triton.jit
def _fold_scores(vals, ids, scores, j0, end, local, row_ok,
                 NR: tl.constexpr, PAGES: tl.constexpr, N_INIT: tl.constexpr, N_LOCAL: tl.constexpr):
    """Block maxima [PAGES, NR] of pages j0 … folded into the running top-K (vals, ids)."""
    offs_pg = tl.arange(0, PAGES)
    blocks = j0 + offs_pg
    # forced: the N_LOCAL blocks ending at the row's block c, and blocks < N_INIT (both only ≤ c: `valid`)
    forced = (blocks[:, None] > local[None, :] - N_LOCAL) | (blocks[:, None] < N_INIT)
    scores = tl.where(forced, float("inf"), scores)
    valid = row_ok[None, :] & (blocks[:, None] <= local[None, :]) & (blocks[:, None] < end)
    # Once the running top-K has filled, a page rarely beats its worst entry: test that cheaply
    # and run the per-page insertion only when some row needs it.
    worst = tl.min(vals, axis=1)  # [NR]
    enters = valid & (scores > worst[None, :])
    if tl.max(tl.max(enters.to(tl.int32), axis=1), axis=0) > 0:
        for i in tl.static_range(PAGES):
            pick = offs_pg[:, None] == i
            score = tl.max(tl.where(pick, scores, float("-inf")), axis=0)  # [NR]
            ok = tl.max(tl.where(pick & valid, 1, 0), axis=0) > 0
            vals, ids = topk_insert(vals, ids, score, j0 + i, ok)
    return vals, ids


@triton.autotune(configs=_CONFIGS, key=["P", "DI", "NR", "KP", "HAS_SCALE", "Q_TERMS", "TMA"],
                 prune_configs_by={"early_config_prune": _prune_configs})
@triton.jit
def _score_split_kernel(
    q_ptr, cache_ptr, key_desc, scale_ptr, tables_ptr, seq_lens_ptr, cand_val_ptr, cand_id_ptr,
    stride_qb, stride_qq, stride_qh,
    stride_cp, stride_ct, stride_ch,
    stride_sp, stride_st, stride_sh,
    stride_tb, num_splits,
    NUM_Q: tl.constexpr, HPK: tl.constexpr, NR: tl.constexpr, P: tl.constexpr, DI: tl.constexpr,
    KP: tl.constexpr, N_INIT: tl.constexpr, N_LOCAL: tl.constexpr, HAS_SCALE: tl.constexpr,
    UPCAST: tl.constexpr,
    Q_TERMS: tl.constexpr, TMA: tl.constexpr, PAGES: tl.constexpr, PREFETCH: tl.constexpr,
):
    """One (sequence, split, key head): running top-K of its pages for the NR = Q·HPK rows.

    The sequence's resident pages (read here, from seq_lens) are shared out evenly over the
    num_splits CTAs, so a 64K-token sequence in an engine sized for 1M tokens still runs on all
    of them while the grid stays fixed for CUDA graphs."""
    b = tl.program_id(0)
    split = tl.program_id(1)
    hk = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    rows = tl.arange(0, NR)  # row = query · HPK + head-in-key-group
    q_i = rows // HPK
    row_ok = rows < NUM_Q * HPK
    local = (seq_len - NUM_Q + q_i) // P  # [NR] local block c of each row
    last_page = (seq_len - 1) // P
    offs_d = tl.arange(0, DI)
    q = tl.load(
        q_ptr + b * stride_qb + q_i[:, None] * stride_qq + (hk * HPK + rows % HPK)[:, None] * stride_qh
        + offs_d[None, :], mask=row_ok[:, None], other=0.0,
    )  # [NR, DI]
    q_t = tl.trans(q.to(tl.float32) if UPCAST else q)  # [DI, NR]
    q_t1 = q_t  # the lower fp8 terms, used when Q_TERMS > 0
    q_t2 = q_t
    if Q_TERMS > 0:  # keys stay fp8; the query becomes Q_TERMS fp8 terms ("split-query")
        t0, t1, t2, _ = _split_query(q, Q_TERMS)
        q_t, q_t1, q_t2 = tl.trans(t0), tl.trans(t1), tl.trans(t2)
    elif HAS_SCALE and not UPCAST:
        # fp8 keys widen to fp16 with one native conversion (to bf16 it takes several); bf16
        # queries are exact in fp16 within its range, so the dot is the same as in bf16.
        q_t = q_t.to(tl.float16)
    vals = tl.full([NR, KP], float("-inf"), tl.float32)
    ids = EMPTY_ID_BASE + tl.zeros([NR, KP], tl.int32) + tl.arange(0, KP)[None, :]
    pages_per_split = tl.cdiv(last_page + 1, num_splits)
    first = split * pages_per_split
    end = tl.minimum(first + pages_per_split, last_page + 1)
    cache_ptr += hk * stride_ch
    scale_ptr += hk * stride_sh
    tables_ptr += b * stride_tb
    if TMA:  # key_desc views the cache as [pages·P, HkI·DI]; the compiler pipelines the copies
        for j0 in range(first, end, PAGES):
            scores = _tma_page_scores(key_desc, scale_ptr, tables_ptr, j0, end, hk * DI, stride_sp, stride_st,
                                      q_t, q_t1, q_t2, P, NR, PAGES, HAS_SCALE, Q_TERMS)
            vals, ids = _fold_scores(vals, ids, scores, j0, end, local, row_ok, NR, PAGES, N_INIT, N_LOCAL)
    elif PREFETCH:  # double-buffer in registers: the next pages' loads are in flight during this fold
        keys, key_scale = _load_pages(cache_ptr, scale_ptr, tables_ptr, first, end, stride_cp, stride_ct,
                                      stride_sp, stride_st, P, DI, PAGES, HAS_SCALE)
        for j0 in range(first, end, PAGES):
            next_keys, next_scale = _load_pages(cache_ptr, scale_ptr, tables_ptr, j0 + PAGES, end, stride_cp,
                                                stride_ct, stride_sp, stride_st, P, DI, PAGES, HAS_SCALE)
            vals, ids = _fold_pages(vals, ids, keys, key_scale, q_t, q_t1, q_t2, j0, end, local,
                                    row_ok, P, NR, PAGES, N_INIT, N_LOCAL, HAS_SCALE, Q_TERMS)
            keys, key_scale = next_keys, next_scale
    else:  # let the compiler pipeline the loads (num_stages)
        for j0 in range(first, end, PAGES):
            keys, key_scale = _load_pages(cache_ptr, scale_ptr, tables_ptr, j0, end, stride_cp, stride_ct,
                                          stride_sp, stride_st, P, DI, PAGES, HAS_SCALE)
            vals, ids = _fold_pages(vals, ids, keys, key_scale, q_t, q_t1, q_t2, j0, end, local,
                                    row_ok, P, NR, PAGES, N_INIT, N_LOCAL, HAS_SCALE, Q_TERMS)
    base = ((b * tl.num_programs(2) + hk) * num_splits + split) * NR * KP
    offs = base + rows[:, None] * KP + tl.arange(0, KP)[None, :]
    tl.store(cand_val_ptr + offs, vals)
    tl.store(cand_id_ptr + offs, ids)


# ---------------------------------------------------------------- launcher


def _query_terms(q_index: torch.Tensor, index_scale: torch.Tensor | None, fp8_scan: Fp8Scan) -> int:
    """Q_TERMS for the kernel: 0 unless fp8 keys are scanned with the query split into fp8 terms."""
    check(fp8_scan in FP8_SCANS, f"fp8_scan is {fp8_scan!r}; allowed {', '.join(FP8_SCANS)}")
    if index_scale is None or fp8_scan == "widen-keys":
        return 0
    check(q_index.dtype in _QUERY_TERMS,
          f"q_index dtype {q_index.dtype} cannot be split into fp8 terms; allowed bf16, fp16, fp32")
    return _QUERY_TERMS[q_index.dtype]


def _key_descriptor(index_cache: torch.Tensor, key_load: KeyLoad) -> TensorDescriptor | None:
    """A TMA descriptor over the cache as [pages·P, HkI·DI] with [P, DI] boxes, or None for pointer loads.

    TMA needs Hopper or later, a 16-byte-aligned base and the (page, token, head) axes packed; a cache
    that is not gets a clear error instead of a silent fallback, so a benchmark measures what it names."""
    check(key_load in KEY_LOADS, f"key_load is {key_load!r}; allowed {', '.join(KEY_LOADS)}")
    if key_load == "pointer":
        return None
    num_pages, page_size, key_heads, index_dim = index_cache.shape
    major = torch.cuda.get_device_capability(index_cache.device)[0] if index_cache.is_cuda else None
    row_bytes = index_cache.stride(1) * index_cache.element_size()
    packed = index_cache.stride(2) == index_dim and index_cache.stride(0) == page_size * index_cache.stride(1)
    packed = packed and index_cache.data_ptr() % 16 == 0 and row_bytes % 16 == 0
    check(major is None or major >= 9,
          f"key_load='tma' needs compute capability 9.0 or later, this GPU has {major}.x")
    check(packed, f"key_load='tma' needs index_cache packed as [pages, P, HkI, DI] with a 16-byte-aligned "
                  f"base and rows; got strides {index_cache.stride()} at address {index_cache.data_ptr()}")
    view = index_cache.as_strided((num_pages * page_size, key_heads * index_dim), (index_cache.stride(1), 1))
    return TensorDescriptor(view, list(view.shape), list(view.stride()), [page_size, index_dim])


def _launch(
    q_index: torch.Tensor,
    index_cache: torch.Tensor,
    index_scale: torch.Tensor | None,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    top_k: int,
    n_init: int,
    n_local: int,
    fp8_scan: Fp8Scan,
    key_load: KeyLoad,
    split_merge: SplitMerge = "auto",
    num_splits: int | None = None,
) -> torch.Tensor:
    batch, num_q, num_heads, index_dim = q_index.shape
    num_pages, page_size, key_heads, _ = index_cache.shape
    check(1 <= num_q <= 16, f"indexer_decode takes 1–16 queries per sequence, got Q={num_q}")
    check(key_heads in (1, num_heads), f"index_cache has HkI={key_heads}; allowed 1 or Hkv={num_heads}")
    check_shape("index_cache", index_cache, (num_pages, page_size, key_heads, index_dim))
    check(block_tables.dim() == 2 and block_tables.shape[0] == batch,
          f"block_tables has shape {tuple(block_tables.shape)}, expected [{batch}, max_pages]")
    check_shape("seq_lens", seq_lens, (batch,))
    check_forced_blocks(top_k, n_init, n_local)
    check(page_size == pow2(page_size) and index_dim == pow2(index_dim),
          f"page size {page_size} and index dim {index_dim} must be powers of two")
    check_last_contiguous(q_index=q_index, index_cache=index_cache)
    if index_scale is not None:
        check_shape("index_scale", index_scale, (num_pages, page_size, key_heads))
    block_tables = block_tables.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32)
    heads_per_key = num_heads // key_heads
    num_rows = pow2(num_q * heads_per_key, 16)
    kp = pow2(top_k)
    max_pages = block_tables.shape[1]
    check(num_splits is None or num_splits >= 1,
          f"num_splits is {num_splits}; allowed None or an integer ≥ 1")
    splits = num_splits or _num_splits(batch, key_heads, max_pages, q_index.device)
    pages_per_split = triton.cdiv(max_pages, splits)
    splits = triton.cdiv(max_pages, pages_per_split)
    cand_val = torch.empty((batch, key_heads, splits, num_rows, kp), device=q_index.device,
                           dtype=torch.float32)
    cand_id = torch.empty_like(cand_val, dtype=torch.int32)
    scale = index_scale if index_scale is not None else cand_val  # unused when HAS_SCALE=False
    key_desc = _key_descriptor(index_cache, key_load)
    _score_split_kernel[(batch, splits, key_heads)](
        q_index, index_cache, key_desc if key_desc is not None else index_cache, scale, block_tables,
        seq_lens, cand_val, cand_id,
        q_index.stride(0), q_index.stride(1), q_index.stride(2),
        index_cache.stride(0), index_cache.stride(1), index_cache.stride(2),
        scale.stride(0), scale.stride(1), scale.stride(2),
        block_tables.stride(0), splits,
        NUM_Q=num_q, HPK=heads_per_key, NR=num_rows, P=page_size, DI=index_dim, KP=kp, N_INIT=n_init,
        N_LOCAL=n_local, HAS_SCALE=index_scale is not None, UPCAST=INTERPRET,
        Q_TERMS=_query_terms(q_index, index_scale, fp8_scan), TMA=key_desc is not None,
    )
    out = torch.empty((batch, num_q, num_heads, top_k), device=q_index.device, dtype=torch.int32)
    merge_splits(cand_val, cand_id, out, heads_per_key, split_merge)
    return out


# ---------------------------------------------------------------- public function


def indexer_decode(
    q_index: torch.Tensor,
    index_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    top_k: int,
    n_init: int = 1,
    index_scale: torch.Tensor | None = None,
    *,
    fp8_scan: Fp8Scan = DEFAULT_FP8_SCAN,
    key_load: KeyLoad = DEFAULT_KEY_LOAD,
    n_local: int = 1,
    split_merge: SplitMerge = "auto",
    num_splits: int | None = None,
) -> torch.Tensor:
    """q_index: [B, Q, Hkv, DI] (query i of sequence b at position seq_lens[b] - Q + i);
    index_cache: [num_pages, P, HkI, DI] (bf16/fp16/fp32, or fp8-e4m3 with index_scale
    [num_pages, P, HkI] fp32); block_tables: [B, max_pages]; seq_lens: [B]
    → selected [B, Q, Hkv, top_k] int32 (ascending, -1 pad); n_init, n_local as in the spec's
    `select_blocks`.
    fp8_scan: how fp8 keys meet the query (module docstring); ignored for other key dtypes.
    key_load: how key pages reach the MMA: "pointer" gathers or "tma" copies (DEFAULT_KEY_LOAD).
    split_merge: how the splits' candidates are merged (merge.py); "auto" picks by the split count.
    num_splits: CTAs per (sequence, key head) scanning the pages; default two waves over the SMs.
    """
    return _launch(q_index, index_cache, index_scale, block_tables, seq_lens, top_k, n_init, n_local,
                   fp8_scan, key_load, split_merge, num_splits)
