"""A multi-rank replica's Ray resources and the checks on its layout (no Ray, no ranks)."""

import pytest
from m3_tiny import TINY_M3

from msaserve.engine.config import EngineConfig
from msaserve.engine.parallel.layout import ParallelLayout
from msaserve.engine.parallel.tp import head_shard
from msaserve.models.minimax_m3.config import m3_config_from_hf
from msaserve.platform.config import ServeConfig
from msaserve.platform.model_placement import model_deployment_options
from msaserve.platform.serve_config_v2 import cluster_problems


def serve_config(**engine) -> ServeConfig:
    return ServeConfig.from_dict({
        "model": {"spec": "tiny", "device": "cuda"}, "engine": engine,
        "deployments": {"model": {"ray_actor_options": {"num_cpus": 4, "num_gpus": 0,
                                                        "resources": {"msaserve_gpu_group": 1}}}},
    })


def test_a_multi_rank_replica_reserves_a_bundle_per_gpu_after_its_driver() -> None:
    options = model_deployment_options(serve_config(tensor_parallel_size=2, expert_parallel_size=2))
    assert options["placement_group_bundles"] == [
        {"CPU": 4.0, "msaserve_gpu_group": 1.0}, *[{"GPU": 1.0, "CPU": 1.0}] * 4,
    ]
    assert options["placement_group_strategy"] == "STRICT_PACK"
    assert options["ray_actor_options"]["num_gpus"] == 0.0
    assert "placement_group_bundles" not in model_deployment_options(serve_config())


def test_gpus_asked_twice_are_refused_with_the_fields_named() -> None:
    config = serve_config(tensor_parallel_size=2)
    config.deployments.model.ray_actor_options.num_gpus = 1
    [problem] = [p for p in cluster_problems(config) if "placement group" in p]
    assert "tensor_parallel_size x expert_parallel_size = 2" in problem and "num_gpus: 0" in problem


def test_layout_refuses_what_the_model_cannot_split() -> None:
    config = m3_config_from_hf(TINY_M3)  # Hq 4, Hkv 2, 8 experts, widths 96 / 32 / 32
    with pytest.raises(ValueError, match="num_attention_heads=4 is invalid for tensor_parallel_size=8"):
        ParallelLayout(8, 1).check(config)
    with pytest.raises(ValueError, match="num_key_value_heads=2 is invalid for tensor_parallel_size=3"):
        widths = {"shared_intermediate_size": 48, "intermediate_size": 48}
        ParallelLayout(3, 1).check(m3_config_from_hf({**TINY_M3, **widths, "num_attention_heads": 6}))
    with pytest.raises(ValueError, match="num_local_experts=8 is invalid for expert_parallel_size=3"):
        ParallelLayout(1, 3).check(config)
    with pytest.raises(ValueError, match=r"EngineConfig\.tensor_parallel_size=0"):
        EngineConfig(tensor_parallel_size=0)


def test_m3_heads_at_tp8_share_each_kv_head_over_two_ranks() -> None:
    """M3: Hq 64, Hkv 4. At TP 8 each rank has 8 query heads, all of one KV group, and that
    group's KV head (kept by the 2 ranks of the group)."""
    config = m3_config_from_hf({**TINY_M3, "num_attention_heads": 64, "num_key_value_heads": 4,
                                "index_n_heads": 4})
    shards = [head_shard(config, 8, rank) for rank in range(8)]
    assert [(s.q_heads.start, s.q_heads.stop) for s in shards[:3]] == [(0, 8), (8, 16), (16, 24)]
    assert [s.kv_heads.start for s in shards] == [0, 0, 1, 1, 2, 2, 3, 3]
    group = config.num_heads // config.num_kv_heads
    assert all(s.q_heads.start // group == s.kv_heads.start for s in shards)
