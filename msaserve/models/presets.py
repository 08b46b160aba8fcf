"""Named random-weight configs: `tiny` for CPU tests, `m3-proxy` for GPU benchmarks (docs/design.md §4)."""

from typing import Any

from msaserve.models.config import MSAConfig
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


def get_preset(name: str, **overrides: Any) -> MSAConfig:
    """The config of preset `name` with `overrides` applied (validated like any config)."""
    if name not in PRESETS:
        raise ValueError(f"preset {name!r} is unknown: allowed {', '.join(sorted(PRESETS))}")
    missing = [key for key in _REQUIRED_OVERRIDES.get(name, ()) if key not in overrides]
    if missing:
        raise ValueError(f"preset {name!r} needs {', '.join(missing)}=<int> (e.g. num_layers=4)")
    return MSAConfig(**{**PRESETS[name], **overrides})
