"""GQA attention with the MSA index branch (DESIGN §2): write K/V/index-K, select blocks, attend.

Shapes and conventions of the ops: `msaserve/kernels/__init__.py` and each op's naive.py.
"""

from dataclasses import dataclass

import torch
from torch import nn

from msaserve.kernels import AttentionOps
from msaserve.models.cache import LayerKVCache
from msaserve.models.config import MSAConfig
from msaserve.models.metadata import AttentionMetadata
from msaserve.models.rotary import apply_rotary


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
        self.q_proj = nn.Linear(hidden, config.num_heads * d, bias=False)
        self.k_proj = nn.Linear(hidden, config.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(hidden, config.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(config.num_heads * d, hidden, bias=False)
        if config.index_source == "learned":
            di = config.index_head_dim
            self.index_q_proj = nn.Linear(hidden, config.num_kv_heads * di, bias=False)
            self.index_k_proj = nn.Linear(hidden, config.num_index_heads * di, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        meta: AttentionMetadata,
        cache: LayerKVCache,
        rotary: RotaryTables,
        ops: AttentionOps,
    ) -> torch.Tensor:
        """x [T, H] → [T, H]."""
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, rotary.cos, rotary.sin), apply_rotary(k, rotary.cos, rotary.sin)
        # The index keys are written under every backend so that a cache (and the pages the KV
        # cache service keeps) holds the same content whichever backend produced it.
        index_k = self._index_keys(x, k, rotary)  # [T, HkI, DI]
        cache.write(meta.slot_mapping, k, v, index_k)
        if ops.sparse:
            out = self._sparse(q, self._index_queries(x, q, rotary), meta, cache, ops)
        elif meta.is_decode:
            batch, num_q = meta.num_seqs, int(meta.decode_query_len)
            out = ops.dense_decode(
                q.view(batch, num_q, self.num_heads, self.head_dim), cache.k_cache, cache.v_cache,
                meta.block_tables, meta.seq_lens,
            )
        else:
            out = ops.dense_prefill(
                q, cache.k_cache, cache.v_cache, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q
            )
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))

    def _index_keys(self, x: torch.Tensor, k: torch.Tensor, rotary: RotaryTables) -> torch.Tensor:
        if self.config.index_source == "keys":
            return k  # post-rotary keys: HkI = Hkv, DI = D
        c = self.config
        index_k = self.index_k_proj(x).view(x.shape[0], c.num_index_heads, c.index_head_dim)
        return apply_rotary(index_k, rotary.index_cos, rotary.index_sin)

    def _index_queries(self, x: torch.Tensor, q: torch.Tensor, rotary: RotaryTables) -> torch.Tensor:
        """→ qI [T, Hkv, DI]: one index query per KV group."""
        c = self.config
        if c.index_source == "keys":  # mean of the group's post-rotary queries
            return q.view(q.shape[0], c.num_kv_heads, c.group_size, c.head_dim).mean(dim=2)
        index_q = self.index_q_proj(x).view(x.shape[0], c.num_kv_heads, c.index_head_dim)
        return apply_rotary(index_q, rotary.index_cos, rotary.index_sin)

    def _sparse(
        self,
        q: torch.Tensor,
        index_q: torch.Tensor,
        meta: AttentionMetadata,
        cache: LayerKVCache,
        ops: AttentionOps,
    ) -> torch.Tensor:
        """q [T, Hq, D], index_q [T, Hkv, DI] → o [T, Hq, D]; records the selection if asked."""
        c = self.config
        if meta.is_decode:
            batch, num_q = meta.num_seqs, int(meta.decode_query_len)
            selected = ops.indexer_decode(
                index_q.view(batch, num_q, c.num_kv_heads, c.index_head_dim), cache.index_cache,
                meta.block_tables, meta.seq_lens, c.top_k, c.n_init, cache.index_scale,
            )  # [B, Q, Hkv, K]
            out = ops.sparse_decode(
                q.view(batch, num_q, c.num_heads, c.head_dim), cache.k_cache, cache.v_cache,
                meta.block_tables, meta.seq_lens, selected,
            )
            selected = selected.view(q.shape[0], c.num_kv_heads, c.top_k)
        else:
            selected = ops.indexer_prefill(
                index_q, cache.index_cache, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q,
                c.top_k, c.n_init, cache.index_scale,
            )  # [T, Hkv, K]
            out = ops.sparse_prefill(
                q, cache.k_cache, cache.v_cache, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q,
                selected,
            )
        if isinstance(meta.selections, list):
            meta.selections.append(selected)
        return out
