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
from torch import nn

from msaserve.kernels import AttentionOps
from msaserve.kernels.rotary import rotate_half
from msaserve.models.attention import attend_dense, attend_sparse
from msaserve.models.cache import LayerKVCache
from msaserve.models.metadata import AttentionMetadata
from msaserve.models.minimax_m3.config import M3Config
from msaserve.models.minimax_m3.layers import M3RMSNorm


@dataclass(frozen=True)
class M3Rotary:
    """cos/sin [T, 1, rotary_dim] at this step's positions, shared by every layer."""

    cos: torch.Tensor
    sin: torch.Tensor


def rotate_partial(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos, sin [T, 1, r ≤ D] → the first r channels rotated (rotate_half layout),
    the other D - r passed through (transformers' apply_rotary_pos_emb)."""
    r = cos.shape[-1]
    turned = x[..., :r]
    turned = turned * cos + rotate_half(turned) * sin
    return torch.cat([turned, x[..., r:]], dim=-1) if r < x.shape[-1] else turned


def write_slots(cache: torch.Tensor, slot_mapping: torch.Tensor, heads: torch.Tensor) -> None:
    """cache [num_pages, P, H, D] gets heads [T, H, D] at slot_mapping [T] int64."""
    page_size = cache.shape[1]
    cache[slot_mapping // page_size, slot_mapping % page_size] = heads.to(cache.dtype)


class M3Indexer(nn.Module):
    """The index projections of a sparse layer (transformers' names: q_proj, k_proj, q_norm, k_norm)."""

    def __init__(self, config: M3Config) -> None:
        super().__init__()
        self.config = config
        di = config.index_head_dim
        self.q_proj = nn.Linear(config.hidden_size, config.num_kv_heads * di, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, di, bias=False)
        self.q_norm = M3RMSNorm(di, config.rms_norm_eps)
        self.k_norm = M3RMSNorm(di, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, rotary: M3Rotary) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] → (index queries [T, Hkv, DI], index keys [T, 1, DI]), normed and rotated."""
        c, num_tokens = self.config, x.shape[0]
        di = c.index_head_dim
        q = self.q_norm(self.q_proj(x).view(num_tokens, c.num_kv_heads, di))
        k = self.k_norm(self.k_proj(x).view(num_tokens, 1, di))
        cos, sin = rotary.cos[..., :di], rotary.sin[..., :di]
        return rotate_partial(q, cos, sin), rotate_partial(k, cos, sin)


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

    def forward(
        self, x: torch.Tensor, meta: AttentionMetadata, cache: LayerKVCache, rotary: M3Rotary,
        ops: AttentionOps,
    ) -> torch.Tensor:
        """x [T, H] → [T, H]."""
        c, num_tokens = self.config, x.shape[0]
        q = self.q_norm(self.q_proj(x).view(num_tokens, c.num_heads, c.head_dim))
        k = self.k_norm(self.k_proj(x).view(num_tokens, c.num_kv_heads, c.head_dim))
        v = self.v_proj(x).view(num_tokens, c.num_kv_heads, c.head_dim)
        q, k = rotate_partial(q, rotary.cos, rotary.sin), rotate_partial(k, rotary.cos, rotary.sin)
        kv_slots = meta.slot_mapping if meta.kv_slot_mapping is None else meta.kv_slot_mapping
        write_slots(cache.k_cache, kv_slots, k)  # K/V may live in a pool of their own (sparse residency)
        write_slots(cache.v_cache, kv_slots, v)
        if self.indexer is not None:  # index keys are written whichever backend attends
            index_q, index_k = self.indexer(x, rotary)
            cache.write_index(meta.slot_mapping, index_k)
            if ops.sparse:
                out = attend_sparse(c, q, index_q, meta, cache, ops)
                return self.o_proj(out.reshape(num_tokens, c.num_heads * c.head_dim))
        out = attend_dense(c, q, meta, cache, ops)
        return self.o_proj(out.reshape(num_tokens, c.num_heads * c.head_dim))

