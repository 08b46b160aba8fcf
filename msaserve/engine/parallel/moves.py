"""Rank-to-rank session moves: a sequence's pages go from one replica's rank to another's with
torch.distributed send/recv (NCCL device to device on GPUs of one node, gloo on CPUs) instead of
through host memory and the KV cache service. The index pages go first, every layer's in one
message (as adoption loads them: the indexer can select before the K/V pages land), then each
layer's K and V.

Both sides must agree on the layout: rank i of the source sends its own heads to rank i of the
target (same tensor_parallel_size), so no rank ever holds more than its shard. The receiver
chooses its own physical pages; the logical order is the sender's.
"""

from collections.abc import Sequence

import torch
import torch.distributed as dist

from msaserve.models.cache import LayerKVCache


def _pages(indices: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.as_tensor(list(indices), dtype=torch.long, device=device)


def send_session(caches: list[LayerKVCache], pages: Sequence[int], token_ids: Sequence[int], dst: int,
                 group: dist.ProcessGroup | None = None) -> None:
    """Send the tokens and the physical `pages` (in logical order) of one sequence to rank `dst`."""
    device = caches[0].k_cache.device
    header = torch.tensor([len(token_ids), len(pages)], dtype=torch.long, device=device)
    dist.send(header, dst, group=group)
    dist.send(torch.as_tensor(list(token_ids), dtype=torch.long, device=device), dst, group=group)
    index = _pages(pages, device)
    dist.send(torch.stack([c.index_cache[index] for c in caches]).contiguous(), dst, group=group)
    if caches[0].index_scale is not None:
        dist.send(torch.stack([c.index_scale[index] for c in caches]).contiguous(), dst, group=group)
    for cache in caches:
        dist.send(torch.stack([cache.k_cache[index], cache.v_cache[index]]).contiguous(), dst, group=group)


def receive_session(caches: list[LayerKVCache], allocate, src: int, group: dist.ProcessGroup | None = None
                    ) -> tuple[list[int], list[int]]:
    """Receive a sequence sent by `send_session` from rank `src` → (its token ids, the physical
    pages it now occupies here, in logical order). allocate(n) → n free physical pages."""
    device = caches[0].k_cache.device
    header = torch.empty(2, dtype=torch.long, device=device)
    dist.recv(header, src, group=group)
    num_tokens, num_pages = header.tolist()
    tokens = torch.empty(num_tokens, dtype=torch.long, device=device)
    dist.recv(tokens, src, group=group)
    pages = list(allocate(num_pages))
    index = _pages(pages, device)
    first = caches[0]
    ix = torch.empty(len(caches), num_pages, *first.index_cache.shape[1:], dtype=first.index_cache.dtype,
                     device=device)
    dist.recv(ix, src, group=group)
    for layer, cache in enumerate(caches):
        cache.index_cache[index] = ix[layer]
    if first.index_scale is not None:
        scale = torch.empty(len(caches), num_pages, *first.index_scale.shape[1:],
                            dtype=first.index_scale.dtype, device=device)
        dist.recv(scale, src, group=group)
        for layer, cache in enumerate(caches):
            cache.index_scale[index] = scale[layer]
    kv = torch.empty(2, num_pages, *first.k_cache.shape[1:], dtype=first.k_cache.dtype, device=device)
    for cache in caches:
        dist.recv(kv, src, group=group)
        cache.k_cache[index] = kv[0]
        cache.v_cache[index] = kv[1]
    return tokens.tolist(), pages
