"""Mixture-of-experts ops: `naive.py` is the PyTorch spec (routing and the clamped-SwiGLU experts
of MiniMax-M3, a loop over the experts hit); `grouped.py` is the fast path with the same signatures
(fused routing, sort by expert on the device, grouped GEMMs, weighted un-permute; no loop over
experts, no host sync, CUDA-graph capturable), its elementwise kernels in `triton.py`. It is tested
against the spec. `get_moe_ops(device)` picks one of the two for a model."""

from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module

import torch

from msaserve.kernels.moe.naive import experts, route

IMPLEMENTATIONS = ("naive", "grouped")


@dataclass(frozen=True)
class MoeOps:
    """One implementation of `route` and `experts`; signatures as in naive.py."""

    name: str
    route: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    experts: Callable[..., torch.Tensor]


def get_moe_ops(device: torch.device | str, impl: str | None = None) -> MoeOps:
    """`impl` if given, else the grouped path for CUDA tensors and the spec elsewhere."""
    if impl is None:
        impl = "grouped" if torch.device(device).type == "cuda" else "naive"
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"MoE implementation {impl!r} is not one of {', '.join(IMPLEMENTATIONS)}")
    module = import_module(f"msaserve.kernels.moe.{impl}")
    return MoeOps(impl, module.route, module.experts)


__all__ = ["IMPLEMENTATIONS", "MoeOps", "experts", "get_moe_ops", "route"]
