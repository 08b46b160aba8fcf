"""Expert parallelism for MiniMax-M3's mixture of experts: the routed experts are spread over the
ep ranks (E/ep whole experts each, their intermediate width split over the tp ranks), tokens go to
the rank of each expert they chose and come back with one all-to-all each way.

Every rank holds every token after attention (attention is tensor parallel). Rank e of an ep group
of n takes token slice e (⌈T/n⌉ rows), routes it, dispatches one row per (token, chosen expert)
to the expert's rank (all_to_all_single, variable splits), runs its local experts, sends the rows
back, weights and sums them per token, and the ep group all-gathers the slices. The result is the
routed output partial over the tp group; the shared expert (tp-split) adds its partial and one
all-reduce over the tp group finishes the block.
"""

import functools

import torch
import torch.distributed as dist
from torch import nn

from msaserve.engine.parallel.comm import RankGroups, all_reduce
from msaserve.engine.parallel.tp import shard_dense_mlp, split_down, split_gate_up
from msaserve.kernels.moe import MoeOps, get_moe_ops


@functools.cache
def _moe_ops(device_type: str) -> MoeOps:
    return get_moe_ops(device_type)  # resolved once per device type, as the model does


class ParallelMoE(nn.Module):
    """Drop-in for M3SparseMoE on one rank (same forward: x [T, H] → [T, H])."""

    def __init__(self, moe: nn.Module, groups: RankGroups) -> None:
        super().__init__()
        layout = groups.layout
        tp, tp_rank, ep, ep_rank = layout.tp, groups.tp_rank, layout.ep, groups.ep_rank
        self.tp_group, self.ep_group, self.ep_size, self.ep_rank = groups.tp, groups.ep, ep, ep_rank
        self.routed_scaling_factor = moe.routed_scaling_factor
        self.gate = moe.gate  # the router is replicated: every rank routes its own token slice
        experts = moe.experts
        self.alpha, self.limit = experts.alpha, experts.limit
        num_experts = experts.gate_up_proj.shape[0]
        self.experts_per_rank = num_experts // ep
        mine = slice(ep_rank * self.experts_per_rank, (ep_rank + 1) * self.experts_per_rank)
        self.gate_up_proj = nn.Parameter(split_gate_up(experts.gate_up_proj.data[mine], tp, tp_rank),
                                         requires_grad=False)  # [E/ep, 2I/tp, H]
        self.down_proj = nn.Parameter(split_down(experts.down_proj.data[mine], tp, tp_rank),
                                      requires_grad=False)  # [E/ep, H, I/tp]
        self.shared_experts = moe.shared_experts
        shard_dense_mlp(self.shared_experts, tp, tp_rank, group=None)  # reduced with the routed part

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared_experts(x)
        routed = self._routed(x) * self.routed_scaling_factor
        return all_reduce(routed + shared, self.tp_group)

    def _routed(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] (every token) → Σ_k w_k · expert_k(x), partial over the tp group, [T, H]."""
        num_tokens, n = x.shape[0], self.ep_size
        chunk = -(-num_tokens // n)
        mine = x[self.ep_rank * chunk : (self.ep_rank + 1) * chunk]  # [Tm, H], Tm ≤ chunk
        weights, ids = self.gate(mine)  # [Tm, k] fp32, [Tm, k] int64
        out = self._dispatch_compute_combine(mine, weights, ids)
        if self.ep_group is None:
            return out
        padded = torch.zeros(chunk, x.shape[1], dtype=out.dtype, device=out.device)
        padded[: out.shape[0]] = out
        slices = [torch.empty_like(padded) for _ in range(n)]
        dist.all_gather(slices, padded, group=self.ep_group)
        return torch.cat(slices)[:num_tokens]

    def _local_experts(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """rows [N, H], each for one local expert local_ids [N] → its expert's output [N, H]."""
        ops = _moe_ops(rows.device.type)
        ones = torch.ones(rows.shape[0], 1, dtype=torch.float32, device=rows.device)
        return ops.experts(rows, self.gate_up_proj, self.down_proj, local_ids[:, None], ones,
                           self.alpha, self.limit)

    def _dispatch_compute_combine(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
                                  ) -> torch.Tensor:
        if self.ep_group is None:  # every expert is here: the model's own path (grouped on CUDA)
            ops = _moe_ops(x.device.type)
            return ops.experts(x, self.gate_up_proj, self.down_proj, ids, weights, self.alpha, self.limit)
        top_k = ids.shape[1]
        flat_ids = ids.reshape(-1)  # [Tm·k], pair p is (token p // k, slot p % k)
        dest = flat_ids // self.experts_per_rank
        order = torch.argsort(dest, stable=True)  # pairs grouped by destination rank
        send_counts = torch.bincount(dest, minlength=self.ep_size)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.ep_group)
        send_split, recv_split = send_counts.tolist(), recv_counts.tolist()
        send_rows = x[order // top_k]  # [Tm·k, H]
        recv_rows = x.new_empty(sum(recv_split), x.shape[1])
        dist.all_to_all_single(recv_rows, send_rows, recv_split, send_split, group=self.ep_group)
        send_local = flat_ids[order] - dest[order] * self.experts_per_rank
        recv_local = torch.empty(sum(recv_split), dtype=torch.int64, device=x.device)
        dist.all_to_all_single(recv_local, send_local, recv_split, send_split, group=self.ep_group)
        computed = self._local_experts(recv_rows, recv_local)
        back = x.new_empty(send_rows.shape)
        dist.all_to_all_single(back, computed, send_split, recv_split, group=self.ep_group)
        rows = torch.empty_like(back)
        rows[order] = back  # back in (token, slot) order
        return _weighted_sum(rows, weights)


def _weighted_sum(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """rows [Tm·k, H] in (token, slot) order, weights [Tm, k] fp32 → [Tm, H] in rows' dtype."""
    num_tokens, top_k = weights.shape
    weighted = rows.view(num_tokens, top_k, rows.shape[-1]).float() * weights[..., None]
    return weighted.sum(dim=1).to(rows.dtype)
