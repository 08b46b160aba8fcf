"""Reference decode indexer: the prefill indexer with a fixed Q queries per sequence."""

import torch

from msaserve.kernels.indexer_prefill.naive import indexer_prefill


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
    """q_index: [B, Q, Hkv, DI] (query i of sequence b at position seq_lens[b] - Q + i);
    index_cache: [num_pages, P, HkI, DI]; block_tables: [B, max_pages]; seq_lens: [B]
    → selected [B, Q, Hkv, top_k] int32 (ascending, -1 pad); n_init, n_local as in `select_blocks`.
    """
    batch, num_q = q_index.shape[:2]
    cu_seqlens_q = torch.arange(batch + 1, device=q_index.device, dtype=torch.int32) * num_q
    selected = indexer_prefill(
        q_index.reshape(batch * num_q, *q_index.shape[2:]),
        index_cache, block_tables, seq_lens, cu_seqlens_q, top_k, n_init, index_scale, n_local,
    )
    return selected.view(batch, num_q, *selected.shape[1:])
