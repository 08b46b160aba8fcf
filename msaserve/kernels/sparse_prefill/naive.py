"""Reference MSA attention (docs/design.md §2): softmax over p ≤ t in the selected blocks, fp32 math."""

import math

import torch

from msaserve.kernels.indexer_prefill.naive import gather_pages

# Queries attended at once per sequence; bounds the [chunk, Hq, T] fp32 score tensor.
_QUERY_CHUNK = 512


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float
) -> torch.Tensor:
    """q: [Tq, Hkv, G, D]; k, v: [T, Hkv, D]; allowed: [Tq, Hkv, T] bool → [Tq, Hkv, G, D] fp32.

    A query with no allowed key cannot occur (its own position is always allowed).
    """
    logits = torch.einsum("qhgd,phd->qhgp", q.float(), k.float()) * scale
    logits = logits.masked_fill(~allowed[:, :, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.einsum("qhgp,phd->qhgd", probs, v.float())


def selection_mask(
    selected: torch.Tensor, positions: torch.Tensor, length: int, page_size: int
) -> torch.Tensor:
    """selected: [Tq, Hkv, K] block ids (-1 pad); positions: [Tq] → allowed [Tq, Hkv, length]."""
    num_blocks = (length + page_size - 1) // page_size
    chosen = torch.zeros(*selected.shape[:2], num_blocks + 1, dtype=torch.bool, device=selected.device)
    # -1 padding lands in the extra column num_blocks, which no key maps to.
    index = torch.where(selected < 0, num_blocks, selected).long()
    chosen.scatter_(-1, index, True)
    key_pos = torch.arange(length, device=selected.device)
    causal = key_pos[None, :] <= positions[:, None]  # [Tq, T]
    return chosen[:, :, key_pos // page_size] & causal[:, None, :]


def sparse_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    selected: torch.Tensor | None,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """q: [Tq, Hq, D]; k_cache, v_cache: [num_pages, P, Hkv, D]; block_tables: [B, max_pages];
    seq_lens: [B]; cu_seqlens_q: [B + 1]; selected: [Tq, Hkv, K] (None = dense causal)
    → o [Tq, Hq, D] in q's dtype. Query heads h*G .. h*G+G-1 share KV head h.
    """
    page_size, num_kv_heads, head_dim = k_cache.shape[1:]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    group = q.shape[1] // num_kv_heads
    out = torch.empty_like(q)
    for b in range(block_tables.shape[0]):
        start, end = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        if end == start:
            continue
        length = int(seq_lens[b])
        k = gather_pages(k_cache, block_tables[b], length)
        v = gather_pages(v_cache, block_tables[b], length)
        first = length - (end - start)
        for q0 in range(start, end, _QUERY_CHUNK):
            q1 = min(q0 + _QUERY_CHUNK, end)
            positions = torch.arange(first + q0 - start, first + q1 - start, device=q.device)
            visible = int(positions[-1]) + 1
            if selected is None:
                allowed = (torch.arange(visible, device=q.device)[None, :] <= positions[:, None])
                allowed = allowed[:, None, :].expand(-1, num_kv_heads, -1)
            else:
                allowed = selection_mask(selected[q0:q1], positions, visible, page_size)
            qg = q[q0:q1].view(q1 - q0, num_kv_heads, group, head_dim)
            o = masked_attention(qg, k[:visible], v[:visible], allowed, scale)
            out[q0:q1] = o.reshape(q1 - q0, -1, head_dim).to(q.dtype)
    return out
