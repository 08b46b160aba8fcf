"""The MSA transformer: embed → N × (RMSNorm → attention → RMSNorm → SwiGLU) → norm → LM head.

Parameter names follow HF Llama without the `model.` prefix (the loaders add it), so HF-style
checkpoints load by name.
"""

import torch
import torch.nn.functional as F
from torch import nn

from msaserve.kernels import AttentionOps, get_ops
from msaserve.kernels.backends import check_backend_name
from msaserve.kernels.layer_ops import LayerOps, get_layer_ops
from msaserve.kernels.rotary import rotary_cos_sin
from msaserve.models.attention import MSAAttention, RotaryTables
from msaserve.models.cache import LayerKVCache
from msaserve.models.config import MSAConfig
from msaserve.models.layers import RMSNorm, SwiGLU
from msaserve.models.metadata import AttentionMetadata


class DecoderLayer(nn.Module):
    def __init__(self, config: MSAConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MSAAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata,
                cache: LayerKVCache, rotary: RotaryTables, ops: AttentionOps,
                layer_ops: LayerOps) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) → (mlp output, residual stream before it): the residual add happens in
        the next RMSNorm, so HF's `h + attn(norm(h))` and `h + mlp(norm(h))` each cost one op."""
        h, residual = self.input_layernorm.add_forward(x, residual, layer_ops)
        h = self.self_attn(h, meta, cache, rotary, ops, layer_ops)
        h, residual = self.post_attention_layernorm.add_forward(h, residual, layer_ops)
        return self.mlp(h, layer_ops), residual


class MSATransformer(nn.Module):
    def __init__(self, config: MSAConfig, attention_backend: str = "msa") -> None:
        super().__init__()
        self.config = config
        self.attention_backend = check_backend_name(attention_backend)
        """The backend the weights are laid out for (the dense one never projects index queries);
        the engine's ModelRunner resolves it once and passes the ops to every forward."""
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        for index in config.dense_layers:
            self.layers[index].self_attn.dense = True
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        caches: list[LayerKVCache],
        input_embeds: torch.Tensor | None = None,
        ops: AttentionOps | None = None,
        layer_ops: LayerOps | None = None,
    ) -> torch.Tensor:
        """input_ids [T] int64 (flattened new tokens of all sequences) → hidden [T, H].

        input_embeds [T, H], if given, replaces the token embeddings (multimodal placeholders).
        ops: the attention ops the engine resolved for this model (`ModelRunner.ops`, possibly
        wrapped so that each layer fetches the pages it selects before attending); None resolves
        `attention_backend` for the input's device (direct calls in tests and tools).
        layer_ops, if given, replaces the device's elementwise ops (tests compare the two).
        """
        if len(caches) != len(self.layers):
            raise ValueError(f"got {len(caches)} layer caches for {len(self.layers)} layers")
        x = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        rotary = self._rotary(meta.positions, x.dtype)
        if ops is None:
            ops = get_ops(self.attention_backend, x.device)
        layer_ops = layer_ops or get_layer_ops(x.device)
        residual = None
        for layer, cache in zip(self.layers, caches, strict=True):
            x, residual = layer(x, residual, meta, cache, rotary, ops, layer_ops)
        return self.norm.add_forward(x, residual, layer_ops)[0]

    @property
    def dense_layers(self) -> tuple[int, ...]:
        """Layers that attend densely whatever the backend (config.dense_layers): they read every page."""
        return tuple(sorted(set(self.config.dense_layers)))

    def fuse_projections(self) -> None:
        """Merge each layer's input projections into one GEMM (q/k/v/index, and gate/up). The
        weights become views of the fused tensors, so no memory is added and names still load.
        Idempotent; the engine's ModelRunner calls it once the weights are loaded."""
        if self.layers and self.layers[0].mlp.gate_up_weight is not None:
            return
        for layer in self.layers:
            sparse = self.attention_backend != "dense" and not layer.self_attn.dense
            layer.self_attn.fuse_projections(index_queries=sparse)
            layer.mlp.fuse_projections()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] → logits [N, vocab] fp32."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def _rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryTables:
        c = self.config
        cos, sin = rotary_cos_sin(positions, c.head_dim, c.rope_theta, dtype)
        if c.index_head_dim == c.head_dim:
            return RotaryTables(cos, sin, cos, sin)
        index_cos, index_sin = rotary_cos_sin(positions, c.index_head_dim, c.rope_theta, dtype)
        return RotaryTables(cos, sin, index_cos, index_sin)


def init_random_weights(model: MSATransformer, seed: int = 0, std: float = 0.02) -> MSATransformer:
    """Deterministic random weights for presets: N(0, std) matrices, unit norms."""
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            # Drawn on the parameter's device (fast for m3-proxy on GPU); same seed, same weights.
            if param.device not in generators:
                generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
            values = torch.randn(
                param.shape, generator=generators[param.device], dtype=torch.float32, device=param.device
            )
            param.copy_(values * std)
    return model
