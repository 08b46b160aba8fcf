"""The dense backend's attention ops on CUDA (the baseline every serving benchmark compares with).

Prefill runs the fastest dense kernel measured for its shape (`select.py`, once per shape key);
decode runs one kernel:
- prefill: per sequence, the pages are gathered into a contiguous K/V and the fastest of SDPA's
  cuDNN / flash / efficient backends, FlexAttention and flash-attn-4 (when installed) runs on it,
  for its mask kind (whole-prompt causal, or a chunk at the end of a longer KV);
- decode: the paged flash-decoding kernel (`paged_decode.py`, straight from the paged cache), in
  CUDA-graph capture and eagerly alike. Gathering the pages for a contiguous kernel reads the KV
  twice and writes it once; timed in benchmarks/kernels/bench_decode_suite.py the paged kernel
  beat even the contiguous kernels given their K/V for free at long contexts (e.g. 0.513 vs
  0.591 ms at batch 8 × 128K), and measuring the two in the engine ran inside serving steps:
  decode keys (batch bucket × KV bucket) keep appearing in mixed steps, and an H200 agentic run
  at c = 32 measured them in its timed window (dense TPOT 57 ms in one run, 305 ms in the next).
The sequences of a prefill step that decode one token alongside the prefill chunks (continuous
batching mixes them) go to the decode op, instead of gathering their whole history per sequence.
"""

import itertools

import torch

from msaserve.kernels.dense import paged_decode, sdpa
from msaserve.kernels.dense.select import default_selector

__all__ = ["dense_decode", "dense_prefill"]


def dense_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """q: [B, Q, Hq, D]; caches [num_pages, P, Hkv, D] → o [B, Q, Hq, D] (query i of a sequence
    sees the keys up to its own position)."""
    return paged_decode.dense_decode(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale)


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
    attend = default_selector().attention
    bounds = cu_seqlens_q.tolist()  # one host sync; the per-sequence loop needs the offsets anyway
    q_lens = [end - start for start, end in itertools.pairwise(bounds)]
    single = [b for b, n in enumerate(q_lens) if n == 1]
    if not single:
        return sdpa.dense_prefill(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, softmax_scale,
                                  attend=attend)
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
                                         cu, softmax_scale, attend=attend)
    return out
