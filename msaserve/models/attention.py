"""GQA attention with the MSA index branch (docs/design.md §2): write K/V/index-K, select blocks, attend.

Shapes and conventions of the ops: `msaserve/kernels/__init__.py` and each op's naive.py.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from msaserve.kernels import AttentionOps
from msaserve.kernels.layer_ops import LayerOps
from msaserve.models.cache import LayerKVCache
from msaserve.models.config import MSAConfig
from msaserve.models.layers import fuse_linear_weights
from msaserve.models.metadata import AttentionMetadata


@dataclass(frozen=True)
class RotaryTables:
    """cos/sin at this step's positions, computed once per forward and shared by all layers."""

    cos: torch.Tensor
    """[T, 1, D]"""
    sin: torch.Tensor
    """[T, 1, D]"""
    index_cos: torch.Tensor
    """[T, 1, DI]"""
    index_sin: torch.Tensor
    """[T, 1, DI]"""


class MSAAttention(nn.Module):
    def __init__(self, config: MSAConfig) -> None:
        super().__init__()
        self.config = config
        hidden, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.dense = False
        """Attend densely under every backend (MSATransformer sets it for config.dense_layers)."""
        self.q_proj = nn.Linear(hidden, config.num_heads * d, bias=False)
        self.k_proj = nn.Linear(hidden, config.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(hidden, config.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(config.num_heads * d, hidden, bias=False)
        if config.index_source == "learned":
            di = config.index_head_dim
            self.index_q_proj = nn.Linear(hidden, config.num_kv_heads * di, bias=False)
            self.index_k_proj = nn.Linear(hidden, config.num_index_heads * di, bias=False)
        self.fused_weight: torch.Tensor | None = None
        """[Σ outputs, H] once `fuse_projections` ran: q, k, v, index-K (learned), then index-Q
        if fused (sparse backends), in one GEMM."""
        self._fused_sizes: list[int] = []

    def fuse_projections(self, index_queries: bool) -> None:
        """One GEMM for the projections every step needs: q, k, v and (learned index) index-K,
        plus index-Q when `index_queries` (the dense backend never reads it)."""
        linears = [self.q_proj, self.k_proj, self.v_proj]
        if self.config.index_source == "learned" and not self.dense:
            linears.append(self.index_k_proj)
            if index_queries:
                linears.append(self.index_q_proj)
        self._fused_sizes = [linear.out_features for linear in linears]
        self.fused_weight = fuse_linear_weights(*linears)

    def forward(
        self,
        x: torch.Tensor,
        meta: AttentionMetadata,
        cache: LayerKVCache,
        rotary: RotaryTables,
        ops: AttentionOps,
        layer_ops: LayerOps,
    ) -> torch.Tensor:
        """x [T, H] → [T, H]."""
        c, num_tokens = self.config, x.shape[0]
        q, k, v, index_k, index_q = self._project(x)
        slots = meta.slot_mapping
        # The index keys are written under every backend so that a cache (and the pages the KV
        # cache service keeps) holds the same content whichever backend produced it; fp8 index
        # caches quantize per key (LayerKVCache.write_index) instead of a plain store. A dense layer
        # (config.dense_layers) has no index branch: it projects and writes no index keys.
        index_caches = (cache.index_cache,) if cache.index_scale is None and not self.dense else ()
        # (a dense layer reads every page: its K/V stay at their logical slot even then)
        kv_slots = slots if meta.kv_slot_mapping is None or self.dense else meta.kv_slot_mapping
        layer_ops.rotary_and_write(q, rotary.cos, rotary.sin, True)
        if index_k is None and index_caches and kv_slots is not slots:  # one write per slot mapping
            layer_ops.rotary_and_write(k, rotary.cos, rotary.sin, True, kv_slots, (cache.k_cache,))
            layer_ops.rotary_and_write(k, rotary.cos, rotary.sin, False, slots, index_caches)
        else:
            key_caches = (cache.k_cache, *(index_caches if index_k is None else ()))
            layer_ops.rotary_and_write(k, rotary.cos, rotary.sin, True, kv_slots, key_caches)
        layer_ops.rotary_and_write(v, rotary.cos, rotary.sin, False, kv_slots, (cache.v_cache,))
        if index_k is not None:
            layer_ops.rotary_and_write(index_k, rotary.index_cos, rotary.index_sin, True, slots, index_caches)
        if cache.index_scale is not None and not self.dense:
            cache.write_index(slots, k if index_k is None else index_k)
        if ops.sparse and not self.dense:
            index_q = self._index_queries(x, q, index_q, rotary, layer_ops)
            out = attend_sparse(c, q, index_q, meta, cache, ops)
        else:
            out = attend_dense(c, q, meta, cache, ops)
        return self.o_proj(out.reshape(num_tokens, c.num_heads * c.head_dim))

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [T, H] → q [T, Hq, D], k, v [T, Hkv, D], index_k [T, HkI, DI] or None (index source
        "keys"), index_q [T, Hkv, DI] or None (not projected here). Fused: views of one output."""
        c, num_tokens = self.config, x.shape[0]
        learned = c.index_source == "learned" and not self.dense  # a dense layer has no index branch
        if self.fused_weight is not None:
            fused, parts, start = F.linear(x, self.fused_weight), [], 0
            for size in self._fused_sizes:  # slices, not torch.split: rotary writes them in place
                parts.append(fused[:, start:start + size])
                start += size
        else:
            parts = [self.q_proj(x), self.k_proj(x), self.v_proj(x)]
            parts += [self.index_k_proj(x)] if learned else []
        q = parts[0].view(num_tokens, c.num_heads, c.head_dim)
        k = parts[1].view(num_tokens, c.num_kv_heads, c.head_dim)
        v = parts[2].view(num_tokens, c.num_kv_heads, c.head_dim)
        index_k = parts[3].view(num_tokens, c.num_index_heads, c.index_head_dim) if learned else None
        index_q = parts[4].view(num_tokens, c.num_kv_heads, c.index_head_dim) if len(parts) > 4 else None
        return q, k, v, index_k, index_q

    def _index_queries(
        self, x: torch.Tensor, q: torch.Tensor, index_q: torch.Tensor | None, rotary: RotaryTables,
        layer_ops: LayerOps,
    ) -> torch.Tensor:
        """→ qI [T, Hkv, DI]: one index query per KV group (index_q: its unrotated projection,
        if the fused GEMM made it)."""
        c = self.config
        if c.index_source == "keys":  # mean of the group's post-rotary queries
            return q.view(q.shape[0], c.num_kv_heads, c.group_size, c.head_dim).mean(dim=2)
        if index_q is None:
            index_q = self.index_q_proj(x).view(x.shape[0], c.num_kv_heads, c.index_head_dim)
        return layer_ops.rotary_and_write(index_q, rotary.index_cos, rotary.index_sin, True)


def attend_dense(
    config: MSAConfig, q: torch.Tensor, meta: AttentionMetadata, cache: LayerKVCache, ops: AttentionOps
) -> torch.Tensor:
    """q [T, Hq, D] → o [T, Hq, D]: dense causal attention over the paged K/V (decode rows as
    [B, Q, Hq, D])."""
    c = config
    if meta.is_decode:
        batch, num_q = meta.num_seqs, int(meta.decode_query_len)
        return ops.dense_decode(
            q.view(batch, num_q, c.num_heads, c.head_dim), cache.k_cache, cache.v_cache,
            meta.block_tables, meta.seq_lens,
        )
    return ops.dense_prefill(
        q, cache.k_cache, cache.v_cache, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q
    )


def attend_sparse(
    config: MSAConfig,
    q: torch.Tensor,
    index_q: torch.Tensor,
    meta: AttentionMetadata,
    cache: LayerKVCache,
    ops: AttentionOps,
) -> torch.Tensor:
    """q [T, Hq, D], index_q [T, Hkv, DI] → o [T, Hq, D]; records the selection if asked."""
    c = config
    if meta.is_decode:
        batch, num_q = meta.num_seqs, int(meta.decode_query_len)
        selected = ops.indexer_decode(
            index_q.view(batch, num_q, c.num_kv_heads, c.index_head_dim), cache.index_cache,
            meta.block_tables, meta.seq_lens, c.top_k, c.n_init, cache.index_scale, n_local=c.n_local,
        )  # [B, Q, Hkv, K]
        out = ops.sparse_decode(
            q.view(batch, num_q, c.num_heads, c.head_dim), cache.k_cache, cache.v_cache,
            meta.block_tables, meta.seq_lens, selected,
        )
        selected = selected.view(q.shape[0], c.num_kv_heads, c.top_k)
    else:
        selected = ops.indexer_prefill(
            index_q, cache.index_cache, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q,
            c.top_k, c.n_init, cache.index_scale, n_local=c.n_local,
        )  # [T, Hkv, K]
        out = ops.sparse_prefill(
            q, cache.k_cache, cache.v_cache, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q,
            selected,
        )
    if isinstance(meta.selections, list):
        meta.selections.append(selected)
    return out
