"""Baselines and timing helpers for bench_msa.py: ceilings (copy bandwidth, bf16 GEMM), dense SDPA,
and flex_attention computing the MSA output from a selection.

flex_attention gets a BlockMask built from the union of each 128-query tile's selected blocks
(per KV head, shared by the group's query heads) plus a mask_mod that reads the per-token
selection and the causal limit, so it computes exactly the MSA output.
"""

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, flex_attention

_flex = torch.compile(flex_attention, dynamic=False)

# Synthetic index data with locality, as real index branches have: every page's keys share a random
# direction (topic) and every 128-position tile of queries shares one; per-key and per-query noise
# on top. Neighbouring queries then choose overlapping blocks, so the union per 128-query tile stays
# small (reported as flex_union_blocks_per_tile). Purely random data makes every tile's union dense.
PAGE_BIAS = 1.0
QUERY_NOISE = 0.25


def index_keys(num_pages: int, page_size: int, heads: int, dim: int, device: str = "cuda") -> torch.Tensor:
    """[num_pages, P, HkI, DI] bf16."""
    keys = torch.randn(num_pages, page_size, heads, dim, device=device)
    keys += PAGE_BIAS * torch.randn(num_pages, 1, heads, dim, device=device)
    return keys.to(torch.bfloat16)


def index_queries(num_tokens: int, first_pos: int, page_size: int, heads: int, dim: int,
                  device: str = "cuda") -> torch.Tensor:
    """[Tq, H, DI] bf16 for positions first_pos..: one direction per position tile plus noise."""
    tiles = (first_pos + num_tokens + page_size - 1) // page_size - first_pos // page_size
    base = torch.randn(tiles, heads, dim, device=device)
    positions = torch.arange(first_pos, first_pos + num_tokens, device=device)
    tile_of = positions // page_size - first_pos // page_size
    q = base[tile_of] + QUERY_NOISE * torch.randn(num_tokens, heads, dim, device=device)
    return q.to(torch.bfloat16)


def indexer_causal_flops(first: int, count: int, page_size: int, heads: int, dim: int) -> float:
    """The prefill indexer's q·k FLOPs for `count` queries from position `first`: each query scores
    the keys of its blocks up to its own (whole pages, as the kernels read them), `heads` rows each."""
    positions = torch.arange(first, first + count, dtype=torch.float64)
    keys = (torch.div(positions, page_size, rounding_mode="floor") + 1) * page_size
    return float(keys.sum()) * heads * dim * 2


def bench_parser(doc: str) -> argparse.ArgumentParser:
    """The options every kernel benchmark script takes: --out DIR and --git-revision REV."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--git-revision", default="unknown")
    return parser


def decode_index_inputs(batch: int, context: int, page_size: int, key_heads: int, dim: int,
                        heads: int) -> dict:
    """Decode-indexer inputs, one query per sequence at position context - 1: block tables over
    shuffled pages, bf16 index keys and their fp8-e4m3 copy with per-token scales.
    → {"tables", "keys", "keys8", "scale", "seq_lens", "q" [B, 1, heads, dim]}."""
    pages_per_seq = context // page_size
    num_pages = batch * pages_per_seq
    tables = torch.randperm(num_pages, device="cuda").to(torch.int32).view(batch, pages_per_seq)
    keys = index_keys(num_pages, page_size, key_heads, dim)
    scale = keys.float().abs().amax(-1).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    keys8 = (keys.float() / scale[..., None]).to(torch.float8_e4m3fn)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = index_queries(batch, context - 1, page_size, heads, dim).view(batch, 1, heads, dim)
    return {"tables": tables, "keys": keys, "keys8": keys8, "scale": scale, "seq_lens": seq_lens, "q": q}


def indexer_decode_config_name(cfg: object) -> str:
    """A decode-indexer autotune config (triton.Config) as one line; "?" for None."""
    if cfg is None:
        return "?"
    kw = cfg.kwargs
    return f"PAGES={kw['PAGES']} PREFETCH={kw['PREFETCH']} warps={cfg.num_warps} stages={cfg.num_stages}"


def time_ms(fn: Callable[[], object], reps: int = 10, warmup: int = 2) -> float:
    """Median of `reps` event-timed calls after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_graph_ms(fn: Callable[[], object], reps: int = 20, warm_s: float = 0.05) -> float:
    """Capture `fn` in a CUDA graph (after two eager warm-ups) and time its replays (median).

    Before timing, the graph replays back to back for about `warm_s` seconds: on the H200 the first
    sub-millisecond kernel timed after a pause (compiling, autotuning, host work) could read 10-15 %
    slow: at git ae310cf the decode indexer timed 0.568 ms first in its run and 0.493 ms for another
    load path right after, while the whole decode steps containing each differed by 0.6 %."""
    fn()
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    start = time.perf_counter()
    graph.replay()
    torch.cuda.synchronize()
    once = time.perf_counter() - start
    return time_ms(graph.replay, reps=reps, warmup=max(3, min(2000, int(warm_s / max(once, 1e-6)))))


def copy_bandwidth_tbps(gib: float = 4.0) -> float:
    """Device-to-device copy, counting bytes read plus written."""
    n = int(gib * 2**30) // 4
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), reps=10)
    return 2 * n * 4 / (ms * 1e-3) / 1e12


def gemm_tflops(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b, reps=10)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """q [B, Hq, Tq, D]; k, v [B, Hkv, T, D] contiguous; flash backend."""
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


SDPA_BACKENDS_USED: set[str] = set()


def sdpa_any(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """Flash when it accepts the call, else whatever SDPA picks (recorded in SDPA_BACKENDS_USED)."""
    try:
        out = sdpa(q, k, v, causal)
        SDPA_BACKENDS_USED.add(f"flash (q_len={q.shape[2]})")
        return out
    except RuntimeError:
        SDPA_BACKENDS_USED.add(f"default, flash refused (q_len={q.shape[2]})")
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


class FlexMSA:
    """flex_attention over a fixed (Tq, kv_len) frame; one mask_mod object, buffers updated in place,
    so the compiled kernel is reused for every chunk (keys past a chunk's length are masked)."""

    def __init__(self, num_kv_heads: int, num_tokens: int, kv_len: int, group: int, page_size: int):
        self.group, self.page_size = group, page_size
        self.num_tokens, self.kv_len = num_tokens, kv_len
        self.num_blocks = (kv_len + page_size - 1) // page_size
        self.token_sel = torch.zeros(num_kv_heads, num_tokens, self.num_blocks, dtype=torch.bool,
                                     device="cuda")
        self.first_pos = torch.zeros((), dtype=torch.int64, device="cuda")
        token_sel, first_pos = self.token_sel, self.first_pos

        def mask_mod(b, h, q_idx, kv_idx):
            allowed = token_sel[h // group, q_idx, kv_idx // page_size]
            return allowed & (kv_idx <= q_idx + first_pos)

        self.mask_mod = mask_mod

    def block_mask(self, selected: torch.Tensor, first_pos: int) -> tuple[BlockMask, float]:
        """selected: [Tq, Hkv, K] block ids (-1 pad) → (mask, mean union blocks per 128-query tile)."""
        num_kv_heads = selected.shape[1]
        nb, page = self.num_blocks, self.page_size
        full = torch.zeros(num_kv_heads, self.num_tokens, nb + 1, dtype=torch.bool, device="cuda")
        index = torch.where(selected < 0, nb, selected).long().permute(1, 0, 2)  # [Hkv, Tq, K]
        full.scatter_(2, index, True)
        self.token_sel.copy_(full[..., :nb])
        self.first_pos.fill_(first_pos)
        q_tiles = self.num_tokens // page
        tile_union = self.token_sel.view(num_kv_heads, q_tiles, page, nb).any(dim=2)  # [Hkv, qt, nb]
        counts = tile_union.sum(-1).to(torch.int32)
        order = torch.argsort(tile_union.to(torch.int8), dim=-1, descending=True, stable=True)
        kv_num_blocks = counts.repeat_interleave(self.group, dim=0)[None]  # [1, Hq, qt]
        kv_indices = order.to(torch.int32).repeat_interleave(self.group, dim=0)[None]  # [1, Hq, qt, nb]
        mask = BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, BLOCK_SIZE=page, mask_mod=self.mask_mod,
                                        seq_lengths=(self.num_tokens, self.kv_len))
        return mask, float(counts.float().mean())


def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask) -> torch.Tensor:
    """q [1, Hq, Tq, D]; k, v [1, Hkv, T, D]."""
    return _flex(q, k, v, block_mask=mask, enable_gqa=True)
