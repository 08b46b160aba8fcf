"""Random paged MSA inputs for the Triton kernel tests (CPU interpreter and GPU) and the benchmark.

All of them build caches the same way: scattered physical pages, fresh random values, optional fp8
index keys quantised exactly as `LayerKVCache.write_index` does.
"""

from dataclasses import dataclass

import torch
from kernel_testing import scattered_block_tables

from msaserve.kernels.indexer_prefill.naive import block_scores, gather_pages


@dataclass
class PagedInputs:
    """One layer's caches for a batch of sequences."""

    k_cache: torch.Tensor  # [num_pages, P, Hkv, D]
    v_cache: torch.Tensor  # [num_pages, P, Hkv, D]
    index_cache: torch.Tensor  # [num_pages, P, HkI, DI]
    index_scale: torch.Tensor | None  # [num_pages, P, HkI] fp32 when index_cache is fp8
    block_tables: torch.Tensor  # [B, max_pages] int32, -1 past each sequence
    seq_lens: torch.Tensor  # [B] int32


def make_paged_inputs(
    seq_lens: list[int], page_size: int, num_kv_heads: int, head_dim: int, index_heads: int,
    index_dim: int, dtype: torch.dtype, device: torch.device | str, fp8_index: bool = False,
    spare_pages: int = 3, generator: torch.Generator | None = None,
) -> PagedInputs:
    """Random caches with each sequence's pages scattered over a shuffled pool."""
    device = torch.device(device)
    num_pages = sum((n + page_size - 1) // page_size for n in seq_lens) + spare_pages
    if generator is None:
        generator = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,))))
    tables = scattered_block_tables(seq_lens, page_size, num_pages, generator).to(device)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    k_cache = rand(num_pages, page_size, num_kv_heads, head_dim)
    v_cache = rand(num_pages, page_size, num_kv_heads, head_dim)
    index_keys = rand(num_pages, page_size, index_heads, index_dim)
    index_scale = None
    if fp8_index:
        fp8 = torch.float8_e4m3fn
        index_scale = index_keys.float().abs().amax(dim=-1).clamp(min=1e-12) / torch.finfo(fp8).max
        index_keys = (index_keys.float() / index_scale[..., None]).to(fp8)
    return PagedInputs(k_cache, v_cache, index_keys, index_scale, tables,
                       torch.tensor(seq_lens, dtype=torch.int32, device=device))


def reference_scores(
    q_index: torch.Tensor, inputs: PagedInputs, cu_seqlens_q: torch.Tensor
) -> torch.Tensor:
    """fp32 block scores [Tq, Hkv, max_blocks] (the spec's `block_scores`, -inf past each row's
    sequence), the `scores` argument of `testing.selections_match`."""
    page_size = inputs.index_cache.shape[1]
    max_blocks = inputs.block_tables.shape[1]
    out = torch.full((q_index.shape[0], q_index.shape[1], max_blocks), float("-inf"), device=q_index.device)
    for b in range(inputs.block_tables.shape[0]):
        start, end = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        length = int(inputs.seq_lens[b])
        keys = gather_pages(inputs.index_cache, inputs.block_tables[b], length).float()
        if inputs.index_scale is not None:
            keys = keys * gather_pages(inputs.index_scale[..., None], inputs.block_tables[b], length)
        positions = torch.arange(length - (end - start), length, device=q_index.device)
        scores = block_scores(q_index[start:end], keys, positions, page_size)
        out[start:end, :, : scores.shape[2]] = scores
    return out
