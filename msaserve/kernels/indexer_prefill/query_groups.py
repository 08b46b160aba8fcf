"""The prefill indexer for short query chunks: the chunk's queries regrouped as pseudo-sequences of
GROUP consecutive queries and run through the decode indexer's split-page kernels.

Why: the prefill kernel (`triton._indexer_prefill_kernel`) gives each program a tile of 32 queries
and streams every page of its sequence through it. A chunk of a few hundred queries over a long
prefix is then a handful of programs on a 132-SM GPU, each reading the whole prefix alone: on the
H200, 171 queries over 55K tokens took 0.50 ms in that kernel (MiniMax production case 9467c4ec).
The decode indexer (`indexer_decode.triton`) splits each sequence's pages over many programs and
merges their candidates, and takes up to 16 queries per sequence at the sequence's last positions,
causal within them. A group of GROUP queries ending at position e is exactly such a "sequence" of
length e + 1 with the same block table, so the selection is the spec's (`naive.indexer_prefill`).

Groups are aligned to the end of each sequence's queries; the first group of a sequence may hold
fewer real queries, and its leading slots (positions before the chunk) are computed and dropped.
Everything is computed on the device from shapes: no host sync, and the number of groups has the
fixed bound cdiv(Tq, GROUP) + B.
"""

import torch
import triton

from msaserve.kernels.indexer_decode import triton as decode

GROUP = 16
"""Queries per pseudo-sequence: the most `indexer_decode` takes."""


def group_map(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """→ (token [G, GROUP] int64: the query row of each slot, clamped into range; real [G, GROUP]
    bool: the slot is one of the chunk's queries; seq [G] int64: the sequence of each group;
    length [G] int32: the group's pseudo-sequence length, its last query's position + 1 (1 for an
    unused group)), G = cdiv(num_tokens, GROUP) + B."""
    batch = seq_lens.shape[0]
    cu = cu_seqlens_q.long()
    counts = cu[1:] - cu[:-1]  # [B]
    groups = (counts + GROUP - 1) // GROUP
    ends = torch.cumsum(groups, 0)
    gid = torch.arange(triton.cdiv(num_tokens, GROUP) + batch, device=cu.device)
    seq = torch.searchsorted(ends, gid, right=True)
    used = seq < batch
    seq = seq.clamp(max=batch - 1)
    k = gid - (ends[seq] - groups[seq])  # the group's index within its sequence
    stop = counts[seq] - GROUP * (groups[seq] - k - 1)  # past its last query, within the sequence
    local = stop[:, None] - GROUP + torch.arange(GROUP, device=cu.device)[None, :]
    real = used[:, None] & (local >= 0)
    token = (cu[seq][:, None] + local).clamp(0, max(num_tokens - 1, 0))
    length = seq_lens.long()[seq] - (counts[seq] - stop)
    length = torch.where(used, length, 1).to(torch.int32)
    return token, real, seq, length


def indexer_prefill_by_groups(
    q_index: torch.Tensor, index_cache: torch.Tensor, index_scale: torch.Tensor | None,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, top_k: int,
    n_init: int, n_local: int,
) -> torch.Tensor:
    """The prefill indexer's contract (`triton.indexer_prefill`) through the decode kernels."""
    num_tokens, num_heads, _ = q_index.shape
    # Every query is a real slot of exactly one group; dropped slots write to a spare row at the end.
    out = torch.empty((num_tokens + 1, num_heads, top_k), device=q_index.device, dtype=torch.int32)
    if num_tokens == 0:
        return out[:0]
    token, real, seq, length = group_map(cu_seqlens_q.to(q_index.device), seq_lens.to(q_index.device),
                                         num_tokens)
    queries = q_index[token]  # [G, GROUP, Hkv, DI]
    tables = block_tables[seq]  # [G, max_pages]
    selected = decode._launch(queries, index_cache, index_scale, tables, length, top_k, n_init, n_local,
                              decode.DEFAULT_FP8_SCAN, decode.DEFAULT_KEY_LOAD)  # [G, GROUP, Hkv, K]
    out.index_copy_(0, torch.where(real, token, num_tokens).flatten(), selected.flatten(0, 1))
    return out[:num_tokens]
