"""`M3Config`: MiniMax-M3's text model read from a Hugging Face config.json.

Two forms are read: the VL wrapper (`model_type` "minimax_m3_vl", the text model under
`text_config`, the vision tower under `vision_config`) and the text-only form ("minimax_m3_vl_text").
The field names and defaults are transformers' `MiniMaxM3VLTextConfig`; legacy MiniMax names
(`sparse_attention_config`, `moe_layer_freq`) are read as transformers reads them.

`M3Config` is an `MSAConfig`, so the engine (page pool, block manager, scheduler) runs it
unchanged: page_size = index_block_size, top_k = index_topk_blocks, n_init = 0,
n_local = index_local_blocks, one shared index-K head of index_head_dim.
"""

import logging
from typing import Any, Literal

from pydantic import Field, model_validator

from msaserve.models.config import MSAConfig

logger = logging.getLogger(__name__)

TEXT_MODEL_TYPE = "minimax_m3_vl_text"
VL_MODEL_TYPE = "minimax_m3_vl"
_DEFAULT_THETA = 5_000_000.0
_LEGACY_SPARSE = {
    "index_n_heads": "sparse_num_index_heads",
    "index_head_dim": "sparse_index_dim",
    "index_block_size": "sparse_block_size",
    "index_topk_blocks": "sparse_topk_blocks",
    "index_local_blocks": "sparse_local_block",
}
# transformers' MiniMaxM3VLTextConfig defaults, for keys a config.json leaves out.
_TEXT_DEFAULTS: dict[str, Any] = dict(
    vocab_size=200064, hidden_size=6144, intermediate_size=3072, num_hidden_layers=60,
    num_attention_heads=64, num_key_value_heads=4, head_dim=128, max_position_embeddings=524288,
    rms_norm_eps=1e-6, bos_token_id=200034, eos_token_id=200020, pad_token_id=None,
    tie_word_embeddings=False, num_experts_per_tok=4, num_local_experts=128,
    dense_intermediate_size=12288, shared_intermediate_size=3072, routed_scaling_factor=2.0,
    swiglu_alpha=1.702, swiglu_limit=7.0, index_n_heads=4, index_head_dim=128, index_block_size=128,
    index_topk_blocks=16, index_local_blocks=1,
)


class M3Config(MSAConfig):
    """MSAConfig plus what MiniMax-M3's text model adds (QK-norm, partial rotary, MoE)."""

    rotary_dim: int = Field(ge=2, multiple_of=2, description="Channels of each head that rotary turns "
                            "(head_dim · partial_rotary_factor, as transformers computes it); the rest pass.")
    layer_types: tuple[Literal["full_attention", "minimax_m3_sparse"], ...] = Field(
        description="Per layer: dense causal attention or the MSA index branch."
    )
    mlp_layer_types: tuple[Literal["dense", "sparse"], ...] = Field(
        description="Per layer: a dense clamped-SwiGLU MLP or the mixture of experts."
    )
    dense_intermediate_size: int = Field(ge=1, description="Hidden width of the dense MLP layers.")
    shared_intermediate_size: int = Field(ge=1, description="Hidden width of the one shared expert.")
    num_experts: int = Field(ge=1, description="Routed experts E per MoE layer.")
    num_experts_per_tok: int = Field(ge=1, description="Experts k each token is routed to (≤ E).")
    routed_scaling_factor: float = Field(gt=0.0, description="Multiplies the routed experts' sum.")
    swiglu_alpha: float = Field(description="Sigmoid gain of the clamped SwiGLU.")
    swiglu_limit: float = Field(gt=0.0, description="Clamp bound of the SwiGLU's gate and up.")
    eos_token_ids: tuple[int, ...] = Field(default=(), description="Every end-of-sequence id.")
    vision_config: dict[str, Any] | None = Field(
        default=None, description="The VL checkpoint's vision_config, as written (None: text only)."
    )

    @model_validator(mode="after")
    def _check_m3(self) -> "M3Config":
        n = self.num_layers
        for name in ("layer_types", "mlp_layer_types"):
            if len(getattr(self, name)) != n:
                count = len(getattr(self, name))
                raise ValueError(f"{name} has {count} entries: allowed one per layer ({n})")
        if self.rotary_dim > self.head_dim:
            raise ValueError(f"rotary_dim={self.rotary_dim} is invalid: allowed ≤ head_dim={self.head_dim}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} is invalid: allowed ≤ "
                             f"num_local_experts={self.num_experts}")
        if self.num_index_heads != 1 or self.index_source != "learned":
            raise ValueError("M3 has one learned index-K head: num_index_heads=1, index_source='learned'")
        return self

    @property
    def has_vision(self) -> bool:
        return self.vision_config is not None


def text_config_dict(raw: dict[str, Any]) -> dict[str, Any]:
    """The text model's keys of a config.json in either form (VL wrapper: its `text_config`)."""
    if raw.get("model_type") == VL_MODEL_TYPE:
        text = dict(raw.get("text_config") or {})
        text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
        return text
    return dict(raw)


def _text_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The text model's keys with transformers' defaults and its reading of legacy names applied
    (`layer_types` / `mlp_layer_types` None when neither form gives them)."""
    given = text_config_dict(raw)
    if "num_experts" in given and "num_local_experts" not in given:  # transformers' attribute_map
        given["num_local_experts"] = given["num_experts"]
    text = {**_TEXT_DEFAULTS, **given}
    sparse = text.get("sparse_attention_config") or {}
    for flat, legacy in _LEGACY_SPARSE.items():
        if legacy in sparse:
            text[flat] = sparse[legacy]
    if text.get("layer_types") is None and "sparse_attention_freq" in sparse:
        freq = sparse["sparse_attention_freq"]
        text["layer_types"] = ["minimax_m3_sparse" if f else "full_attention" for f in freq]
    if text.get("mlp_layer_types") is None and text.get("moe_layer_freq") is not None:
        text["mlp_layer_types"] = ["sparse" if f else "dense" for f in text["moe_layer_freq"]]
    return text


def m3_config_from_hf(raw: dict[str, Any]) -> M3Config:
    """Build from a config.json dict of model_type minimax_m3_vl or minimax_m3_vl_text."""
    text = _text_fields(raw)
    num_layers = text["num_hidden_layers"]
    layer_types, mlp_types = text.get("layer_types"), text.get("mlp_layer_types")
    rope = dict(text.get("rope_parameters") or {})
    rope_type = rope.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"rope_parameters.rope_type={rope_type!r} is not supported: allowed 'default'")
    theta = rope.get("rope_theta", text.get("rope_theta", _DEFAULT_THETA))
    partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0))
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    rotary_dim = int(head_dim * partial)
    if "rotary_dim" in text and text["rotary_dim"] != rotary_dim:
        # transformers rotates head_dim · partial_rotary_factor channels and never reads rotary_dim;
        # msaserve follows the reference code.
        logger.warning("config.json has rotary_dim=%s but head_dim · partial_rotary_factor = %s: rotating %s "
                       "channels, as transformers does", text["rotary_dim"], rotary_dim, rotary_dim)
    eos = text.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    if text["index_n_heads"] != text["num_key_value_heads"]:
        raise ValueError(f"index_n_heads={text['index_n_heads']} is not supported: allowed "
                         f"num_key_value_heads={text['num_key_value_heads']} (one selection per KV group)")
    image_id = raw.get("image_token_index", raw.get("image_token_id"))
    video_id = raw.get("video_token_index", raw.get("video_token_id"))
    return M3Config(
        vocab_size=text["vocab_size"], hidden_size=text["hidden_size"], num_layers=num_layers,
        num_heads=text["num_attention_heads"], num_kv_heads=text["num_key_value_heads"], head_dim=head_dim,
        intermediate_size=text["intermediate_size"], rms_norm_eps=text["rms_norm_eps"], rope_theta=theta,
        max_position_embeddings=text["max_position_embeddings"],
        tie_word_embeddings=bool(text["tie_word_embeddings"]), index_source="learned", num_index_heads=1,
        index_head_dim=text["index_head_dim"], page_size=text["index_block_size"],
        top_k=text["index_topk_blocks"], n_init=0, n_local=text["index_local_blocks"],
        bos_token_id=text["bos_token_id"], eos_token_id=eos_ids[0] if eos_ids else None,
        pad_token_id=text["pad_token_id"], image_token_id=image_id, video_token_id=video_id,
        rotary_dim=rotary_dim,
        layer_types=tuple(layer_types or ["full_attention"] * num_layers),
        mlp_layer_types=tuple(mlp_types or ["sparse"] * num_layers),
        dense_intermediate_size=text["dense_intermediate_size"],
        shared_intermediate_size=text["shared_intermediate_size"], num_experts=text["num_local_experts"],
        num_experts_per_tok=text["num_experts_per_tok"], routed_scaling_factor=text["routed_scaling_factor"],
        swiglu_alpha=text["swiglu_alpha"], swiglu_limit=text["swiglu_limit"], eos_token_ids=eos_ids,
        vision_config=raw.get("vision_config") if raw.get("model_type") == VL_MODEL_TYPE else None,
    )
