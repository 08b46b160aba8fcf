"""Reference dense causal attention over the paged cache (the MSA reference with no selection)."""

import torch

from msaserve.kernels.sparse_decode.naive import sparse_decode
from msaserve.kernels.sparse_prefill.naive import sparse_prefill


def dense_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """q: [Tq, Hq, D] → o [Tq, Hq, D]; causal over each sequence's whole paged history."""
    return sparse_prefill(
        q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, None, softmax_scale
    )


def dense_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """q: [B, Q, Hq, D] → o [B, Q, Hq, D]."""
    return sparse_decode(q, k_cache, v_cache, block_tables, seq_lens, None, softmax_scale)
