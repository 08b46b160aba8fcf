"""Reference MoE ops of MiniMax-M3 in plain PyTorch: the spec every faster path is tested against.

`route`: sigmoid scores of fp32 router logits; a correction bias only changes which experts are
chosen; the weights are the plain sigmoid scores of the chosen experts renormalised to sum 1.
`experts`: the clamped SwiGLU ("swigluoai") of each chosen expert, weighted and summed; it loops
over the experts actually hit, which is also what the CPU runs. `routed_scaling_factor` and the
shared expert belong to the model, not to these ops.
"""

import torch
import torch.nn.functional as F


def route(
    router_logits: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] → (weights [T, k] fp32 summing to 1, ids [T, k] int64).

    correction_bias [E] (or None) is added to the sigmoid scores to choose the experts only.
    """
    num_experts = router_logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} is invalid: allowed 1 ≤ top_k ≤ num_experts={num_experts}")
    scores = torch.sigmoid(router_logits.float())
    choice = scores if correction_bias is None else scores + correction_bias.float()
    ids = torch.topk(choice, top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    return weights / weights.sum(dim=-1, keepdim=True), ids.long()


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gate_up [..., 2I] (gate first) → (up + 1) · gate · sigmoid(alpha · gate) [..., I], with
    gate clamped to ≤ limit and up to [-limit, limit] first."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1.0) * (gate * torch.sigmoid(gate * alpha))


def experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    swiglu_alpha: float,
    swiglu_limit: float,
) -> torch.Tensor:
    """x [T, H]; gate_up [E, 2I, H]; down [E, H, I]; ids [T, k] int64; weights [T, k] fp32
    → Σ_k weights[t, k] · down[e] · clamped_swiglu(gate_up[e] · x[t]) with e = ids[t, k], [T, H]
    in x's dtype (each expert's weighted rows are cast to it before they are summed)."""
    num_experts = gate_up.shape[0]
    if ids.shape != weights.shape or ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"ids {tuple(ids.shape)} and weights {tuple(weights.shape)} are invalid: allowed both "
            f"[T={x.shape[0]}, k]"
        )
    out = torch.zeros_like(x)
    for expert in torch.unique(ids).tolist():
        if not 0 <= expert < num_experts:
            raise ValueError(f"expert id {expert} is invalid: allowed 0 ≤ id < {num_experts}")
        tokens, slots = torch.where(ids == expert)
        hidden = clamped_swiglu(F.linear(x[tokens], gate_up[expert]), swiglu_alpha, swiglu_limit)
        rows = F.linear(hidden, down[expert]) * weights[tokens, slots, None]
        out.index_add_(0, tokens, rows.to(out.dtype))
    return out
