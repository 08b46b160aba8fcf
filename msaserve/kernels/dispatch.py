"""The attention ops a model layer calls, and the one place a backend name becomes them.

A backend is one module in `msaserve/kernels/backends/` whose `resolve(device)` returns an
`AttentionOps`; its file name is its name, so adding a backend is adding one file. The model runner
resolves the configured name once (`get_ops`) and passes the ops object down to every layer; nothing
else maps names to functions.
"""

from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module

import torch

from msaserve.kernels import backends
from msaserve.kernels.backends import backend_names


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


def load_op(impl: str, op: str, fn: str | None = None) -> Callable[..., torch.Tensor]:
    """`msaserve.kernels.<op>.<impl>.<fn or op>`: one op of one implementation."""
    module = import_module(f"msaserve.kernels.{op}.{impl}")
    return getattr(module, fn or op)


def msa_ops(name: str, impl: str, dense: tuple[Callable, Callable], graph_capturable: bool) -> AttentionOps:
    """The four MSA ops of one implementation (`naive` / `triton`) beside a dense pair."""
    return AttentionOps(
        name=name, sparse=True,
        indexer_prefill=load_op(impl, "indexer_prefill"), indexer_decode=load_op(impl, "indexer_decode"),
        sparse_prefill=load_op(impl, "sparse_prefill"), sparse_decode=load_op(impl, "sparse_decode"),
        dense_prefill=dense[0], dense_decode=dense[1], graph_capturable=graph_capturable,
    )


def get_ops(backend: str, device: torch.device | str = "cpu") -> AttentionOps:
    """Resolve `backend` into its ops for tensors on `device`."""
    names = backend_names()
    if backend not in names:
        raise ValueError(f"attention_backend={backend!r} is invalid: allowed {', '.join(names)}")
    return import_module(f"{backends.__name__}.{backend}").resolve(torch.device(device))
