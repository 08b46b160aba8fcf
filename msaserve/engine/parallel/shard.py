"""Shard a loaded MiniMax-M3 text model for one rank, from outside the model code: every rank
builds (or loads) the same model, then keeps its part. The embedding, norms, router and LM head
stay whole on every rank."""

from torch import nn

from msaserve.engine.parallel.comm import RankGroups
from msaserve.engine.parallel.ep import ParallelMoE
from msaserve.engine.parallel.tp import local_config, shard_attention, shard_dense_mlp
from msaserve.models.minimax_m3.config import M3Config
from msaserve.models.minimax_m3.model import M3ForCausalLM


def shard_m3_model(model: nn.Module, groups: RankGroups) -> nn.Module:
    """Cut `model` (an M3ForCausalLM) down to rank `groups.rank`'s part, in place; its `config`
    becomes the rank's local config (its heads), so the runner sizes the rank's page pool."""
    if not isinstance(model, M3ForCausalLM):
        raise ValueError(f"model {type(model).__name__} cannot be sharded: allowed M3ForCausalLM "
                         "(tensor_parallel_size and expert_parallel_size > 1 serve MiniMax-M3 only)")
    config: M3Config = model.config
    layout = groups.layout
    layout.check(config)
    if model.visual is not None:
        raise ValueError("a model with a vision tower cannot be sharded yet: allowed text-only M3")
    tp, tp_rank = layout.tp, groups.tp_rank
    for i, layer in enumerate(model.layers):
        shard_attention(layer.self_attn, config, tp, tp_rank, groups.tp)
        if config.mlp_layer_types[i] == "sparse":
            layer.mlp = ParallelMoE(layer.mlp, groups)
        else:
            shard_dense_mlp(layer.mlp, tp, tp_rank, groups.tp)
    model.config = local_config(config, tp, tp_rank)
    return model
