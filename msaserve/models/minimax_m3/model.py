"""MiniMax-M3's text model as msaserve modules: embed → N × (norm → attention → norm → MLP/MoE)
→ norm → LM head, on the engine's paged caches and AttentionMetadata.

It has the interface the engine's ModelRunner drives (`forward(input_ids, meta, caches, ...)`,
`compute_logits`, `fuse_projections`, `config`, `attention_backend`, `embed_tokens`, `visual`).
Parameter names are transformers' MiniMaxM3VLTextModel names without the `model.` prefix.

Media: the runner merges image/video embeddings into `input_embeds` (msaserve.engine.media) with
`model.visual.embed_media(items)` at the placeholder positions of `config.image_token_id` /
`config.video_token_id`; `visual` is None for a text-only model.
"""

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from msaserve.kernels import AttentionOps, get_ops
from msaserve.kernels.backends import check_backend_name
from msaserve.kernels.rotary import rotary_cos_sin
from msaserve.models.cache import LayerKVCache
from msaserve.models.metadata import AttentionMetadata
from msaserve.models.minimax_m3.attention import M3Attention, M3Rotary
from msaserve.models.minimax_m3.config import M3Config
from msaserve.models.minimax_m3.layers import M3RMSNorm, make_mlp


class M3DecoderLayer(nn.Module):
    def __init__(self, config: M3Config, layer: int) -> None:
        super().__init__()
        self.input_layernorm = M3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = M3Attention(config, layer)
        self.post_attention_layernorm = M3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = make_mlp(config, layer)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata,
                cache: LayerKVCache, rotary: M3Rotary, ops: AttentionOps
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) → (MLP output, the residual stream before it): transformers' `h + attn(norm(h))`
        and `h + mlp(norm(h))` with each residual add done by the next norm, in one op with it."""
        h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, meta, cache, rotary, ops)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


class M3ForCausalLM(nn.Module):
    def __init__(self, config: M3Config, attention_backend: str = "msa") -> None:
        super().__init__()
        self.config = config
        self.attention_backend = check_backend_name(attention_backend)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(M3DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = M3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.visual: Any = None
        """The vision tower (`embed_media(items) → [placeholders, H]`), None for text only."""

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        caches: list[LayerKVCache],
        input_embeds: torch.Tensor | None = None,
        ops: AttentionOps | None = None,
        layer_ops: object | None = None,
    ) -> torch.Tensor:
        """input_ids [T] int64 (flattened new tokens of all sequences) → hidden [T, H].

        input_embeds [T, H], if given, replaces the token embeddings (media placeholders merged);
        ops, if given, replaces the backend's attention ops. layer_ops is accepted for the
        runner's interface and unused: M3's norms and rotary differ from the fused layer ops.
        """
        del layer_ops
        if len(caches) != len(self.layers):
            raise ValueError(f"got {len(caches)} layer caches for {len(self.layers)} layers")
        x = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        cos, sin = rotary_cos_sin(meta.positions, self.config.rotary_dim, self.config.rope_theta, x.dtype)
        rotary = M3Rotary(cos, sin)
        if ops is None:
            ops = get_ops(self.attention_backend, x.device)
        residual = None
        for layer, cache in zip(self.layers, caches, strict=True):
            x, residual = layer(x, residual, meta, cache, rotary, ops)
        return self.norm.add_forward(x, residual)[0]

    @property
    def dense_layers(self) -> tuple[int, ...]:
        """Layers that attend densely whatever the backend (full_attention): they read every page."""
        return tuple(i for i, kind in enumerate(self.config.layer_types) if kind == "full_attention")

    def fuse_projections(self) -> None:
        """One GEMM per layer for q, k, v and the index branch's q and k (M3Attention.fuse_projections):
        their weights become views of the fused tensor, so no memory is added and names still load.
        Idempotent; the engine's ModelRunner calls it once the weights are loaded (and sharded)."""
        for layer in self.layers:
            layer.self_attn.fuse_projections()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] → logits [N, vocab] fp32."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()
