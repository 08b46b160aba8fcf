"""The bytes one batch-1 decode step must read, and the time they take at the measured copy
bandwidth: the floor under the engine's TPOT, per backend (issue 25's byte ceiling).

Read per step: every weight once, except the MoE's routed experts (only the top-k of a token's
router choice: k of E) and the embedding table (one row); per layer the attention's K/V and index
reads: MSA the whole index-K cache (T × HkI × DI) plus the K·P tokens of K and V it selects,
dense all T tokens of K and V. Activations, logits and norms' few KB are left out.
"""

import torch
from torch import nn


def weight_bytes_per_token(model: nn.Module) -> int:
    """Weight bytes a batch-1 decode step reads."""
    config = model.config
    routed = getattr(config, "num_experts_per_tok", 0) / max(1, getattr(config, "num_experts", 1))
    total = 0.0
    for name, param in model.named_parameters():
        size = param.numel() * param.element_size()
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            size *= routed
        elif name.startswith("embed_tokens"):
            size = param.shape[-1] * param.element_size()
        total += size
    return int(total)


def kv_bytes_per_step(model: nn.Module, context: int, sparse: bool, cache_bytes: int = 2) -> int:
    """K/V (+ index-K for MSA) bytes one decode step reads over `context` tokens, all layers."""
    c = model.config
    kv_per_token = 2 * c.num_kv_heads * c.head_dim * cache_bytes
    total = 0
    for kind in getattr(c, "layer_types", ("minimax_m3_sparse",) * c.num_layers):
        if sparse and kind == "minimax_m3_sparse":
            index = context * c.num_index_heads * c.index_head_dim * cache_bytes
            total += index + min(context, c.top_k * c.page_size) * kv_per_token
        else:
            total += context * kv_per_token
    return total


def copy_bandwidth_tbps(device: str, gib: int = 4) -> float:
    """Device-to-device copy: (read + write bytes) / time, median of 5, in TB/s."""
    if device != "cuda":
        return float("nan")
    src = torch.empty(gib << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    del src, dst
    torch.cuda.empty_cache()
    best = sorted(times[1:])[len(times[1:]) // 2]
    return 2 * (gib << 30) / (best * 1e-3) / 1e12


def step_floor(model: nn.Module, context: int, sparse: bool, tbps: float) -> dict[str, float]:
    """bytes (GB) and floor_ms of one batch-1 decode step at `context` tokens."""
    weights = weight_bytes_per_token(model)
    kv = kv_bytes_per_step(model, context, sparse)
    total = weights + kv
    return {"weights_gb": weights / 1e9, "kv_gb": kv / 1e9, "bytes_gb": total / 1e9,
            "floor_ms": total / (tbps * 1e12) * 1e3}
