"""Dense causal attention over gathered pages with `torch.nn.functional.scaled_dot_product_attention`
(or any kernel of the same contract passed as `attend`).

The dense path on CPU; on CUDA the dense backend passes the fastest measured kernel (`select.py`). Pages
are gathered into a contiguous K/V per sequence; that copy is part of the baseline's cost.
"""

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from msaserve.kernels.indexer_prefill.naive import gather_pages

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def dense_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    softmax_scale: float | None = None,
    attend: Attend | None = None,
) -> torch.Tensor:
    """q: [Tq, Hq, D]; caches [num_pages, P, Hkv, D] → o [Tq, Hq, D] (causal, GQA).

    attend(q [1, Hq, Tq, D], k [1, Hkv, T, D], v, scale) → o [1, Hq, Tq, D], lower-right causal:
    the attention run on each gathered sequence (default: SDPA's own choice, below); the dense
    backend passes the fastest measured kernel (`select.py`)."""
    head_dim = q.shape[-1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    out = torch.empty_like(q)
    for b in range(block_tables.shape[0]):
        start, end = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        if end == start:
            continue
        length = int(seq_lens[b])
        k = gather_pages(k_cache, block_tables[b], length).transpose(0, 1)  # [Hkv, T, D]
        v = gather_pages(v_cache, block_tables[b], length).transpose(0, 1)
        qb = q[start:end].transpose(0, 1)  # [Hq, Tq, D]
        num_q = end - start
        k, v = k.to(q.dtype), v.to(q.dtype)
        if attend is not None:
            o = attend(qb[None].contiguous(), k[None].contiguous(), v[None].contiguous(), scale)
            out[start:end] = o[0].transpose(0, 1)
            continue
        gqa, mask = True, None
        if 1 < num_q < length:
            # Queries are the last num_q positions: query i sees keys ≤ length - num_q + i. A
            # lower-right causal bias (not a dense [Tq, T] mask) keeps SDPA on a fused kernel;
            # that bias's fused path does not take GQA, so on CUDA the KV heads are expanded:
            # a transient copy, small next to the attention it enables.
            mask = causal_lower_right(num_q, length)
            if q.is_cuda:
                group = q.shape[1] // k.shape[0]
                k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
                gqa = False
        # num_q == length: plain causal; num_q == 1: the last position sees every key. The
        # fused CUDA kernels take only 4-D [batch, heads, T, D] inputs (3-D fell back to
        # materialised scores), hence the leading batch axis.
        o = F.scaled_dot_product_attention(
            qb[None], k[None], v[None], attn_mask=mask, is_causal=num_q == length and num_q > 1,
            scale=scale, enable_gqa=gqa,
        )
        out[start:end] = o[0].transpose(0, 1)
    return out


def dense_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float | None = None,
    attend: Attend | None = None,
) -> torch.Tensor:
    """q: [B, Q, Hq, D] → o [B, Q, Hq, D]."""
    batch, num_q = q.shape[:2]
    cu_seqlens_q = torch.arange(batch + 1, device=q.device, dtype=torch.int32) * num_q
    out = dense_prefill(
        q.reshape(batch * num_q, *q.shape[2:]), k_cache, v_cache, block_tables, seq_lens,
        cu_seqlens_q, softmax_scale, attend,
    )
    return out.view_as(q)
