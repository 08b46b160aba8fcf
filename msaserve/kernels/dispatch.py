"""Pick one implementation of every attention op per backend.

Backends (DESIGN §4, engine): `naive` (MSA, PyTorch reference ops), `triton` (MSA, GPU kernels),
`dense` (dense causal attention, the baseline: SDPA, and on CUDA a paged flash-decoding kernel for
the decode rows, `dense/gpu.py`), and `msa` (triton on CUDA, naive elsewhere).
"""

from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module

import torch

BACKENDS = ("naive", "triton", "dense", "msa")


@dataclass(frozen=True)
class AttentionOps:
    """One backend's ops; signatures as in each op's naive.py.

    sparse: whether the model runs the MSA index branch (False → dense causal attention).
    graph_capturable: whether a decode step runs without host synchronisation (CUDA graphs).
    """

    name: str
    sparse: bool
    indexer_prefill: Callable[..., torch.Tensor]
    indexer_decode: Callable[..., torch.Tensor]
    sparse_prefill: Callable[..., torch.Tensor]
    sparse_decode: Callable[..., torch.Tensor]
    dense_prefill: Callable[..., torch.Tensor]
    dense_decode: Callable[..., torch.Tensor]
    graph_capturable: bool = False


def _load(impl: str, op: str, fn: str | None = None) -> Callable[..., torch.Tensor]:
    module = import_module(f"msaserve.kernels.{op}.{impl}")
    return getattr(module, fn or op)


def _ops(name: str, impl: str, sparse: bool, dense_impl: str, graph_capturable: bool = False) -> AttentionOps:
    return AttentionOps(
        name=name,
        sparse=sparse,
        indexer_prefill=_load(impl, "indexer_prefill"),
        indexer_decode=_load(impl, "indexer_decode"),
        sparse_prefill=_load(impl, "sparse_prefill"),
        sparse_decode=_load(impl, "sparse_decode"),
        dense_prefill=_load(dense_impl, "dense", "dense_prefill"),
        dense_decode=_load(dense_impl, "dense", "dense_decode"),
        graph_capturable=graph_capturable,
    )


def get_ops(backend: str, device: torch.device | str = "cpu") -> AttentionOps:
    """Return the ops of `backend` for tensors on `device`."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r} is not one of {', '.join(BACKENDS)}")
    device = torch.device(device)
    if backend == "msa":
        backend = "triton" if device.type == "cuda" else "naive"
    if backend == "naive":
        return _ops("naive", "naive", True, "naive")
    if backend == "dense":
        if device.type == "cuda":
            return _ops("dense", "naive", False, "gpu", graph_capturable=True)
        return _ops("dense", "naive", False, "sdpa")
    if device.type != "cuda":
        raise ValueError(
            f"attention backend 'triton' needs a CUDA device, got {device.type!r}; "
            "use 'naive' or 'msa' on CPU"
        )
    return _ops("triton", "triton", True, "sdpa", graph_capturable=True)
