"""Tensor parallelism for MiniMax-M3's attention and dense MLPs: column splits in, row splits out,
one all-reduce per block (Megatron's layout).

Attention: rank t keeps query heads [t·Hq/tp, (t+1)·Hq/tp) and the KV heads they read. With
Hkv ≥ tp each rank has Hkv/tp KV heads; with Hkv < tp (M3: Hkv = 4, TP 8) tp/Hkv ranks share one
KV head, each holding it (replicated). The rank's index-query heads are those of its KV heads;
the one shared index-K head is computed and cached on every rank. So each rank's page pool holds
only its KV heads' pages and the index pages once (`local_config` sizes the pool).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from msaserve.engine.parallel.comm import all_reduce
from msaserve.models.minimax_m3.config import M3Config


@dataclass(frozen=True)
class HeadShard:
    q_heads: slice
    """Query heads of this rank (global ids)."""
    kv_heads: slice
    """KV heads of this rank (global ids); the same head on several ranks when Hkv < tp."""


def head_shard(config: M3Config, tp: int, tp_rank: int) -> HeadShard:
    hq, hkv = config.num_heads, config.num_kv_heads
    per_rank = hq // tp
    q_heads = slice(tp_rank * per_rank, (tp_rank + 1) * per_rank)
    if hkv >= tp:
        kv = hkv // tp
        return HeadShard(q_heads, slice(tp_rank * kv, (tp_rank + 1) * kv))
    head = tp_rank // (tp // hkv)
    return HeadShard(q_heads, slice(head, head + 1))


def local_config(config: M3Config, tp: int, tp_rank: int) -> M3Config:
    """The config one rank's attention and page pool see: its query and KV head counts."""
    shard = head_shard(config, tp, tp_rank)
    return config.model_copy(update=dict(
        num_heads=shard.q_heads.stop - shard.q_heads.start,
        num_kv_heads=shard.kv_heads.stop - shard.kv_heads.start,
    ))


def rows(weight: torch.Tensor, heads: slice, head_dim: int) -> torch.Tensor:
    """The output rows of `heads` of a [heads · head_dim, in] projection."""
    return weight[heads.start * head_dim : heads.stop * head_dim].clone()


def column_linear(weight: torch.Tensor) -> nn.Linear:
    # Built on the meta device: no random init (which would also touch the device's RNG, left
    # unusable on CUDA by a failed graph capture), then given the weight.
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta", dtype=weight.dtype)
    layer.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    return layer


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local · W_localᵀ): the rank's input columns, the sum over the group."""

    def __init__(self, weight: torch.Tensor, group) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(F.linear(x, self.weight), self.group)


def shard_attention(attn: nn.Module, config: M3Config, tp: int, tp_rank: int, group) -> None:
    """Cut an M3Attention (and its indexer) down to this rank's heads, in place."""
    shard, d = head_shard(config, tp, tp_rank), config.head_dim
    local = local_config(config, tp, tp_rank)
    attn.q_proj = column_linear(rows(attn.q_proj.weight.data, shard.q_heads, d))
    attn.k_proj = column_linear(rows(attn.k_proj.weight.data, shard.kv_heads, d))
    attn.v_proj = column_linear(rows(attn.v_proj.weight.data, shard.kv_heads, d))
    o_weight = attn.o_proj.weight.data[:, shard.q_heads.start * d : shard.q_heads.stop * d]
    attn.o_proj = RowParallelLinear(o_weight.clone(), group)
    attn.config = local
    attn.fused_weight = None  # (fused earlier it views every head's rows); the runner fuses the shard
    if attn.indexer is not None:  # index queries: one per KV head; the index-K head stays whole
        di = config.index_head_dim
        attn.indexer.q_proj = column_linear(rows(attn.indexer.q_proj.weight.data, shard.kv_heads, di))
        attn.indexer.config = local


def split_gate_up(gate_up: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    """[..., 2I, H] (gate rows, then up rows) → this rank's [..., 2I/tp, H], gate then up."""
    gate, up = gate_up.chunk(2, dim=-2)
    width = gate.shape[-2] // tp
    part = slice(tp_rank * width, (tp_rank + 1) * width)
    return torch.cat([gate[..., part, :], up[..., part, :]], dim=-2).clone()


def split_down(down: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    """[..., H, I] → this rank's input columns [..., H, I/tp]."""
    width = down.shape[-1] // tp
    return down[..., tp_rank * width : (tp_rank + 1) * width].clone()


def shard_dense_mlp(mlp: nn.Module, tp: int, tp_rank: int, group) -> None:
    """Cut an M3DenseMLP to this rank's share of the intermediate width; with a group, its
    down projection sums over it (without one, the caller reduces: the MoE's shared expert)."""
    mlp.gate_up_proj = column_linear(split_gate_up(mlp.gate_up_proj.weight.data, tp, tp_rank))
    mlp.down_proj = RowParallelLinear(split_down(mlp.down_proj.weight.data, tp, tp_rank), group)
