"""Inputs and references shared by the MoE tests (CPU: test_kernels_moe.py, GPU: test_gpu_moe.py).

The reference here is a plain loop over experts in float64 written from the contract in
`msaserve/kernels/moe/__init__.py` (it does not import msaserve); the CPU tests also check it
against transformers' MiniMaxM3VLExperts / MiniMaxM3VLTopKRouter where those are installed."""

from dataclasses import dataclass

import torch

ALPHA, LIMIT = 1.702, 7.0  # MiniMax-M3's swiglu_alpha, swiglu_limit


@dataclass
class MoeCase:
    """x [T, H]; gate_up [E, 2I, H]; down [E, H, I]; router_logits [T, E]; correction_bias [E]."""

    x: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    router_logits: torch.Tensor
    correction_bias: torch.Tensor


def random_case(
    tokens: int, hidden: int, inter: int, num_experts: int, dtype: torch.dtype, device: str, seed: int,
    unused_experts: tuple[int, ...] = (), gate_scale: float = 3.0,
) -> MoeCase:
    """Random weights scaled so that some gate values pass the clamp `LIMIT`; `unused_experts` get
    logits and a bias low enough that no token picks them."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    logits = randn(tokens, num_experts, scale=2.0)
    bias = randn(num_experts, scale=0.1)
    for expert in unused_experts:
        logits[:, expert] = -30.0
        bias[expert] = -10.0
    case = MoeCase(
        x=randn(tokens, hidden),
        gate_up=randn(num_experts, 2 * inter, hidden, scale=gate_scale / hidden**0.5),
        down=randn(num_experts, hidden, inter, scale=1.0 / inter**0.5),
        router_logits=logits,
        correction_bias=bias,
    )
    for name in ("x", "gate_up", "down"):
        setattr(case, name, getattr(case, name).to(device=device, dtype=dtype))
    case.router_logits = case.router_logits.to(device)
    case.correction_bias = case.correction_bias.to(device)
    return case


def reference_route(
    router_logits: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids) with ids sorted ascending per token (the contract leaves the order free)."""
    scores = torch.sigmoid(router_logits.double())
    choice = scores if correction_bias is None else scores + correction_bias.double()
    ids = torch.topk(choice, top_k, dim=-1).indices.sort(dim=-1).values
    weights = scores.gather(1, ids)
    return weights / weights.sum(dim=-1, keepdim=True), ids


def sorted_by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.sort(dim=-1).indices
    return weights.gather(1, order), ids.gather(1, order)


def clear_margin(
    router_logits: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int
) -> torch.Tensor:
    """[T] bool: the k-th and (k+1)-th biased scores differ by more than fp32 rounding, so every
    correct implementation must choose the same set."""
    scores = torch.sigmoid(router_logits.double())
    choice = scores if correction_bias is None else scores + correction_bias.double()
    if top_k == choice.shape[1]:
        return torch.ones(choice.shape[0], dtype=torch.bool, device=choice.device)
    top = torch.topk(choice, top_k + 1, dim=-1).values
    return (top[:, top_k - 1] - top[:, top_k]) > 1e-5


def reference_experts(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
    alpha: float = ALPHA, limit: float = LIMIT, dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """The per-expert loop of the contract, computed in `dtype` (float64 on CPU by default)."""
    x, gate_up, down, weights = x.to(dtype), gate_up.to(dtype), down.to(dtype), weights.to(dtype)
    out = torch.zeros_like(x)
    for expert in range(gate_up.shape[0]):
        token, slot = torch.nonzero(ids == expert, as_tuple=True)
        if token.numel() == 0:
            continue
        gate, up = (x[token] @ gate_up[expert].T).chunk(2, dim=-1)
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        hidden = (up + 1.0) * gate * torch.sigmoid(alpha * gate)
        out.index_add_(0, token, (hidden @ down[expert].T) * weights[token, slot, None])
    return out


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN or inf anywhere in out counts as infinite error."""
    if not torch.isfinite(out).all():
        return float("inf")
    out, ref = out.double().cpu(), ref.double().cpu()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))
