"""CPU MSA indexer: the same contract and selections as `naive.py` (the spec), fast.

Block scores and the selection come from the C kernels (`cpu_kernel.py`) where they build;
otherwise, per sequence and chunk of queries, one batched GEMM [Hkv, Tq, DI] × [Hkv, DI, T] scores
every visible key; only the keys from the chunk's first block on can lie after a query, so only that
tail is masked before the block max, and the selection is the spec's `select_blocks` (vectorised).
"""

import torch

from msaserve.kernels.indexer_prefill import cpu_kernel
from msaserve.kernels.indexer_prefill.naive import check_forced_blocks, select_blocks, sequence_index_keys

# Queries scored at once per sequence: bounds the [Hkv, chunk, T] fp32 logits (3 × 512 × 16K = 96 MiB).
_QUERY_CHUNK = 512


def block_scores(
    q_index: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, page_size: int
) -> torch.Tensor:
    """As `naive.block_scores` for ascending consecutive `positions`: q_index [Tq, Hkv, DI]; keys
    [T ≥ positions[-1] + 1, HkI, DI] fp32 → [Tq, Hkv, num_blocks] fp32, -inf for blocks after t."""
    visible = int(positions[-1]) + 1
    num_blocks = (visible + page_size - 1) // page_size
    keys = keys[:visible].permute(1, 2, 0)  # [HkI, DI, T]
    keys = torch.nn.functional.pad(keys, (0, num_blocks * page_size - visible))
    logits = torch.matmul(q_index.float().transpose(0, 1), keys)  # [Hkv, Tq, NB·P]
    start = (int(positions[0]) // page_size) * page_size
    key_pos = torch.arange(start, num_blocks * page_size, device=logits.device)
    logits[:, :, start:].masked_fill_(key_pos[None, :] > positions[:, None], float("-inf"))
    scores = logits.view(*logits.shape[:2], num_blocks, page_size).amax(dim=-1)
    return scores.transpose(0, 1)


def indexer_prefill(
    q_index: torch.Tensor,
    index_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    top_k: int,
    n_init: int = 1,
    index_scale: torch.Tensor | None = None,
    n_local: int = 1,
) -> torch.Tensor:
    """Same contract as `naive.indexer_prefill` → selected [Tq, Hkv, top_k] int32 (ascending, -1 pad)."""
    check_forced_blocks(top_k, n_init, n_local)
    page_size = index_cache.shape[1]
    out = torch.full(
        (q_index.shape[0], q_index.shape[1], top_k), -1, dtype=torch.int32, device=q_index.device
    )
    for b in range(block_tables.shape[0]):
        start, end = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        if end == start:
            continue
        length = int(seq_lens[b])
        keys = sequence_index_keys(index_cache, block_tables[b], length, index_scale)
        first = length - (end - start)
        if cpu_kernel.supported(q_index):
            scores = cpu_kernel.block_scores(q_index[start:end], keys, first, page_size)
            out[start:end] = cpu_kernel.select_blocks(scores, first, page_size, top_k, n_init, n_local)
            continue
        for q0 in range(start, end, _QUERY_CHUNK):
            q1 = min(q0 + _QUERY_CHUNK, end)
            positions = torch.arange(first + q0 - start, first + q1 - start, device=q_index.device)
            if int(positions[-1]) // page_size < top_k:  # every block 0..c is selected: no scores needed
                scores = torch.zeros(q1 - q0, q_index.shape[1], int(positions[-1]) // page_size + 1,
                                     device=q_index.device)
            else:
                scores = block_scores(q_index[q0:q1], keys, positions, page_size)
            out[q0:q1] = select_blocks(scores, positions, page_size, top_k, n_init, n_local)
    return out
