"""The MoE fast path: routing, permutation, two grouped GEMMs and the weighted un-permute, with no
Python loop over experts and no host synchronisation (a decode step is CUDA-graph capturable).

Same contract as the spec `moe/naive.py` (the per-expert loop):
`route(router_logits [T, E], correction_bias [E] | None, top_k)` → (weights [T, k] fp32, ids [T, k] int64);
`experts(x [T, H], gate_up [E, 2I, H], down [E, H, I], ids, weights, swiglu_alpha, swiglu_limit)` → [T, H].

How `experts` works (one pass per layer, every shape fixed by T, k, E, H, I):
1. sort the T·k (token, expert) slots by expert id (stable) → rows in expert order; each expert's
   rows end at `searchsorted(sorted ids, e, right)`: offsets computed on the device, never read;
2. gather x into that order: rows [T·k, H];
3. one grouped GEMM against gate_up (`torch._grouped_mm`: CUTLASS on sm90 in bf16; experts that got
   no rows cost nothing), the clamped SwiGLU, one grouped GEMM against down;
4. un-permute and combine: out[t] = Σ_j weights[t, j] · rows[row of slot (t, j)], summed in fp32.
On CUDA, up to `DECODE_MAX_SLOTS` (token, expert) slots (batch-1 decode) skip steps 1-4: two
Triton launches stream each slot's expert weights once (`moe/triton.py::decode_experts`).
On CUDA steps 1-4's elementwise work runs as the Triton kernels of `moe/triton.py`; elsewhere
(CPU tests) as the same arithmetic in PyTorch ops. Where `torch._grouped_mm` cannot take the
operands (a width whose rows are not 16-byte aligned; on CUDA any dtype but bf16), a per-expert
loop over the offsets stands in: correct, but it reads the offsets on the host, so it is neither
fast nor capturable.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from msaserve.kernels.triton_common import check

_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)

DECODE_MAX_SLOTS = 32
"""Up to this many (token, expert) slots, CUDA runs the experts as two weight-streaming launches
(`triton.decode_experts`: no sort, gather or grouped GEMM); a batch-1 decode step of M3 (top-4) has
4. Above it the grouped GEMMs, which read each expert's weights once however many slots share it.
H200, M3 widths, 128 experts (benchmarks/results/moe_decode.json, aca953a): the decode path is
1.64x the grouped path at 4, 8 and 16 slots and 1.46x at 32 (26 distinct experts); larger counts
were not measured."""


@dataclass(frozen=True)
class ExpertRows:
    """The T·k (token, expert) slots of a step laid out in expert order (slot = t·k + j).

    token_of_row: [T·k] int64, the token whose activations row r holds.
    row_of_slot: [T·k] int64, the row holding slot t·k + j (inverse of the sort).
    expert_ends: [E] int32, cumulative row counts: expert e owns rows expert_ends[e-1] .. expert_ends[e]-1.
    """

    token_of_row: torch.Tensor
    row_of_slot: torch.Tensor
    expert_ends: torch.Tensor


def expert_rows(ids: torch.Tensor, num_experts: int) -> ExpertRows:
    """ids [T, k] → the expert-ordered layout; device ops only (sort, scatter, searchsorted)."""
    top_k = ids.shape[1]
    flat = ids.reshape(-1)
    sorted_ids, slot_of_row = torch.sort(flat, stable=True)
    positions = torch.arange(flat.numel(), device=ids.device, dtype=torch.int64)
    row_of_slot = torch.empty_like(positions).scatter_(0, slot_of_row, positions)
    experts = torch.arange(num_experts, device=ids.device, dtype=sorted_ids.dtype)
    expert_ends = torch.searchsorted(sorted_ids, experts, right=True, out_int32=True)
    return ExpertRows(slot_of_row // top_k, row_of_slot, expert_ends)


def grouped_matmul(rows: torch.Tensor, weight_t: torch.Tensor, expert_ends: torch.Tensor) -> torch.Tensor:
    """rows [N, K] in expert order, weight_t [E, K, M] (a transposed view is fine) → [N, M];
    rows of expert e are multiplied by weight_t[e]."""
    if _grouped_mm_serves(rows, weight_t):
        return _GROUPED_MM(rows, weight_t, offs=expert_ends)
    out = rows.new_empty((rows.shape[0], weight_t.shape[2]))
    start = 0
    for expert, end in enumerate(expert_ends.tolist()):  # host sync: fallback only
        if end > start:
            out[start:end] = rows[start:end] @ weight_t[expert]
        start = end
    return out


def _grouped_mm_serves(rows: torch.Tensor, weight_t: torch.Tensor) -> bool:
    """torch._grouped_mm needs 16-byte aligned base pointers and row strides (CUTLASS's TMA loads)."""
    if _GROUPED_MM is None or rows.dtype != weight_t.dtype:
        return False
    if rows.is_cuda and rows.dtype != torch.bfloat16:  # CUTLASS's grouped kernel is bf16 only
        return False
    size = rows.element_size()
    widths = (rows.stride(0), weight_t.stride(2), weight_t.stride(0))  # weight_t: K contiguous
    return (
        rows.stride(1) == 1 and weight_t.stride(1) == 1
        and all(w * size % 16 == 0 for w in widths)
        and rows.data_ptr() % 16 == 0 and weight_t.data_ptr() % 16 == 0
    )


# ---------------------------------------------------------------- public ops


def route(
    router_logits: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid routing: s = sigmoid(fp32 logits); choose the top_k of s + correction_bias; weights =
    s of the chosen, renormalised to sum 1 → (weights [T, k] fp32, ids [T, k] int64)."""
    check(router_logits.dim() == 2, f"router_logits must be [T, E], got shape {tuple(router_logits.shape)}")
    num_experts = router_logits.shape[1]
    check(1 <= top_k <= num_experts, f"top_k is {top_k}, allowed 1..{num_experts} (the number of experts)")
    if router_logits.is_cuda:
        from msaserve.kernels.moe import triton as moe_triton

        return moe_triton.route(router_logits.contiguous(), correction_bias, top_k)
    scores = torch.sigmoid(router_logits.float())
    choice = scores if correction_bias is None else scores + correction_bias.float()
    ids = torch.topk(choice, top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    return weights / weights.sum(dim=-1, keepdim=True), ids


def experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    swiglu_alpha: float,
    swiglu_limit: float,
) -> torch.Tensor:
    """x [T, H] → Σ_j weights[t, j] · expert_{ids[t, j]}(x[t]), each expert the clamped SwiGLU MLP
    down[e] · ((clamp(up, ±limit) + 1) · g · sigmoid(alpha · g)), g = min(gate, limit),
    gate, up = halves of gate_up[e] · x. ids must lie in 0..E-1 (not checked: that would sync)."""
    _check_shapes(x, gate_up, down, ids, weights)
    if x.is_cuda and 0 < ids.numel() <= DECODE_MAX_SLOTS:
        from msaserve.kernels.moe import triton as moe_triton

        return moe_triton.decode_experts(x, gate_up, down, ids, weights, swiglu_alpha, swiglu_limit)
    return experts_grouped_gemm(x, gate_up, down, ids, weights, swiglu_alpha, swiglu_limit)


def experts_grouped_gemm(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    swiglu_alpha: float,
    swiglu_limit: float,
) -> torch.Tensor:
    """`experts` through steps 1-4 (sort, gather, grouped GEMMs, combine) whatever the slot count
    (the decode comparison of benchmarks/kernels/bench_moe_decode.py calls it directly)."""
    if ids.shape[0] == 0:
        return torch.empty_like(x)
    layout = expert_rows(ids, gate_up.shape[0])
    rows = x.index_select(0, layout.token_of_row)  # [T·k, H]
    gate_up_rows = grouped_matmul(rows, gate_up.transpose(1, 2), layout.expert_ends)  # [T·k, 2I]
    hidden = clamped_swiglu(gate_up_rows, swiglu_alpha, swiglu_limit)  # [T·k, I]
    out_rows = grouped_matmul(hidden, down.transpose(1, 2), layout.expert_ends)  # [T·k, H]
    return combine(out_rows, layout.row_of_slot, weights, x.dtype)


def clamped_swiglu(gate_up_rows: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gate_up_rows [N, 2I] → [N, I]: (clamp(up, ±limit) + 1) · g · sigmoid(alpha · g),
    g = min(gate, limit), gate and up the two halves of each row."""
    if gate_up_rows.is_cuda:
        from msaserve.kernels.moe import triton as moe_triton

        return moe_triton.clamped_swiglu(gate_up_rows, alpha, limit)
    gate, up = gate_up_rows.float().chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return ((up + 1.0) * gate * torch.sigmoid(alpha * gate)).to(gate_up_rows.dtype)


def combine(
    out_rows: torch.Tensor, row_of_slot: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """out_rows [T·k, H] in expert order → [T, H] = Σ_j weights[t, j] · out_rows[row_of_slot[t·k + j]]."""
    if out_rows.is_cuda:
        from msaserve.kernels.moe import triton as moe_triton

        return moe_triton.combine(out_rows, row_of_slot, weights, dtype)
    tokens, top_k = weights.shape
    gathered = out_rows.index_select(0, row_of_slot).view(tokens, top_k, -1).float()  # [T, k, H]
    return (gathered * weights.float().unsqueeze(-1)).sum(dim=1).to(dtype)


def _check_shapes(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
) -> None:
    check(x.dim() == 2, f"x must be [T, H], got shape {tuple(x.shape)}")
    tokens, hidden = x.shape
    check(gate_up.dim() == 3 and gate_up.shape[2] == hidden and gate_up.shape[1] % 2 == 0,
          f"gate_up has shape {tuple(gate_up.shape)}, expected [E, 2I, {hidden}]")
    num_experts, inter = gate_up.shape[0], gate_up.shape[1] // 2
    check(tuple(down.shape) == (num_experts, hidden, inter),
          f"down has shape {tuple(down.shape)}, expected [{num_experts}, {hidden}, {inter}]")
    check(x.dtype == gate_up.dtype == down.dtype,
          f"x, gate_up and down must share a dtype, got {x.dtype}, {gate_up.dtype}, {down.dtype}")
    check(ids.dim() == 2 and ids.shape[0] == tokens and ids.dtype in (torch.int64, torch.int32),
          f"ids has shape {tuple(ids.shape)} {ids.dtype}, expected [{tokens}, k] int64")
    check(tuple(weights.shape) == tuple(ids.shape),
          f"weights has shape {tuple(weights.shape)}, expected {tuple(ids.shape)} (as ids)")
    check(gate_up.stride(2) == 1 and down.stride(2) == 1,
          "gate_up and down need a contiguous last dim (the layout a checkpoint loads)")
