"""Pieces shared by the MSA Triton kernels: interpreter detection, the streaming top-K insert, the
LSE merge of partial attention outputs, and small launcher checks.

Under `TRITON_INTERPRET=1` (CPU tests) kernels run on torch CPU tensors; the interpreter computes
bf16 `tl.dot` wrongly, so every kernel upcasts its dot operands to fp32 when `INTERPRET` is set,
and autotuning is reduced to one config (the interpreter cost is per program instance).
"""

import os
from typing import Literal

import torch
import triton
import triton.language as tl

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Ids of empty top-K slots: above every real block id, distinct per slot so eviction is exact.
EMPTY_ID_BASE = tl.constexpr(1 << 29)


def configs(options: list[dict], warps_stages: list[tuple[int, int]]) -> list[triton.Config]:
    """Autotune configs; the interpreter gets the first one only."""
    out = [triton.Config(dict(opt), num_warps=w, num_stages=s) for opt in options for w, s in warps_stages]
    return out[:1] if INTERPRET else out


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


def check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def check_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    check(
        tuple(tensor.shape) == tuple(shape),
        f"{name} has shape {tuple(tensor.shape)}, expected {tuple(shape)}",
    )


def check_last_contiguous(**tensors: torch.Tensor) -> None:
    for name, tensor in tensors.items():
        check(tensor.stride(-1) == 1, f"{name} needs a contiguous last dim, got strides {tensor.stride()}")


def pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, triton.next_power_of_2(max(1, n)))


@triton.jit
def topk_insert(vals, ids, score, block_id, valid):
    """Insert one block's score into a running top-K per row.

    vals, ids: [M, KP] (fp32, int32); score: [M] fp32; block_id: scalar; valid: [M] bool.
    Blocks arrive in ascending id, so a tie with the current worst entry keeps the old (lower) id:
    the new block enters only if it is strictly better. The worst entry is the lowest value and,
    among equal values, the highest id (empty slots are -inf with ids above every block).
    """
    worst = tl.min(vals, axis=1)  # [M]
    is_worst = vals == worst[:, None]
    worst_id = tl.max(tl.where(is_worst, ids, -1), axis=1)
    take = valid & (score > worst)
    slot = is_worst & (ids == worst_id[:, None]) & take[:, None]
    vals = tl.where(slot, score[:, None], vals)
    ids = tl.where(slot, block_id, ids)
    return vals, ids


@triton.jit
def sorted_selection(ids, EMPTY: tl.constexpr):
    """ids: [M, KP] block ids with empty slots ≥ EMPTY → ascending ids, empty slots -1 at the end."""
    ids = tl.sort(ids, dim=1)
    return tl.where(ids >= EMPTY, -1, ids)


@triton.jit
def _lse_merge_kernel(
    part_o, part_lse, valid_ptr, out, num_rows,
    stride_po_row, stride_po_part, stride_pl_row, stride_pl_part, stride_v_row, stride_v_part,
    stride_out_row, heads_per_row, stride_out_head,
    NUM_PARTS: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    ROWS: tl.constexpr,
):
    """out[row, g] = Σ_k 2^(lse_k − lse) · o_k over the valid partials k of ROWS rows (lse in log2 units).

    part_o: [R, NUM_PARTS, G, D]; part_lse: [R, NUM_PARTS, G]; valid: [R, NUM_PARTS] int32 (≥ 0 valid).
    A row maps to output head block (row % heads_per_row) · G of output row row // heads_per_row.
    """
    flat = tl.arange(0, ROWS * GP)  # (row-in-program, head-in-group)
    # int64: a 32K-token chunk at the M3 shape has 2^32 partial elements, past int32 offsets.
    row = tl.program_id(0).to(tl.int64) * ROWS + flat // GP
    g = flat % GP
    row_ok = (row < num_rows) & (g < G)
    offs_d = tl.arange(0, DP)
    mask_d = offs_d[None, :] < D
    m = tl.full([ROWS * GP], float("-inf"), tl.float32)
    denom = tl.zeros([ROWS * GP], tl.float32)
    acc = tl.zeros([ROWS * GP, DP], tl.float32)
    for k in range(NUM_PARTS):
        chosen = tl.load(valid_ptr + row * stride_v_row + k * stride_v_part, mask=row_ok, other=-1)
        ok = row_ok & (chosen >= 0)
        lse = tl.load(part_lse + row * stride_pl_row + k * stride_pl_part + g, mask=ok, other=float("-inf"))
        o = tl.load(part_o + row[:, None] * stride_po_row + k * stride_po_part + g[:, None] * D
                    + offs_d[None, :], mask=ok[:, None] & mask_d, other=0.0).to(tl.float32)
        m_new = tl.maximum(m, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        beta = tl.exp2(lse - m_safe)
        acc = acc * alpha[:, None] + o * beta[:, None]
        denom = denom * alpha + beta
        m = m_new
    result = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    out_row = row // heads_per_row
    head = (row % heads_per_row) * G + g
    ptrs = out + out_row[:, None] * stride_out_row + head[:, None] * stride_out_head + offs_d[None, :]
    tl.store(ptrs, result.to(out.dtype.element_ty), mask=row_ok[:, None] & mask_d)


@triton.jit
def _lse_merge_parts_kernel(
    part_o, part_lse, valid_ptr, out,
    stride_po_row, stride_po_part, stride_pl_row, stride_pl_part, stride_v_row, stride_v_part,
    stride_out_row, heads_per_row, stride_out_head,
    NUM_PARTS: tl.constexpr, NP: tl.constexpr, G: tl.constexpr, GB: tl.constexpr, D: tl.constexpr,
    DB: tl.constexpr, ALL_VALID: tl.constexpr,
):
    """The same merge for GB heads × DB dims of one row, every partial loaded at once: one round of
    loads and a vectorised max / weights / sum over the parts instead of a dependent round per part.
    For decode, whose few rows leave most SMs idle under `_lse_merge_kernel`. ALL_VALID: no valid
    tensor, every part counts."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GB + tl.arange(0, GB)
    d = tl.program_id(2) * DB + tl.arange(0, DB)
    k = tl.arange(0, NP)
    ok_k = k < NUM_PARTS
    if not ALL_VALID:
        ok_k = ok_k & (tl.load(valid_ptr + row * stride_v_row + k * stride_v_part, mask=ok_k, other=-1) >= 0)
    ok_g = g < G
    ok_d = d < D
    lse = tl.load(part_lse + row * stride_pl_row + k[:, None] * stride_pl_part + g[None, :],
                  mask=ok_k[:, None] & ok_g[None, :], other=float("-inf"))  # [NP, GB]
    o = tl.load(part_o + row * stride_po_row + k[:, None, None] * stride_po_part + g[None, :, None] * D
                + d[None, None, :], mask=(ok_k[:, None] & ok_g[None, :])[:, :, None] & ok_d[None, None, :],
                other=0.0).to(tl.float32)  # [NP, GB, DB]
    m = tl.max(lse, axis=0)  # [GB]
    weight = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m)[None, :])  # [NP, GB]; 0 where skipped
    denom = tl.sum(weight, axis=0)
    result = tl.sum(o * weight[:, :, None], axis=0) / tl.where(denom > 0, denom, 1.0)[:, None]  # [GB, DB]
    out_row = row // heads_per_row
    head = (row % heads_per_row) * G + g
    ptrs = out + out_row * stride_out_row + head[:, None] * stride_out_head + d[None, :]
    tl.store(ptrs, result.to(out.dtype.element_ty), mask=ok_g[:, None] & ok_d[None, :])


# Bulk merges (a prefill chunk's partials: GBs) pick their tile and pipelining by autotuning;
# small ones (decode) keep the fixed launches below, cheap to capture in a CUDA graph.
_MERGE_TILES = [(rows, w, s) for rows in (2, 4, 8) for w, s in ((4, 2), (4, 3), (8, 2), (8, 3))]
_lse_merge_tuned = triton.autotune(
    configs=[triton.Config({"ROWS": rows}, num_warps=w, num_stages=s) for rows, w, s in _MERGE_TILES],
    key=["NUM_PARTS", "G", "D"],
)(_lse_merge_kernel)
TUNED_MERGE_MIN_ROWS = 1 << 16
"""Partial rows from which a merge is autotuned (a 16K-token chunk at the M3 shape has 65,536)."""
PARTS_MERGE_MAX_PARTIALS = 1 << 14
"""Rows × parts up to which "auto" loads all of a row's parts at once, if it has at most
PARTS_MERGE_MAX_PARTS: every decode merge (their splits fill two to four waves of CTAs, rows × parts
≤ 4 · 132 on the H200) and prefill chunks up to a few hundred tokens."""
PARTS_MERGE_MAX_PARTS = 256
_PARTS_TILE = (1 << 14) if INTERPRET else 2048  # elements per program (16 fp32 per thread at 4 warps)
LseMerge = Literal["serial", "parts", "auto"]


def _parts_tile(parts: int, group_p2: int, dim_p2: int) -> tuple[int, int, int]:
    """(NP, GB, DB) of the all-parts launch: all parts, D in runs of ≤ 64 (coalesced), heads to fill
    _PARTS_TILE; many small programs, since a decode merge is latency-bound."""
    parts_p2 = pow2(parts)
    dim_block = min(dim_p2, 64 if parts_p2 * 64 <= _PARTS_TILE else max(16, _PARTS_TILE // parts_p2))
    heads_block = max(1, min(group_p2, _PARTS_TILE // (parts_p2 * dim_block)))
    return parts_p2, heads_block, dim_block


def lse_merge(
    part_o: torch.Tensor, part_lse: torch.Tensor, valid: torch.Tensor | None, out: torch.Tensor,
    method: LseMerge = "auto",
) -> None:
    """Merge partials into `out`.

    part_o: [R, N, G, D] contiguous; part_lse: [R, N, G] fp32; valid: [R, N] int32 (< 0 = skip) or None
    (every part counts); out: [R // H, H * G, D] viewed by rows, H = R / out.shape[0] heads-groups per
    output row. method: "serial" (`_lse_merge_kernel`, a round of loads per part), "parts" (all parts at
    once) or "auto": parts for small merges (decode), serial otherwise, autotuned when bulk.
    """
    check(method in ("serial", "parts", "auto"), f"method is {method!r}; allowed serial, parts, auto")
    rows, parts, group, head_dim = part_o.shape
    heads_per_row = rows // out.shape[0]
    group_p2 = pow2(group)
    if method == "auto":
        small = rows * parts <= PARTS_MERGE_MAX_PARTIALS and parts <= PARTS_MERGE_MAX_PARTS
        method = "parts" if small else "serial"
    valid_strides = (valid.stride(0), valid.stride(1)) if valid is not None else (0, 0)
    if method == "parts":
        parts_p2, heads_block, dim_block = _parts_tile(parts, group_p2, pow2(head_dim))
        grid = (rows, triton.cdiv(group, heads_block), triton.cdiv(head_dim, dim_block))
        _lse_merge_parts_kernel[grid](
            part_o, part_lse, valid if valid is not None else part_lse, out,
            part_o.stride(0), part_o.stride(1), part_lse.stride(0), part_lse.stride(1), *valid_strides,
            out.stride(0), heads_per_row, out.stride(1),
            NUM_PARTS=parts, NP=parts_p2, G=group, GB=heads_block, D=head_dim, DB=dim_block,
            ALL_VALID=valid is None, num_warps=4,
        )
        return
    if valid is None:
        valid = torch.zeros((rows, parts), device=part_o.device, dtype=torch.int32)
    args = (part_o, part_lse, valid, out, rows,
            part_o.stride(0), part_o.stride(1), part_lse.stride(0), part_lse.stride(1),
            valid.stride(0), valid.stride(1), out.stride(0), heads_per_row, out.stride(1))
    shape = dict(NUM_PARTS=parts, G=group, GP=group_p2, D=head_dim, DP=pow2(head_dim))
    if not INTERPRET and rows >= TUNED_MERGE_MIN_ROWS and group_p2 <= 16:
        _lse_merge_tuned[lambda meta: (triton.cdiv(rows, meta["ROWS"]),)](*args, **shape)
        return
    rows_per_program = max(1, (2048 if INTERPRET else 64) // group_p2)
    _lse_merge_kernel[(triton.cdiv(rows, rows_per_program),)](
        *args, **shape, ROWS=rows_per_program, num_warps=4,
    )
