"""The torch.distributed groups of one rank and the collectives the sharded layers call.

Every process of the world group must call `build_groups` (torch.distributed.new_group is
collective), in the same order. Every collective of the layers runs on these groups, with their
timeout: a rank that dies mid-step makes the others raise instead of hanging.
"""

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from msaserve.engine.parallel.layout import ParallelLayout


@dataclass
class RankGroups:
    """One rank's place in the layout and its groups (None where the group is this rank alone)."""

    layout: ParallelLayout
    rank: int
    tp: dist.ProcessGroup | None
    ep: dist.ProcessGroup | None

    @property
    def tp_rank(self) -> int:
        return self.layout.tp_rank(self.rank)

    @property
    def ep_rank(self) -> int:
        return self.layout.ep_rank(self.rank)


def build_groups(layout: ParallelLayout, rank: int, offset: int = 0,
                 timeout: datetime.timedelta | None = None) -> RankGroups | None:
    """Groups of `layout` over global ranks offset .. offset + world - 1; None for a process
    outside them (it still had to take part in creating them). timeout: of the groups'
    collectives (default: the world group's)."""
    def new(ranks: list[int]) -> dist.ProcessGroup | None:
        return None if len(ranks) == 1 else dist.new_group(ranks, timeout=timeout)

    tp_groups = [new([offset + r for r in layout.tp_group_ranks(e)]) for e in range(layout.ep)]
    ep_groups = [new([offset + r for r in layout.ep_group_ranks(t)]) for t in range(layout.tp)]
    local = rank - offset
    if not 0 <= local < layout.world_size:
        return None
    return RankGroups(layout, local, tp_groups[layout.ep_rank(local)], ep_groups[layout.tp_rank(local)])


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum x over `group` in place (nothing for a group of one)."""
    if group is not None:
        dist.all_reduce(x, group=group)
    return x
