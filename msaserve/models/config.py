"""`MSAConfig`: the shape of an MSA transformer, read from a checkpoint's config.json (docs/design.md §4).

Pydantic at the edge (CONTRIBUTING.md §6): every field says what it is and what it allows, and an error
names the field, the value and the allowed range.
"""

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# HF config.json name → MSAConfig field.
_HF_NAMES = {
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "vision_config": "vision",
}


class MSAConfig(BaseModel):
    """Sizes of a decoder-only MSA transformer (RMSNorm, rotary, GQA + MSA index, SwiGLU)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    vocab_size: int = Field(ge=1, description="Number of token ids the embedding and LM head cover.")
    hidden_size: int = Field(ge=1, description="Width H of the residual stream.")
    num_layers: int = Field(ge=1, description="Number of decoder layers.")
    num_heads: int = Field(ge=1, description="Query heads Hq.")
    num_kv_heads: int = Field(ge=1, description="Key/value heads Hkv; must divide num_heads.")
    head_dim: int = Field(ge=2, multiple_of=2, description="Per-head dimension D (even, for rotary).")
    intermediate_size: int = Field(ge=1, description="Hidden width of the SwiGLU MLP.")
    rms_norm_eps: float = Field(default=1e-5, gt=0.0, le=1.0, description="RMSNorm epsilon, in (0, 1].")
    rope_theta: float = Field(default=10000.0, gt=0.0, description="Rotary base frequency (> 0).")
    max_position_embeddings: int = Field(
        default=8192, ge=1, description="Longest sequence the model was trained for (tokens)."
    )
    tie_word_embeddings: bool = Field(
        default=False, description="Whether the LM head reuses the token embedding matrix."
    )
    index_source: Literal["learned", "keys"] = Field(
        default="learned",
        description="Where the MSA index comes from: 'learned' projections of the layer input, or "
        "'keys' (a dense checkpoint converted without training: kI = k, qI = group-mean of q).",
    )
    num_index_heads: int = Field(
        default=1, ge=1, description="Index-key heads HkI: 1 (shared) or num_kv_heads; "
        "must be num_kv_heads when index_source='keys'."
    )
    index_head_dim: int = Field(
        default=128, ge=2, multiple_of=2,
        description="Index head dimension DI (even); must equal head_dim when index_source='keys'.",
    )
    page_size: int = Field(
        default=128, ge=1, le=4096, description="MSA block size P = KV page size, in tokens (1–4096)."
    )
    top_k: int = Field(default=16, ge=1, le=4096, description="Blocks K each query attends to (1–4096).")
    n_init: int = Field(default=1, ge=0, description="Leading blocks always selected; 0 ≤ n_init < top_k.")
    n_local: int = Field(
        default=1, ge=1,
        description="Blocks ending at the query's own block always selected (≥ 1; n_init + n_local ≤ top_k).",
    )
    dense_layers: tuple[int, ...] = Field(
        default=(),
        description="Layers that attend densely (full causal attention, no block selection) under "
        "every backend, as MiniMax's full-attention layers; each in 0..num_layers-1.",
    )
    bos_token_id: int | None = Field(default=None, ge=0, description="Beginning-of-sequence token id.")
    eos_token_id: int | None = Field(default=None, ge=0, description="End-of-sequence token id.")
    pad_token_id: int | None = Field(default=None, ge=0, description="Padding token id.")
    vision: dict[str, Any] | None = Field(
        default=None, description="Vision tower settings (patch embedding, layers, merger); None = text only."
    )
    image_token_id: int | None = Field(
        default=None, ge=0, description="Placeholder token of one image (expanded to its patch count)."
    )
    video_token_id: int | None = Field(
        default=None, ge=0, description="Placeholder token of one video (expanded to its patch count)."
    )

    @model_validator(mode="after")
    def _check_relations(self) -> "MSAConfig":
        h, hkv = self.num_heads, self.num_kv_heads
        if h % hkv:
            raise ValueError(f"num_kv_heads={hkv} must divide num_heads={h}")
        if self.num_index_heads not in (1, hkv):
            raise ValueError(
                f"num_index_heads={self.num_index_heads} is invalid: allowed 1 or num_kv_heads={hkv}"
            )
        if self.index_source == "keys":
            if self.num_index_heads != hkv:
                raise ValueError(
                    f"num_index_heads={self.num_index_heads} must equal num_kv_heads={hkv} "
                    "when index_source='keys'"
                )
            if self.index_head_dim != self.head_dim:
                raise ValueError(
                    f"index_head_dim={self.index_head_dim} must equal head_dim={self.head_dim} "
                    "when index_source='keys'"
                )
        if self.n_init >= self.top_k:
            raise ValueError(f"n_init={self.n_init} is invalid: allowed 0 ≤ n_init < top_k={self.top_k}")
        if self.n_init + self.n_local > self.top_k:
            raise ValueError(
                f"n_local={self.n_local} is invalid: allowed 1 ≤ n_local ≤ top_k - n_init = "
                f"{self.top_k - self.n_init}"
            )
        bad = [i for i in self.dense_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"dense_layers={list(self.dense_layers)} is invalid: {bad} outside the allowed "
                             f"0..num_layers-1 = 0..{self.num_layers - 1}")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id", "image_token_id", "video_token_id"):
            value = getattr(self, name)
            if value is not None and value >= self.vocab_size:
                raise ValueError(
                    f"{name}={value} is invalid: allowed 0 ≤ {name} < vocab_size={self.vocab_size}"
                )
        if self.vision is not None:
            self._check_vision()
        return self

    def _check_vision(self) -> None:
        from msaserve.models.vision import VisionConfig  # torch-free callers never reach this

        out = VisionConfig.from_dict(self.vision).out_hidden_size
        if out != self.hidden_size:
            raise ValueError(f"vision.out_hidden_size={out} must equal hidden_size={self.hidden_size}")
        if self.image_token_id is None or self.video_token_id is None:
            raise ValueError("a model with a vision tower needs image_token_id and video_token_id")
        if self.image_token_id == self.video_token_id:
            raise ValueError(f"image_token_id and video_token_id must differ (both {self.image_token_id})")

    @property
    def group_size(self) -> int:
        """Query heads per KV head, G = Hq / Hkv."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> "MSAConfig":
        """Build from an HF-style config dict; MSA fields may sit under `msa` or at top level.

        Keys that are not MSAConfig fields (HF bookkeeping like `architectures`) are ignored.
        """
        merged = {_HF_NAMES.get(key, key): value for key, value in raw.items()}
        merged.update(raw.get("msa") or {})
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if "rope_theta" not in merged and "rope_theta" in rope:
            merged["rope_theta"] = rope["rope_theta"]
        if "head_dim" not in merged and merged.get("hidden_size") and merged.get("num_heads"):
            merged["head_dim"] = merged["hidden_size"] // merged["num_heads"]
        if "num_kv_heads" not in merged and "num_heads" in merged:
            merged["num_kv_heads"] = merged["num_heads"]
        fields = {key: value for key, value in merged.items() if key in cls.model_fields}
        return cls(**fields)

    @classmethod
    def from_json(cls, path: str | Path) -> "MSAConfig":
        """Read an HF-style `config.json` (a file or the directory holding it)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        with path.open() as f:
            return cls.from_hf_dict(json.load(f))

    def to_hf_dict(self) -> dict[str, Any]:
        """HF-style dict (inverse of `from_hf_dict`), MSA fields under `msa`."""
        data = self.model_dump()
        msa_keys = (
            "index_source", "num_index_heads", "index_head_dim", "page_size", "top_k", "n_init", "n_local",
            "dense_layers",
        )
        out: dict[str, Any] = {"architectures": ["MSAForCausalLM"], "model_type": "msa"}
        inverse = {ours: hf for hf, ours in _HF_NAMES.items()}
        for key, value in data.items():
            if key not in msa_keys:
                out[inverse.get(key, key)] = value
        out["msa"] = {key: data[key] for key in msa_keys}
        out["msa"]["dense_layers"] = list(self.dense_layers)
        return out
