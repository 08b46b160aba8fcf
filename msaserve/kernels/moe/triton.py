"""The elementwise steps of the grouped MoE path (`moe/grouped.py`) as one Triton kernel each.

Why: around the two grouped GEMMs, the PyTorch steps of routing (sigmoid, bias add, top-k,
gather, sum, divide), of the clamped SwiGLU (chunk, two clamps, sigmoid, three products) and of
the weighted un-permute (gather, cast, product, sum) are about fifteen small launches and three
[T·k, ·] temporaries per MoE layer. Each kernel here reads its input once, computes in fp32 and
rounds once; none reads a count or an offset on the host, so a decode step can be captured in a
CUDA graph. They are checked against `moe/naive.py` (the spec) in tests/kernels/test_kernels_moe*.py.
"""

import torch
import triton
import triton.language as tl

from msaserve.kernels.triton_common import check, check_last_contiguous, pow2

# ---------------------------------------------------------------- jit kernels


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, stride_l, num_experts,
    HAS_BIAS: tl.constexpr, TOP_K: tl.constexpr, KP: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """One token: s = sigmoid(logits); choose the top_k of s + bias (ties to the lower expert id);
    weights = s of the chosen, renormalised to sum 1. Writes ids [TOP_K] in descending score."""
    row = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < num_experts
    logits = tl.load(logits_ptr + row * stride_l + experts, mask=valid, other=0.0).to(tl.float32)
    scores = tl.sigmoid(logits)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + experts, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, float("-inf"))
    slots = tl.arange(0, KP)
    chosen_ids = tl.zeros([KP], dtype=tl.int64)
    chosen_weights = tl.zeros([KP], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(choice, axis=0)
        best_id = tl.min(tl.where(choice == best, experts, BLOCK_E), axis=0)
        weight = tl.sum(tl.where(experts == best_id, scores, 0.0), axis=0)
        chosen_ids = tl.where(slots == j, best_id.to(tl.int64), chosen_ids)
        chosen_weights = tl.where(slots == j, weight, chosen_weights)
        choice = tl.where(experts == best_id, float("-inf"), choice)
    total = tl.sum(chosen_weights, axis=0)  # unused slots hold 0
    keep = slots < TOP_K
    tl.store(ids_ptr + row * TOP_K + slots, chosen_ids, mask=keep)
    tl.store(weights_ptr + row * TOP_K + slots, chosen_weights / total, mask=keep)


@triton.jit
def _clamped_swiglu_kernel(
    gate_up_ptr, out_ptr, stride_g, stride_o, n_cols, alpha, limit, BLOCK: tl.constexpr,
    ROUND_STEPS: tl.constexpr,
):
    """BLOCK columns of one row of gate_up [rows, 2I]: gate, up = halves; gate ≤ limit,
    |up| ≤ limit; out = (up + 1) · gate · sigmoid(alpha · gate), rounded once, or (ROUND_STEPS)
    rounded to the input dtype after each step as the spec's PyTorch ops are."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(gate_up_ptr + row * stride_g + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_g + n_cols + cols, mask=mask, other=0.0)
    dtype = gate.dtype
    gate = tl.minimum(gate.to(tl.float32), limit)
    up = tl.minimum(tl.maximum(up.to(tl.float32), -limit), limit)
    if ROUND_STEPS:  # clamps are exact; (up + 1), alpha · gate, sigmoid and both products round
        shifted = (up + 1.0).to(dtype).to(tl.float32)
        gated = tl.sigmoid((alpha * gate).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        out = shifted * (gate * gated).to(dtype).to(tl.float32)
    else:
        out = (up + 1.0) * gate * tl.sigmoid(alpha * gate)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _combine_kernel(
    rows_ptr, row_of_slot_ptr, weights_ptr, out_ptr, stride_r, stride_o, n_cols,
    TOP_K: tl.constexpr, BLOCK: tl.constexpr,
):
    """BLOCK columns of one token: out = Σ_j weights[t, j] · rows[row_of_slot[t·k + j]] in fp32."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(row_of_slot_ptr + token * TOP_K + j).to(tl.int64)
        weight = tl.load(weights_ptr + token * TOP_K + j).to(tl.float32)
        acc += weight * tl.load(rows_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _decode_gate_up_kernel(
    x_ptr, gate_up_ptr, ids_ptr, hidden_ptr, stride_x, stride_ge, stride_gr, hidden_size, inter,
    alpha, limit, TOP_K: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Slot s = t·k + j, BLOCK_I columns of its hidden row: gate and up = rows of gate_up[ids[s]] · x[t]
    (fp32 sums over H, rounded to x's dtype as a GEMM's output would be), then the clamped SwiGLU."""
    slot = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    col_mask = cols < inter
    token = slot // TOP_K
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    gate_rows = gate_up_ptr + expert * stride_ge + cols[:, None].to(tl.int64) * stride_gr
    up_rows = gate_rows + inter * stride_gr
    acc_gate = tl.zeros([BLOCK_I], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_I], dtype=tl.float32)
    for start in range(0, hidden_size, BLOCK_H):
        h = start + tl.arange(0, BLOCK_H)
        h_mask = h < hidden_size
        xv = tl.load(x_ptr + token * stride_x + h, mask=h_mask, other=0.0).to(tl.float32)
        mask = col_mask[:, None] & h_mask[None, :]
        w_gate = tl.load(gate_rows + h[None, :], mask=mask, other=0.0).to(tl.float32)
        w_up = tl.load(up_rows + h[None, :], mask=mask, other=0.0).to(tl.float32)
        acc_gate += tl.sum(w_gate * xv[None, :], axis=1)
        acc_up += tl.sum(w_up * xv[None, :], axis=1)
    dtype = hidden_ptr.dtype.element_ty
    gate = tl.minimum(acc_gate.to(dtype).to(tl.float32), limit)
    up = tl.minimum(tl.maximum(acc_up.to(dtype).to(tl.float32), -limit), limit)
    out = (up + 1.0) * gate * tl.sigmoid(alpha * gate)
    tl.store(hidden_ptr + slot * inter + cols, out.to(dtype), mask=col_mask)


@triton.jit
def _decode_down_kernel(
    hidden_ptr, down_ptr, ids_ptr, weights_ptr, out_ptr, stride_de, stride_dr, stride_o, hidden_size,
    inter, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr,
):
    """Token t, BLOCK_N output columns: Σ_j weights[t, j] · (down[ids[t, j]] · hidden[t·k + j]), each
    expert's row rounded to the output dtype (as the grouped GEMM's rows are) and summed in fp32."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < hidden_size
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        slot = token * TOP_K + j
        expert = tl.load(ids_ptr + slot).to(tl.int64)
        weight = tl.load(weights_ptr + slot).to(tl.float32)
        rows = down_ptr + expert * stride_de + cols[:, None].to(tl.int64) * stride_dr
        part = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, inter, BLOCK_I):
            i = start + tl.arange(0, BLOCK_I)
            i_mask = i < inter
            hv = tl.load(hidden_ptr + slot * inter + i, mask=i_mask, other=0.0).to(tl.float32)
            w = tl.load(rows + i[None, :], mask=col_mask[:, None] & i_mask[None, :], other=0.0).to(tl.float32)
            part += tl.sum(w * hv[None, :], axis=1)
        acc += weight * part.to(dtype).to(tl.float32)
    tl.store(out_ptr + token * stride_o + cols, acc.to(dtype), mask=col_mask)


# ---------------------------------------------------------------- public functions


def route(
    router_logits: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] → (weights [T, top_k] fp32, ids [T, top_k] int64), ids in descending
    biased score. Same contract as `moe/naive.py::route`."""
    tokens, num_experts = router_logits.shape
    check_last_contiguous(router_logits=router_logits)
    weights = torch.empty((tokens, top_k), device=router_logits.device, dtype=torch.float32)
    ids = torch.empty((tokens, top_k), device=router_logits.device, dtype=torch.int64)
    if tokens == 0:
        return weights, ids
    if correction_bias is not None:
        check(correction_bias.shape == (num_experts,) and correction_bias.stride(0) == 1,
              f"correction_bias has shape {tuple(correction_bias.shape)}, "
              f"expected contiguous [{num_experts}]")
    block = pow2(num_experts)
    _route_kernel[(tokens,)](
        router_logits, correction_bias if correction_bias is not None else router_logits, weights, ids,
        router_logits.stride(0), num_experts, HAS_BIAS=correction_bias is not None,
        TOP_K=top_k, KP=pow2(top_k), BLOCK_E=block, num_warps=max(1, min(8, block // 128)),
    )
    return weights, ids


def clamped_swiglu(gate_up: torch.Tensor, swiglu_alpha: float, swiglu_limit: float,
                   round_steps: bool = False) -> torch.Tensor:
    """gate_up [rows, 2I] → [rows, I]: (clamp(up, ±limit) + 1) · g · sigmoid(alpha · g),
    g = min(gate, limit); gate and up are the first and second halves of each row. round_steps:
    round after each step as `naive.clamped_swiglu` does in the input dtype (M3's dense MLP and
    shared expert, which run that spec off the GPU); else in fp32, rounded once (the grouped path)."""
    rows, two_inter = gate_up.shape
    check(two_inter % 2 == 0, f"gate_up's last dim must be even (gate, up halves), got {two_inter}")
    check_last_contiguous(gate_up=gate_up)
    inter = two_inter // 2
    out = torch.empty((rows, inter), device=gate_up.device, dtype=gate_up.dtype)
    if rows == 0:
        return out
    block = min(1024, pow2(inter))
    _clamped_swiglu_kernel[(rows, triton.cdiv(inter, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), inter, float(swiglu_alpha), float(swiglu_limit),
        BLOCK=block, ROUND_STEPS=round_steps, num_warps=4,
    )
    return out


def combine(
    rows: torch.Tensor, row_of_slot: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """rows [T·k, H] (expert outputs in expert order), row_of_slot [T·k] (the row holding slot
    t·k + j), weights [T, k] → [T, H] = Σ_j weights[t, j] · rows[row_of_slot[t·k + j]]."""
    tokens, top_k = weights.shape
    width = rows.shape[1]
    check(row_of_slot.shape == (tokens * top_k,), f"row_of_slot has shape {tuple(row_of_slot.shape)}, "
          f"expected [{tokens * top_k}]")
    check_last_contiguous(rows=rows)
    weights = weights.contiguous()
    out = torch.empty((tokens, width), device=rows.device, dtype=out_dtype)
    if tokens == 0:
        return out
    block = min(1024, pow2(width))
    _combine_kernel[(tokens, triton.cdiv(width, block))](
        rows, row_of_slot, weights, out, rows.stride(0), out.stride(0), width,
        TOP_K=top_k, BLOCK=block, num_warps=4,
    )
    return out


DECODE_BLOCKS = (16, 512)
"""(rows, reduction width) of a decode program's weight tile: 16 rows × 512 columns of bf16, 16 KiB."""


def decode_experts(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
    swiglu_alpha: float, swiglu_limit: float,
) -> torch.Tensor:
    """The experts of a few tokens (decode) as two weight-streaming launches: `grouped.experts`'
    contract and arithmetic (GEMM outputs rounded to x's dtype, the weighted sum in fp32), with no
    sort, gather or grouped GEMM. Each (token, expert) slot reads its expert's weights once, so a
    slot count near the expert count reads weights twice where the grouped GEMM reads them once:
    for T·k small against E (`grouped.DECODE_MAX_SLOTS`)."""
    tokens, hidden_size = x.shape
    top_k = ids.shape[1]
    inter = down.shape[2]
    check_last_contiguous(x=x)
    ids, weights = ids.contiguous(), weights.contiguous()
    hidden = torch.empty((tokens * top_k, inter), device=x.device, dtype=x.dtype)
    out = torch.empty_like(x)
    rows, width = DECODE_BLOCKS
    _decode_gate_up_kernel[(tokens * top_k, triton.cdiv(inter, rows))](
        x, gate_up, ids, hidden, x.stride(0), gate_up.stride(0), gate_up.stride(1), hidden_size, inter,
        float(swiglu_alpha), float(swiglu_limit), TOP_K=top_k, BLOCK_I=rows, BLOCK_H=width, num_warps=4,
    )
    _decode_down_kernel[(tokens, triton.cdiv(hidden_size, rows))](
        hidden, down, ids, weights, out, down.stride(0), down.stride(1), out.stride(0), hidden_size, inter,
        TOP_K=top_k, BLOCK_N=rows, BLOCK_I=width, num_warps=4,
    )
    return out
