"""Which rank holds which part of the model: `tensor_parallel_size` × `expert_parallel_size` ranks.

Rank r has tp_rank = r % tp and ep_rank = r // tp. Attention, the dense MLPs and the shared expert
are split over the tp ranks of one ep slice (the same split in every slice: without data-parallel
attention the slices compute the same attention); the routed experts are split over the ep ranks
(E / ep whole experts each) and, inside each, their intermediate width over the tp ranks.
"""

from dataclasses import dataclass

from msaserve.models.minimax_m3.config import M3Config


@dataclass(frozen=True)
class ParallelLayout:
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "expert_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelLayout.{name}={value!r} is invalid: allowed an integer ≥ 1")

    @property
    def tp(self) -> int:
        return self.tensor_parallel_size

    @property
    def ep(self) -> int:
        return self.expert_parallel_size

    @property
    def world_size(self) -> int:
        return self.tp * self.ep

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def ep_rank(self, rank: int) -> int:
        return rank // self.tp

    def tp_group_ranks(self, ep_rank: int) -> list[int]:
        """The ranks that split one copy of attention and the dense MLPs."""
        return [ep_rank * self.tp + t for t in range(self.tp)]

    def ep_group_ranks(self, tp_rank: int) -> list[int]:
        """The ranks among which the routed experts (and the tokens sent to them) are spread."""
        return [e * self.tp + tp_rank for e in range(self.ep)]

    def check(self, config: M3Config) -> None:
        """Raise ValueError naming the field when `config` cannot be split this way."""
        tp, ep = self.tp, self.ep
        hkv = config.num_kv_heads
        divisible = {
            "num_attention_heads": config.num_heads,
            "dense_intermediate_size": config.dense_intermediate_size,
            "shared_intermediate_size": config.shared_intermediate_size,
            "intermediate_size": config.intermediate_size,
        }
        for name, value in divisible.items():
            if value % tp:
                raise ValueError(f"{name}={value} is invalid for tensor_parallel_size={tp}: "
                                 "allowed a multiple of it")
        if hkv % tp and tp % hkv:
            raise ValueError(f"num_key_value_heads={hkv} is invalid for tensor_parallel_size={tp}: allowed "
                             "a multiple or a divisor of it (KV heads split, or replicated when fewer)")
        if config.num_experts % ep:
            raise ValueError(f"num_local_experts={config.num_experts} is invalid for "
                             f"expert_parallel_size={ep}: allowed a multiple of it")
