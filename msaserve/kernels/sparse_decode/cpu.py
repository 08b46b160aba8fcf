"""CPU sparse decode: the CPU varlen op with a fixed Q queries per sequence (as `naive.py`)."""

import torch

from msaserve.kernels.sparse_prefill.cpu import sparse_prefill


def sparse_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    selected: torch.Tensor | None,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Same contract as `naive.sparse_decode`: q [B, Q, Hq, D] → o [B, Q, Hq, D]."""
    batch, num_q = q.shape[:2]
    cu_seqlens_q = torch.arange(batch + 1, device=q.device, dtype=torch.int32) * num_q
    flat_sel = None if selected is None else selected.reshape(batch * num_q, *selected.shape[2:])
    out = sparse_prefill(
        q.reshape(batch * num_q, *q.shape[2:]), k_cache, v_cache, block_tables, seq_lens,
        cu_seqlens_q, flat_sel, softmax_scale,
    )
    return out.view_as(q)
