"""The dense backend's attention ops on CUDA (the baseline every serving benchmark compares with).

Decode steps run the paged flash-decoding kernel (`paged_decode.py`), straight from the paged cache
and inside CUDA graphs. Prefill steps run SDPA per sequence (`sdpa.py`, flash kernels); the
sequences of such a step that decode one token alongside the prefill chunks (continuous batching
mixes them) go to the paged kernel too, instead of gathering their whole history for SDPA.
"""

import itertools

import torch

from msaserve.kernels.dense import sdpa
from msaserve.kernels.dense.paged_decode import dense_decode

__all__ = ["dense_decode", "dense_prefill"]


def dense_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """q: [Tq, Hq, D]; caches [num_pages, P, Hkv, D] → o [Tq, Hq, D] (causal, GQA)."""
    bounds = cu_seqlens_q.tolist()  # one host sync; SDPA's per-sequence loop needs the offsets anyway
    q_lens = [end - start for start, end in itertools.pairwise(bounds)]
    single = [b for b, n in enumerate(q_lens) if n == 1]
    if not single:
        return sdpa.dense_prefill(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, softmax_scale)
    device = q.device
    out = torch.empty_like(q)
    rows = torch.tensor(single, device=device)
    tokens = torch.tensor([bounds[b] for b in single], device=device)
    decoded = dense_decode(q[tokens][:, None], k_cache, v_cache, block_tables[rows], seq_lens[rows],
                           softmax_scale)  # [Bd, 1, Hq, D]
    out[tokens] = decoded[:, 0]
    multi = [b for b, n in enumerate(q_lens) if n > 1]
    if multi:
        rows = torch.tensor(multi, device=device)
        tokens = torch.cat([torch.arange(bounds[b], bounds[b + 1]) for b in multi]).to(device)
        cu = torch.tensor([0, *itertools.accumulate(q_lens[b] for b in multi)], dtype=torch.int32,
                          device=device)
        out[tokens] = sdpa.dense_prefill(q[tokens], k_cache, v_cache, block_tables[rows], seq_lens[rows],
                                         cu, softmax_scale)
    return out
