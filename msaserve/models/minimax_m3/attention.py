"""MiniMax-M3 attention on msaserve's paged caches: per-head RMSNorm on q and k, partial rotary,
and on `minimax_m3_sparse` layers the MSA index branch in M3 form (docs/design.md §2).

Index branch: one index query per KV group (index_n_heads = Hkv) and ONE shared index-K head,
both RMS-normed and rotated with the first index_head_dim channels of the attention's cos/sin
(what transformers' MiniMaxM3VLIndexer does); block-max fp32 scores; n_init = 0 and the
n_local = index_local_blocks blocks ending at the query's block forced; -1 for unused slots.
`full_attention` layers attend densely through the ops' dense_prefill / dense_decode.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from msaserve.kernels import AttentionOps
from msaserve.kernels.layer_ops import naive as layer_naive
from msaserve.kernels.layer_ops.naive import M3HeadLayout
from msaserve.models.attention import attend_dense, attend_sparse
from msaserve.models.cache import LayerKVCache
from msaserve.models.layers import fuse_linear_weights
from msaserve.models.metadata import AttentionMetadata
from msaserve.models.minimax_m3.config import M3Config
from msaserve.models.minimax_m3.layers import M3RMSNorm


@dataclass(frozen=True)
class M3Rotary:
    """cos/sin [T, 1, rotary_dim] at this step's positions, shared by every layer."""

    cos: torch.Tensor
    sin: torch.Tensor


def attention_heads(projected: torch.Tensor, layout: M3HeadLayout, norm_weights: tuple[torch.Tensor, ...],
                    eps: float, cos: torch.Tensor, sin: torch.Tensor, kv_slots: torch.Tensor,
                    cache: LayerKVCache, index_slots: torch.Tensor, write_index: bool
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`layer_ops.naive.m3_attention_heads` (norms, partial rotary, K/V and index-K writes); on CUDA
    one launch (`layer_ops.triton`) where the caches take the activation dtype and the head dims are
    powers of two, the spec's PyTorch ops otherwise (fp8 caches, the CPU)."""
    index_cache = cache.index_cache if write_index else None
    caches = (cache.k_cache, cache.v_cache, index_cache)
    dims = (layout.head_dim, layout.index_dim or layout.head_dim)
    fused = (projected.is_cuda and all(t is None or t.dtype == projected.dtype for t in caches)
             and all(d & (d - 1) == 0 for d in dims))
    if fused:
        from msaserve.kernels.layer_ops import triton as layer_triton

        impl = layer_triton.m3_attention_heads
    else:
        impl = layer_naive.m3_attention_heads
    return impl(projected, layout, norm_weights, eps, cos, sin, kv_slots, cache.k_cache, cache.v_cache,
                index_slots, index_cache)


class M3Indexer(nn.Module):
    """The index projections of a sparse layer (transformers' names: q_proj, k_proj, q_norm, k_norm).
    M3Attention runs them: both projections inside its one GEMM, norms and rotary with its heads."""

    def __init__(self, config: M3Config) -> None:
        super().__init__()
        self.config = config
        di = config.index_head_dim
        self.q_proj = nn.Linear(config.hidden_size, config.num_kv_heads * di, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, di, bias=False)
        self.q_norm = M3RMSNorm(di, config.rms_norm_eps)
        self.k_norm = M3RMSNorm(di, config.rms_norm_eps)


class M3Attention(nn.Module):
    def __init__(self, config: M3Config, layer: int) -> None:
        super().__init__()
        self.config = config
        hidden, d = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(hidden, config.num_heads * d, bias=False)
        self.k_proj = nn.Linear(hidden, config.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(hidden, config.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(config.num_heads * d, hidden, bias=False)
        self.q_norm = M3RMSNorm(d, config.rms_norm_eps)
        self.k_norm = M3RMSNorm(d, config.rms_norm_eps)
        self.sparse = config.layer_types[layer] == "minimax_m3_sparse"
        self.indexer = M3Indexer(config) if self.sparse else None
        self.fused_weight: torch.Tensor | None = None
        """[Σ outputs, H] once `fuse_projections` ran: q, k, v, then index q and index k (sparse
        layers), one GEMM; each projection's weight is a view of its rows."""

    def _projections(self) -> list[nn.Linear]:
        indexer = [self.indexer.q_proj, self.indexer.k_proj] if self.indexer is not None else []
        return [self.q_proj, self.k_proj, self.v_proj, *indexer]

    def fuse_projections(self) -> None:
        """One GEMM for q, k, v and the index branch's q and k (idempotent); call it after loading
        and after any sharding (engine/parallel/tp.py replaces the projections)."""
        if self.fused_weight is None:
            self.fused_weight = fuse_linear_weights(*self._projections())

    def _layout(self) -> M3HeadLayout:
        c = self.config
        if self.indexer is None:
            return M3HeadLayout(c.num_heads, c.num_kv_heads, c.head_dim)
        return M3HeadLayout(c.num_heads, c.num_kv_heads, c.head_dim, c.num_kv_heads, c.num_index_heads,
                            c.index_head_dim)

    def _norm_weights(self) -> tuple[torch.Tensor, ...]:
        norms = [self.q_norm, self.k_norm]
        if self.indexer is not None:
            norms += [self.indexer.q_norm, self.indexer.k_norm]
        return tuple(norm.weight for norm in norms)

    def forward(
        self, x: torch.Tensor, meta: AttentionMetadata, cache: LayerKVCache, rotary: M3Rotary,
        ops: AttentionOps,
    ) -> torch.Tensor:
        """x [T, H] → [T, H]."""
        c, num_tokens = self.config, x.shape[0]
        if self.fused_weight is not None:
            projected = F.linear(x, self.fused_weight)  # [T, Σ outputs]
        else:
            projected = torch.cat([linear(x) for linear in self._projections()], dim=-1)
        # K/V may live in a pool of their own (sparse residency); index keys go to their logical
        # page, whichever backend attends, and an fp8 index cache quantizes each key (write_index).
        # A full_attention layer (no indexer) reads every page: its K/V stay at their logical slot.
        dense = self.indexer is None
        kv_slots = meta.slot_mapping if meta.kv_slot_mapping is None or dense else meta.kv_slot_mapping
        plain_index = cache.index_scale is None
        q, index_q, index_k = attention_heads(
            projected, self._layout(), self._norm_weights(), self.q_norm.eps, rotary.cos, rotary.sin,
            kv_slots, cache, meta.slot_mapping, write_index=plain_index and self.indexer is not None,
        )
        if index_k is not None and not plain_index:
            cache.write_index(meta.slot_mapping, index_k)
        if index_q is not None and ops.sparse:
            out = attend_sparse(c, q, index_q, meta, cache, ops)
        else:
            out = attend_dense(c, q, meta, cache, ops)
        return self.o_proj(out.reshape(num_tokens, c.num_heads * c.head_dim))
