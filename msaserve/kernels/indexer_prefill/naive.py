"""Reference MSA indexer (docs/design.md §2): block-max scores and top-K selection, plain PyTorch.

This file is the specification the Triton kernels are tested against. It favours clarity over
speed but processes queries in bounded chunks so that it also serves CPU inference.
"""

import torch

# Queries scored at once per sequence; bounds the [chunk, Hkv, T] fp32 score tensor.
_QUERY_CHUNK = 1024


def gather_pages(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Read the first `length` tokens of one sequence out of a paged cache.

    cache: [num_pages, P, H, D]; block_table: [max_pages] int32 → returns [length, H, D].
    """
    page_size = cache.shape[1]
    num_pages = (length + page_size - 1) // page_size
    pages = block_table[:num_pages].long()
    if num_pages and int(pages.min()) < 0:
        raise ValueError(f"block_table has non-resident page (-1) within the first {num_pages} pages")
    return cache[pages].reshape(num_pages * page_size, *cache.shape[2:])[:length]


def sequence_index_keys(index_cache: torch.Tensor, block_table: torch.Tensor, length: int,
                        index_scale: torch.Tensor | None) -> torch.Tensor:
    """One sequence's first `length` index keys as fp32 [length, HkI, DI], fp8 keys scaled back."""
    keys = gather_pages(index_cache, block_table, length).float()
    if index_scale is not None:
        keys = keys * gather_pages(index_scale[..., None], block_table, length)
    return keys


def block_scores(
    q_index: torch.Tensor,
    index_keys: torch.Tensor,
    positions: torch.Tensor,
    page_size: int,
) -> torch.Tensor:
    """`s(t, h, j) = max over p in block j, p ≤ t of ⟨qI[t, h], kI[p, h']⟩`, in fp32.

    q_index: [Tq, Hkv, DI]; index_keys: [T, HkI, DI] fp32-convertible (HkI ∈ {1, Hkv});
    positions: [Tq] int64 → returns [Tq, Hkv, num_blocks] fp32, -inf for blocks wholly after t.
    """
    length = index_keys.shape[0]
    num_blocks = (length + page_size - 1) // page_size
    keys = index_keys.float()
    if keys.shape[1] == 1:
        keys = keys.expand(-1, q_index.shape[1], -1)
    logits = torch.einsum("qhd,phd->qhp", q_index.float(), keys)  # [Tq, Hkv, T]
    future = torch.arange(length, device=logits.device)[None, :] > positions[:, None]
    logits = logits.masked_fill(future[:, None, :], float("-inf"))
    pad = num_blocks * page_size - length
    logits = torch.nn.functional.pad(logits, (0, pad), value=float("-inf"))
    return logits.view(*logits.shape[:2], num_blocks, page_size).amax(dim=-1)


def check_forced_blocks(top_k: int, n_init: int, n_local: int) -> None:
    """The forced blocks (n_init leading, n_local ending at the query's block) must fit in top_k slots."""
    if n_local < 1:
        raise ValueError(f"n_local={n_local} is invalid: allowed n_local ≥ 1 (the query's own block)")
    if n_init < 0 or n_init + n_local > top_k:
        raise ValueError(
            f"n_init={n_init} with n_local={n_local} is invalid: allowed 0 ≤ n_init and "
            f"n_init + n_local ≤ top_k={top_k}"
        )


def select_blocks(
    scores: torch.Tensor,
    positions: torch.Tensor,
    page_size: int,
    top_k: int,
    n_init: int,
    n_local: int = 1,
) -> torch.Tensor:
    """MSA selection (docs/design.md §2, M3 form) for queries at `positions`, c = ⌊t/P⌋:
    forced are the n_local blocks max(0, c-n_local+1)..c and the init blocks 0..n_init-1 (≤ c);
    the other top_k − |forced| slots take the top scores among the remaining blocks < c (ties to
    the lower block id); every block 0..c when c < top_k. n_init=1, n_local=1 is the msaserve form,
    n_init=0, n_local=index_local_blocks MiniMax-M3's.

    scores: [Tq, Hkv, num_blocks] fp32; positions: [Tq] → [Tq, Hkv, top_k] int32, ascending, -1 pad.
    """
    check_forced_blocks(top_k, n_init, n_local)
    num_q, num_heads, num_blocks = scores.shape
    block_ids = torch.arange(num_blocks, device=scores.device)[None, :]
    local = (positions // page_size)[:, None]  # [Tq, 1]
    # Candidates compete for the free slots; forced blocks get +inf so they always win,
    # blocks after c get -inf so they never do. The stable sort sends ties to the lower id.
    candidate = block_ids < local
    forced = (block_ids <= local) & ((block_ids > local - n_local) | (block_ids < n_init))
    ranked = torch.where(candidate[:, None, :], scores, torch.full_like(scores, float("-inf")))
    ranked = torch.where(forced[:, None, :], torch.full_like(scores, float("inf")), ranked)
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices
    width = min(top_k, num_blocks)
    chosen = order[..., :width]  # [Tq, Hkv, width]
    # Exactly min(c + 1, top_k) blocks are valid: all of 0..c when c < top_k, else top_k.
    num_valid = torch.clamp(local + 1, max=top_k)[:, :, None].expand(-1, num_heads, width)
    slot = torch.arange(width, device=scores.device)[None, None, :]
    chosen = torch.where(slot < num_valid, chosen, torch.full_like(chosen, num_blocks))
    chosen = torch.sort(chosen, dim=-1).values
    chosen = torch.where(chosen == num_blocks, torch.full_like(chosen, -1), chosen)
    out = torch.full((num_q, num_heads, top_k), -1, dtype=torch.int32, device=scores.device)
    out[..., :width] = chosen.to(torch.int32)
    return out


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
    """Select the top-K blocks for every query of a varlen batch of chunks (`select_blocks`).

    q_index: [Tq, Hkv, DI]; index_cache: [num_pages, P, HkI, DI] (bf16/fp16/fp32 or fp8 with
    index_scale [num_pages, P, HkI] fp32 multiplying each key); block_tables: [B, max_pages] int32;
    seq_lens: [B]; cu_seqlens_q: [B + 1] → selected [Tq, Hkv, top_k] int32 (ascending, -1 pad).
    The chunk's own index keys must already be written to the cache.
    """
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
        for q0 in range(start, end, _QUERY_CHUNK):
            q1 = min(q0 + _QUERY_CHUNK, end)
            positions = torch.arange(first + q0 - start, first + q1 - start, device=q_index.device)
            visible = int(positions[-1]) + 1
            scores = block_scores(q_index[q0:q1], keys[:visible], positions, page_size)
            out[q0:q1] = select_blocks(scores, positions, page_size, top_k, n_init, n_local)
    return out
