"""Named random-weight configs (docs/design.md §4): `tiny` for CPU tests, `m3-mini` (the real
MiniMax-M3 block at real widths, few layers) for GPU benchmarks, `m3-proxy` (the M3 attention
shape with a dense MLP; the GPU benchmarks' model until issue 27, kept for its history).

`m3-mini` is a checkpoint config: a config.json dict read through the registry by its
`model_type`, exactly as a checkpoint directory's would be (`registry.architecture_for(...)
.parse_config`), so the model benchmarked is the one a real M3 checkpoint builds.
"""

from collections.abc import Callable
from typing import Any

from msaserve.models.config import MSAConfig
from msaserve.models.registry import architecture_for
from msaserve.models.vision import VISION_PRESETS

PRESETS: dict[str, dict[str, Any]] = {
    # Small enough that a full CPU test runs in milliseconds; P·K = 64 tokens, so sequences
    # longer than 64 tokens exercise real sparsity.
    "tiny": dict(
        vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096,
        tie_word_embeddings=False, index_source="learned", num_index_heads=1, index_head_dim=16,
        page_size=16, top_k=4, n_init=1, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        # A 2-block vision tower whose merger projects to the LM's 64; ids above the byte
        # tokenizer's 259, so no text ever encodes to a placeholder.
        vision=VISION_PRESETS["tiny"].to_dict(), image_token_id=500, video_token_id=501,
    ),
    # The M3 attention shape with a dense SwiGLU MLP of about an M2/M3-class MoE's active
    # parameters per layer, so attention's share of time is realistic. num_layers is chosen per
    # benchmark and always reported, hence required.
    "m3-proxy": dict(
        vocab_size=32768, hidden_size=6144, num_heads=64, num_kv_heads=4, head_dim=128,
        intermediate_size=8192, rms_norm_eps=1e-6, rope_theta=5_000_000.0,
        max_position_embeddings=1 << 20, tie_word_embeddings=False, index_source="learned",
        num_index_heads=1, index_head_dim=128, page_size=128, top_k=16, n_init=1,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    ),
}

_REQUIRED_OVERRIDES = {"m3-proxy": ("num_layers",)}

M3_MINI_LAYERS = 4
"""m3-mini's default depth: 1 dense-MLP layer + 3 MoE layers. Why 4 (docs/performance-m3.md):
bf16 weights are ≈ 14.5 GB per MoE layer (128 experts × 3 × 6144 × 3072) + 4.9 GB of embedding
and LM head, so 4 layers hold ≈ 50 GB; a 1M-token session adds 2.25 GiB of K/V + index per layer
(9 GiB), and the MSA and dense engines run one after the other on the same weights, inside the
141 GB of one H200. The binding limit is run time: the dense side's 1M-token prefill costs
≈ 55 s per layer on the H200, and every figure has to fit a 7-minute device call."""
M3_MINI_DENSE_MLP_LAYERS = 1
"""Leading layers with a dense MLP (mlp_layer_types 'dense'); M3's MoE layers follow them."""


def m3_mini_config_json(num_hidden_layers: int = M3_MINI_LAYERS,
                        dense_mlp_layers: int = M3_MINI_DENSE_MLP_LAYERS, **overrides: Any) -> dict[str, Any]:
    """The config.json of `m3-mini`: MiniMax-M3's text model (transformers' MiniMaxM3VLTextConfig
    defaults: hidden 6144, Hq 64, Hkv 4, D 128, index_n_heads 4 × index_head_dim 128, index blocks
    of 128, top-16 with 1 local block, 128 experts top-4 of intermediate 3072 + a shared expert of
    3072, dense MLP 12288, vocabulary 200,064) at `num_hidden_layers` layers: every layer
    `minimax_m3_sparse`, the first `dense_mlp_layers` with the dense MLP, the rest MoE.

    overrides: any config.json key (e.g. smaller widths for CPU tests); given `layer_types` /
    `mlp_layer_types` replace the pattern."""
    if not 0 <= dense_mlp_layers <= num_hidden_layers:
        raise ValueError(f"dense_mlp_layers={dense_mlp_layers} is invalid: allowed 0 to "
                         f"num_hidden_layers={num_hidden_layers}")
    moe = num_hidden_layers - dense_mlp_layers
    return {
        "model_type": "minimax_m3_vl_text", "num_hidden_layers": num_hidden_layers,
        "layer_types": ["minimax_m3_sparse"] * num_hidden_layers,
        "mlp_layer_types": ["dense"] * dense_mlp_layers + ["sparse"] * moe,
        # 1M-token sessions; rotary θ 5e6, half of each head turned (MiniMax-M2's rotary_dim 64 of 128).
        "max_position_embeddings": 1 << 21,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": 0.5},
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False,
        **overrides,
    }


M3_MINI_SMALL: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, dense_intermediate_size=96, shared_intermediate_size=32, num_local_experts=8,
    num_experts_per_tok=2, index_n_heads=2, index_head_dim=16, index_block_size=16, index_topk_blocks=4,
    max_position_embeddings=8192,
)
"""Overrides that shrink m3-mini's widths for CPU runs of the same code path (tests, the
benchmarks' CPU check); its layer pattern, index form and MoE routing stay."""

CHECKPOINT_PRESETS: dict[str, Callable[..., dict[str, Any]]] = {"m3-mini": m3_mini_config_json}
"""Presets given as a config.json (keyword overrides are config.json keys), built by the registry."""


def preset_names() -> tuple[str, ...]:
    return (*PRESETS, *CHECKPOINT_PRESETS)


def preset_config_json(name: str, **overrides: Any) -> dict[str, Any]:
    """The config.json dict of checkpoint preset `name`."""
    if name not in CHECKPOINT_PRESETS:
        allowed = ", ".join(CHECKPOINT_PRESETS)
        raise ValueError(f"preset {name!r} is not a checkpoint preset: allowed {allowed}")
    return CHECKPOINT_PRESETS[name](**overrides)


def get_preset(name: str, **overrides: Any) -> MSAConfig:
    """The config of preset `name` with `overrides` applied (validated like any config)."""
    if name in CHECKPOINT_PRESETS:
        raw = preset_config_json(name, **overrides)
        return architecture_for(raw["model_type"]).parse_config(raw)
    if name not in PRESETS:
        raise ValueError(f"preset {name!r} is unknown: allowed {', '.join(sorted(preset_names()))}")
    missing = [key for key in _REQUIRED_OVERRIDES.get(name, ()) if key not in overrides]
    if missing:
        raise ValueError(f"preset {name!r} needs {', '.join(missing)}=<int> (e.g. num_layers=4)")
    return MSAConfig(**{**PRESETS[name], **overrides})
