"""The decode indexer's second stage (docs/design.md §2): top-K per row over the splits' candidates,
value descending then block id ascending, returned as ascending block ids (-1 pad).

The first stage (`_score_split_kernel` in triton.py) leaves K candidates (value, block id) per
(sequence, key head, split, row); a block id appears in one split only. Ways to merge them:

- "serial": one program per row over every split's candidates, K passes of a max and a min
  reduction (the value, then the lowest id among its ties). At batch 1 on the H200 there are 264
  splits: 4 programs each reduce 512·16 candidates 16 times, 23.4 µs per layer (git 7e40e27).
- "packed": the same single launch over keys that pack (value, id) into one int64 ordered as the
  selection is (value desc, then id asc): one max reduction per pass, no tie pass.
- "tree": two launches over packed keys. Level 1: a program per (row, group of GS splits) keeps its
  group's top-K; level 2: a program per row merges the groups' lists. GS ≈ √splits, so each
  program's passes run over ~√splits·K keys instead of splits·K.

The grids depend only on (batch, key heads, splits, rows) — shapes — so CUDA graphs capture them,
and the tree's workspace is sized by the same shapes.
"""

import math
from typing import Literal

import torch
import triton
import triton.language as tl

from msaserve.kernels.triton_common import EMPTY_ID_BASE, INTERPRET, check, pow2, sorted_selection

SplitMerge = Literal["serial", "packed", "tree", "auto"]
SPLIT_MERGES: tuple[SplitMerge, ...] = ("serial", "packed", "tree", "auto")
# "auto", from the H200 table (benchmarks/results/decode_merges.json, git 272ed63, µs as CUDA graphs,
# serial / packed / tree): 256 splits (batch 1, 128K) 19.3 / 13.2 / 11.4, (1M) 19.6 / 18.9 / 18.8;
# 32–33 splits (batch 8) 11.2 / 16.6 / 19.1 and 16.4 / 16.6 / 16.6; 9 splits (batch 32) 18.6 / 13.1 /
# 13.7 and 17.1 / 16.5 / 17.4. So the tree from TREE_MIN_SPLITS splits, the old serial launch from
# PACKED_MAX_SPLITS + 1 below that, the packed launch for the fewest.
TREE_MIN_SPLITS = 128
PACKED_MAX_SPLITS = 16

# Below every packed key of a real candidate: the lowest, -FLT_MAX's, is -2139095040 · 2³² + …
EMPTY_KEY = tl.constexpr(-(1 << 63) + 1)

# ---------------------------------------------------------------- heuristics


def _group_size(splits: int) -> int:
    """Splits per level-1 program: the power of two at or above √splits (264 → 32, 33 → 8)."""
    return pow2(math.isqrt(max(0, splits - 1)) + 1)


def _warps(keys_per_program: int) -> int:
    """About 16 keys per thread: a pass is then one in-thread max and one warp reduction (no barrier
    up to 512 keys)."""
    return max(1, min(8, keys_per_program // 512))


# ---------------------------------------------------------------- jit kernels


@triton.jit
def _pack_keys(vals, ids):
    """(value fp32, id int32) → int64 keys whose order is the selection's: a larger value first, then
    a lower id. Empty slots (id ≥ EMPTY_ID_BASE) and -inf values become EMPTY_KEY, never chosen."""
    bits = vals.to(tl.int32, bitcast=True)
    bits = tl.where((bits & 0x7FFFFFFF) == 0, 0, bits)  # -0.0 ranks as +0.0: they compare equal
    order = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # int32 order = float order
    keys = (order.to(tl.int64) << 32) | (0x7FFFFFFF - ids).to(tl.int64)
    real = (ids < EMPTY_ID_BASE) & (vals > float("-inf"))
    return tl.where(real, keys, EMPTY_KEY)


@triton.jit
def _unpack_ids(keys):
    """Packed keys → block ids; EMPTY_KEY → EMPTY_ID_BASE."""
    ids = 0x7FFFFFFF - (keys & 0x7FFFFFFF).to(tl.int32)
    return tl.where(keys == EMPTY_KEY, EMPTY_ID_BASE, ids)


@triton.jit
def _top_keys(keys, RB: tl.constexpr, KP: tl.constexpr, TOP_K: tl.constexpr):
    """keys [RB, N] (distinct per row, but for EMPTY_KEY) → the TOP_K largest per row [RB, KP],
    descending, EMPTY_KEY past them."""
    offs_k = tl.arange(0, KP)
    chosen = tl.full([RB, KP], EMPTY_KEY, tl.int64)
    for k in tl.static_range(TOP_K):
        best = tl.max(keys, axis=1)  # [RB]
        chosen = tl.where(offs_k[None, :] == k, best[:, None], chosen)
        keys = tl.where(keys == best[:, None], EMPTY_KEY, keys)
    return chosen


@triton.jit
def _merge_keys_kernel(
    cand_val_ptr, cand_id_ptr, key_in_ptr, key_out_ptr, out_ptr, num_lists, lists_per_program,
    stride_ob, stride_oq, stride_oh,
    HKI: tl.constexpr, HPK: tl.constexpr, NUM_ROWS: tl.constexpr, NR: tl.constexpr, KP: tl.constexpr,
    LP: tl.constexpr, TOP_K: tl.constexpr, RB: tl.constexpr, PACKED_IN: tl.constexpr, FINAL: tl.constexpr,
):
    """RB rows of one (sequence, key head) over `lists_per_program` of its num_lists candidate lists
    (lists laid out [B·HkI, num_lists, NR, KP]): raw (value, id) splits unless PACKED_IN, else the
    level-1 keys. FINAL stores the selection; otherwise the top-K keys go to key_out
    [B·HkI, programs along axis 1, NR, KP]."""
    bh = tl.program_id(0)  # sequence · HkI + key head
    part = tl.program_id(1)
    rows = tl.program_id(2) * RB + tl.arange(0, RB)
    row_ok = rows < NUM_ROWS
    offs_c = tl.arange(0, LP * KP)  # candidate = list-in-program · KP + slot
    in_program = offs_c // KP
    lst = part * lists_per_program + in_program
    ok = row_ok[:, None] & ((in_program < lists_per_program) & (lst < num_lists))[None, :]
    offs = ((bh * num_lists + lst)[None, :] * NR + rows[:, None]) * KP + (offs_c % KP)[None, :]
    if PACKED_IN:
        keys = tl.load(key_in_ptr + offs, mask=ok, other=EMPTY_KEY)
    else:
        vals = tl.load(cand_val_ptr + offs, mask=ok, other=float("-inf"))
        ids = tl.load(cand_id_ptr + offs, mask=ok, other=EMPTY_ID_BASE)
        keys = _pack_keys(vals, ids)
    chosen = _top_keys(keys, RB, KP, TOP_K)  # [RB, KP]
    offs_k = tl.arange(0, KP)
    if FINAL:
        selected = sorted_selection(_unpack_ids(chosen), EMPTY_ID_BASE)
        b = bh // HKI
        h = (bh % HKI) * HPK + rows % HPK
        ptrs = out_ptr + b * stride_ob + (rows // HPK)[:, None] * stride_oq + h[:, None] * stride_oh
        tl.store(ptrs + offs_k[None, :], selected, mask=row_ok[:, None] & (offs_k[None, :] < TOP_K))
    else:
        dst = ((bh * tl.num_programs(1) + part) * NR + rows[:, None]) * KP + offs_k[None, :]
        tl.store(key_out_ptr + dst, chosen, mask=row_ok[:, None])


@triton.jit
def _merge_splits_kernel(
    cand_val_ptr, cand_id_ptr, out_ptr, num_splits,
    stride_ob, stride_oq, stride_oh,
    HPK: tl.constexpr, NUM_ROWS: tl.constexpr, NR: tl.constexpr, KP: tl.constexpr, SP: tl.constexpr,
    TOP_K: tl.constexpr, RB: tl.constexpr,
):
    """"serial": RB rows of one (sequence, key head): top-K over the splits' candidates, value desc
    then id asc."""
    b = tl.program_id(0)
    hk = tl.program_id(1)
    rows = tl.program_id(2) * RB + tl.arange(0, RB)
    row_ok = rows < NUM_ROWS
    offs_c = tl.arange(0, SP * KP)  # candidate = split · KP + slot
    split = offs_c // KP
    base = ((b * tl.num_programs(1) + hk) * num_splits) * NR * KP
    offs = base + split[None, :] * (NR * KP) + rows[:, None] * KP + (offs_c % KP)[None, :]
    ok = row_ok[:, None] & (split[None, :] < num_splits)
    vals = tl.load(cand_val_ptr + offs, mask=ok, other=float("-inf"))  # [RB, SP·KP]
    ids = tl.load(cand_id_ptr + offs, mask=ok, other=EMPTY_ID_BASE)
    real = ids < EMPTY_ID_BASE
    vals = tl.where(real, vals, float("-inf"))
    offs_k = tl.arange(0, KP)
    chosen = tl.full([RB, KP], EMPTY_ID_BASE, tl.int32)
    for k in range(TOP_K):
        best = tl.max(vals, axis=1)  # [RB]
        tied = (vals == best[:, None]) & real
        best_id = tl.min(tl.where(tied, ids, EMPTY_ID_BASE), axis=1)
        best_id = tl.where(best == float("-inf"), EMPTY_ID_BASE, best_id)
        chosen = tl.where(offs_k[None, :] == k, best_id[:, None], chosen)
        taken = ids == best_id[:, None]
        vals = tl.where(taken, float("-inf"), vals)
        real = real & ~taken
    chosen = sorted_selection(chosen, EMPTY_ID_BASE)  # [RB, KP]
    q_i = rows // HPK
    h = hk * HPK + rows % HPK
    ptrs = out_ptr + b * stride_ob + q_i[:, None] * stride_oq + h[:, None] * stride_oh + offs_k[None, :]
    tl.store(ptrs, chosen, mask=row_ok[:, None] & (offs_k[None, :] < TOP_K))


# ---------------------------------------------------------------- launcher


def _launch_keys(cand_val, cand_id, key_in, key_out, out, num_lists, lists_per_program, programs,
                 num_rows, heads_per_key, top_k, packed_in, final) -> None:
    batch, key_heads, _, nr, kp = cand_val.shape
    rows_per_program = nr if INTERPRET else 1  # all rows at once under the interpreter (per-program cost)
    lp = pow2(lists_per_program)
    _merge_keys_kernel[(batch * key_heads, programs, triton.cdiv(num_rows, rows_per_program))](
        cand_val, cand_id, key_in, key_out, out, num_lists, lists_per_program,
        out.stride(0), out.stride(1), out.stride(2),
        HKI=key_heads, HPK=heads_per_key, NUM_ROWS=num_rows, NR=nr, KP=kp, LP=lp, TOP_K=top_k,
        RB=rows_per_program, PACKED_IN=packed_in, FINAL=final,
        num_warps=_warps(rows_per_program * lp * kp),
    )


def merge_splits(cand_val: torch.Tensor, cand_id: torch.Tensor, out: torch.Tensor, heads_per_key: int,
                 method: SplitMerge = "auto") -> None:
    """cand_val [B, HkI, splits, NR, KP] fp32 and cand_id (same shape, int32; ids ≥ EMPTY_ID_BASE are
    empty slots) → out [B, Q, HkI·heads_per_key, top_k] int32: each row's top_k block ids by value desc
    then id asc, stored ascending, -1 pad. Row r of NR is query r // heads_per_key, head r % heads_per_key
    of its key head; rows ≥ Q·heads_per_key are padding and ignored."""
    check(method in SPLIT_MERGES, f"split_merge is {method!r}; allowed {', '.join(SPLIT_MERGES)}")
    batch, key_heads, splits, nr, kp = cand_val.shape
    num_q, top_k = out.shape[1], out.shape[3]
    num_rows = num_q * heads_per_key
    if method == "auto":
        method = ("tree" if splits >= TREE_MIN_SPLITS else "packed" if splits <= PACKED_MAX_SPLITS
                  else "serial")
    if method == "serial":
        rows_per_program = nr if INTERPRET else 1
        _merge_splits_kernel[(batch, key_heads, triton.cdiv(num_rows, rows_per_program))](
            cand_val, cand_id, out, splits, out.stride(0), out.stride(1), out.stride(2),
            HPK=heads_per_key, NUM_ROWS=num_rows, NR=nr, KP=kp, SP=pow2(splits), TOP_K=top_k,
            RB=rows_per_program,
        )
        return
    common = (num_rows, heads_per_key, top_k)
    if method == "packed":
        _launch_keys(cand_val, cand_id, cand_val, cand_val, out, splits, splits, 1, *common,
                     packed_in=False, final=True)
        return
    per_group = _group_size(splits)
    groups = triton.cdiv(splits, per_group)
    keys = torch.empty((batch, key_heads, groups, nr, kp), device=cand_val.device, dtype=torch.int64)
    _launch_keys(cand_val, cand_id, keys, keys, out, splits, per_group, groups, *common,
                 packed_in=False, final=False)
    _launch_keys(keys, keys, keys, keys, out, groups, groups, 1, *common, packed_in=True, final=True)
