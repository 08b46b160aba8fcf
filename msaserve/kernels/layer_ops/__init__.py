"""A decoder layer's elementwise ops (residual add + RMSNorm, rotary + cache writes, SwiGLU's
silu·up; MiniMax-M3's RMSNorm with its residual add and its attention input, `m3_attention_heads`):
`naive.py` is the spec in PyTorch, `triton.py` one fused kernel per op for CUDA."""

from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module

import torch


@dataclass(frozen=True)
class LayerOps:
    """One implementation of each op; signatures as in naive.py."""

    name: str
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rotary_and_write: Callable[..., torch.Tensor]
    silu_mul: Callable[..., torch.Tensor]


def get_layer_ops(device: torch.device | str) -> LayerOps:
    """The fused Triton kernels for CUDA tensors, the PyTorch spec elsewhere."""
    impl = "triton" if torch.device(device).type == "cuda" else "naive"
    module = import_module(f"msaserve.kernels.layer_ops.{impl}")
    return LayerOps(impl, module.add_rms_norm, module.rotary_and_write, module.silu_mul)


__all__ = ["LayerOps", "get_layer_ops"]
