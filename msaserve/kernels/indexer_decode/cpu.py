"""CPU decode indexer: the CPU prefill indexer with a fixed Q queries per sequence (as `naive.py`)."""

import torch

from msaserve.kernels.indexer_prefill.cpu import indexer_prefill


def indexer_decode(
    q_index: torch.Tensor,
    index_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    top_k: int,
    n_init: int = 1,
    index_scale: torch.Tensor | None = None,
    n_local: int = 1,
) -> torch.Tensor:
    """Same contract as `naive.indexer_decode` → selected [B, Q, Hkv, top_k] int32."""
    batch, num_q = q_index.shape[:2]
    cu_seqlens_q = torch.arange(batch + 1, device=q_index.device, dtype=torch.int32) * num_q
    selected = indexer_prefill(
        q_index.reshape(batch * num_q, *q_index.shape[2:]),
        index_cache, block_tables, seq_lens, cu_seqlens_q, top_k, n_init, index_scale, n_local,
    )
    return selected.view(batch, num_q, *selected.shape[1:])
