"""CPU MSA attention: the same contract and results as `naive.py` (the spec), fast.

On fp32 inputs where the C kernel builds (`cpu_kernel.py`) it runs that: every (query, KV head)
reads only its selected blocks, so the work is the sparse work. Otherwise, the vectorised PyTorch
path below:
Queries are grouped — by MSA block in a prefill (the P queries of one block select similar blocks),
by sequence in a decode step — and for every (group, KV head) the union of the blocks its queries
selected is gathered once, straight from the paged cache. One batched masked attention then covers
all groups of a chunk: query i of a group sees key p of the union iff p's block is among i's own
selected blocks and p ≤ i's position. No Python loop over blocks or queries; the loops are over
sequences (prefill) and over chunks of groups that bound the transient mask and key copies.
"""

import math

import torch

from msaserve.kernels.dense.sdpa import dense_prefill
from msaserve.kernels.sparse_prefill import cpu_kernel

# Upper bound on the [groups·Hkv, rows·G, union·P] attention mask (elements) built at once; the
# gathered K/V of a chunk are D/(rows·G) times that. 2^24 bools ≈ 16 MiB.
_MASK_ELEMENTS = 1 << 24
# Query rows per group in a prefill (a divisor of P is used): fewer rows select fewer distinct
# blocks (less wasted attention) but gather their blocks more often; measured on SmolLM2 at 4K/8K,
# 64 (one MSA block) beat 32, 16 and 8.
_GROUP_ROWS = 64


def attend_groups(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    selected: torch.Tensor,
    pages: torch.Tensor,
    lengths: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Masked attention of N query groups over the union of the blocks their rows selected.

    q: [N, R, Hkv, G, D]; q_pos: [N, R] int64 (-1 marks a padding row, whose output is garbage);
    selected: [N, R, Hkv, K] block ids (-1 pad); pages: [N, max_pages] the group's sequence's
    block table; lengths: [N] its length; caches [num_pages, P, Hkv, D] → o [N, R, Hkv, G, D] fp32.
    """
    num_groups, rows, num_kv_heads, group, _ = q.shape
    page_size = k_cache.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    if num_groups == 0:
        return out
    num_blocks = pages.shape[1]
    # Union of the selected blocks per (group, KV head): ids ascending, padded with num_blocks.
    marked = torch.zeros(num_groups, num_kv_heads, num_blocks + 1, dtype=torch.bool, device=q.device)
    flat = selected.permute(0, 2, 1, 3).reshape(num_groups, num_kv_heads, -1).long()
    marked.scatter_(-1, torch.where(flat < 0, num_blocks, flat), True)
    marked = marked[..., :num_blocks]
    block_ids = torch.arange(num_blocks, device=q.device)
    union = torch.where(marked, block_ids, num_blocks).sort(dim=-1).values  # [N, Hkv, NB]
    counts = marked.sum(dim=-1).amax(dim=-1)  # [N]: the widest union of each group's KV heads
    # Chunks of groups of similar width, so that each pads its unions to little more than needed.
    order = torch.argsort(counts, stable=True)
    per_group = num_kv_heads * rows * group * max(int(counts.max()), 1) * page_size
    chunk = max(1, _MASK_ELEMENTS // per_group)
    for n0 in range(0, num_groups, chunk):
        idx = order[n0:n0 + chunk]
        width = max(int(counts[idx[-1]]), 1)
        out[idx] = _attend_chunk(
            q[idx], q_pos[idx], selected[idx], union[idx, :, :width], pages[idx], lengths[idx],
            k_cache, v_cache, scale,
        )
    return out


def _attend_chunk(
    q: torch.Tensor, q_pos: torch.Tensor, selected: torch.Tensor, union: torch.Tensor,
    pages: torch.Tensor, lengths: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One chunk of `attend_groups`; union: [n, Hkv, U] block ids (num_blocks = padding)."""
    n, rows, num_kv_heads, group, head_dim = q.shape
    page_size, width, num_blocks = k_cache.shape[1], union.shape[-1], pages.shape[1]
    real = union < num_blocks
    block = torch.where(real, union, 0)
    page = pages.long().gather(1, block.reshape(n, -1)).view(n, num_kv_heads, width)
    page = torch.where(real & (page >= 0), page, 0)
    heads = torch.arange(num_kv_heads, device=q.device)[None, :, None]
    # [n, Hkv, U, P, D]: each selected block of each (group, KV head) read once from the cache.
    k = k_cache.permute(0, 2, 1, 3)[page, heads].float().view(n * num_kv_heads, width * page_size, head_dim)
    v = v_cache.permute(0, 2, 1, 3)[page, heads].float().view(n * num_kv_heads, width * page_size, head_dim)
    # Row i may not read union slot u unless the block is one of i's own selections (and real),
    # nor a key after its position or past its sequence's end.
    sel = selected.permute(0, 2, 1, 3).long()  # [n, Hkv, R, K]
    member = (union[:, :, None, :, None] == sel[:, :, :, None, :]).any(dim=-1) & real[:, :, None, :]
    key_pos = union[..., None] * page_size + torch.arange(page_size, device=q.device)  # [n, Hkv, U, P]
    past_end = key_pos >= lengths[:, None, None, None].long()
    key_pos = key_pos.masked_fill(past_end, torch.iinfo(torch.int64).max)
    blocked = (key_pos[:, :, None] > q_pos[:, None, :, None, None]) | ~member[..., None]  # [n, Hkv, R, U, P]
    qg = q.float().permute(0, 2, 1, 3, 4).reshape(n * num_kv_heads, rows * group, head_dim)
    logits = torch.bmm(qg, k.transpose(1, 2)).mul_(scale)  # [n·Hkv, R·G, U·P]
    logits.view(n * num_kv_heads, rows, group, -1).masked_fill_(
        blocked.view(n * num_kv_heads, rows, 1, -1), float("-inf")
    )
    probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0)  # a row with nothing selected → zeros
    o = torch.bmm(probs, v)  # [n·Hkv, R·G, D]
    return o.view(n, num_kv_heads, rows, group, head_dim).permute(0, 2, 1, 3, 4)


def row_positions(seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """→ (sequence [Tq], position [Tq]) of every query row of a varlen batch (a chunk's queries
    are its sequence's last ones)."""
    counts = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    seq = torch.repeat_interleave(torch.arange(counts.shape[0], device=counts.device), counts)
    rows = torch.arange(seq.shape[0], device=counts.device)
    return seq, seq_lens.long()[seq] - cu_seqlens_q.long()[seq + 1] + rows


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
    """Same contract as `naive.sparse_prefill`: q [Tq, Hq, D]; caches [num_pages, P, Hkv, D];
    block_tables [B, max_pages]; seq_lens [B]; cu_seqlens_q [B + 1]; selected [Tq, Hkv, K] (None =
    dense causal) → o [Tq, Hq, D] in q's dtype."""
    if selected is None:
        return dense_prefill(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, softmax_scale)
    page_size, num_kv_heads, head_dim = k_cache.shape[1:]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    if cpu_kernel.supported(q, k_cache, v_cache):
        row_seq, row_pos = row_positions(seq_lens, cu_seqlens_q)
        return cpu_kernel.sparse_attention(
            q, k_cache, v_cache, block_tables, row_seq, row_pos, selected, scale
        ).to(q.dtype)
    group = q.shape[1] // num_kv_heads
    out = torch.empty_like(q)
    for b in range(block_tables.shape[0]):
        start, end = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        if end == start:
            continue
        length = int(seq_lens[b])
        first = length - (end - start)
        # Pad the chunk to whole groups of `rows` consecutive positions (within one MSA block).
        rows = math.gcd(page_size, _GROUP_ROWS)
        lead = first % rows
        num_groups = (lead + end - start + rows - 1) // rows
        padded = num_groups * rows
        qp = q.new_zeros(padded, num_kv_heads, group, head_dim)
        qp[lead:lead + end - start] = q[start:end].view(-1, num_kv_heads, group, head_dim)
        pos = torch.full((padded,), -1, dtype=torch.int64, device=q.device)
        pos[lead:lead + end - start] = torch.arange(first, length, device=q.device)
        sel = selected.new_full((padded, *selected.shape[1:]), -1)
        sel[lead:lead + end - start] = selected[start:end]
        o = attend_groups(
            qp.view(num_groups, rows, num_kv_heads, group, head_dim), pos.view(num_groups, rows),
            sel.view(num_groups, rows, *sel.shape[1:]),
            block_tables[b:b + 1].expand(num_groups, -1), seq_lens[b:b + 1].expand(num_groups),
            k_cache, v_cache, scale,
        )
        out[start:end] = o.reshape(padded, -1, head_dim)[lead:lead + end - start].to(q.dtype)
    return out
