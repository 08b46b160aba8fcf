"""The vision tower (Qwen2-VL's design) and the placeholder bookkeeping that ties media to tokens.

patches [N, C·T·P·P] (from msaserve.preprocess, Qwen2-VL's layout) → patch embedding (a linear
layer, equal to Qwen2-VL's Conv3d with kernel = stride = (T, P, P)) → `depth` pre-norm transformer
blocks with 2-D rotary positions (attention within one temporal patch of one medium) → 2×2 merger
(LayerNorm, concat 4 neighbours, MLP) whose last linear projects to the LM hidden size →
embeddings [N / merge², out_hidden_size], one row per placeholder token.

Parameter names follow HF Qwen2-VL's `visual.*` (patch_embed.proj, blocks.i.{norm1, attn.qkv,
attn.proj, norm2, mlp.fc1, mlp.fc2}, merger.{ln_q, mlp.0, mlp.2}); a Conv3d checkpoint weight
loads as `weight.reshape(hidden_size, -1)`.

The LM side: `merge_media_embeddings` writes the tower's rows into the placeholder positions of the
LM's input embeddings (`kvcache.page_hash.expand_placeholders` made one placeholder per medium into
its `num_placeholder_tokens` copies, and `media_hashes_per_page` gives each page's media hashes).
"""

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn


class QuickGELU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {
    "quick_gelu": QuickGELU,
    "gelu": nn.GELU,
    "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"),
}


@dataclass(frozen=True)
class VisionConfig:
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    in_channels: int = 3
    hidden_size: int = 1280  # width of the tower's transformer
    depth: int = 32
    num_heads: int = 16
    mlp_ratio: float = 4.0
    out_hidden_size: int = 3584  # the LM's hidden size
    layer_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    hidden_act: str = "quick_gelu"  # of the blocks' MLP (Qwen2-VL); the merger always uses GELU

    def __post_init__(self) -> None:
        for name in ("patch_size", "merge_size", "temporal_patch_size", "in_channels", "hidden_size",
                     "depth", "num_heads", "out_hidden_size"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ValueError(f"VisionConfig.{name}={getattr(self, name)} must be > 0")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"VisionConfig.hidden_act={self.hidden_act!r}: allowed {', '.join(ACTIVATIONS)}")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError(
                f"VisionConfig.hidden_size={self.hidden_size} / num_heads={self.num_heads} must be a "
                "multiple of 4 (half the head dim rotates with the row, half with the column)"
            )

    @property
    def patch_dim(self) -> int:
        """Length of one flattened patch: C · T · P · P."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "VisionConfig":
        """From `MSAConfig.vision` (our names, or HF Qwen2-VL `vision_config` names)."""
        names = {"embed_dim": "hidden_size", "spatial_merge_size": "merge_size", "in_chans": "in_channels"}
        merged = {names.get(k, k): v for k, v in raw.items()}
        if "embed_dim" in raw and "hidden_size" in raw:  # HF: hidden_size is the LM's width
            merged["hidden_size"], merged["out_hidden_size"] = raw["embed_dim"], raw["hidden_size"]
        return cls(**{k: v for k, v in merged.items() if k in cls.__dataclass_fields__})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


VISION_PRESETS: dict[str, VisionConfig] = {
    # For CPU tests with the `tiny` LM preset (hidden size 64).
    "tiny": VisionConfig(hidden_size=32, depth=2, num_heads=2, mlp_ratio=2.0, out_hidden_size=64),
    # Qwen2-VL-7B's tower (675M parameters), for shape checks and real checkpoints.
    "qwen2-vl": VisionConfig(),
}


class MediaLike(Protocol):
    """What the helpers read from a preprocessed medium (msaserve.preprocess.pipeline.MediaItem)."""

    kind: str  # "image" | "video"
    grid_thw: tuple[int, int, int]
    num_placeholder_tokens: int
    content_hash: int


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[int]
    ) -> torch.Tensor:
        """x [N, E]; cos/sin [N, Dh]; segments: lengths of the runs that attend among themselves."""
        n, e = x.shape
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, e // self.num_heads).unbind(1)  # [N, heads, Dh]
        q = q * cos[:, None] + rotate_half(q) * sin[:, None]
        k = k * cos[:, None] + rotate_half(k) * sin[:, None]
        outputs = []
        start = 0
        for length, count in _runs(segments):
            # `count` equal-length segments in a row attend as one batch: [count, heads, length, Dh]
            end = start + length * count
            qs, ks, vs = (
                t[start:end].view(count, length, self.num_heads, -1).transpose(1, 2) for t in (q, k, v)
            )
            o = F.scaled_dot_product_attention(qs, ks, vs)
            outputs.append(o.transpose(1, 2).reshape(length * count, e))
            start = end
        return self.proj(torch.cat(outputs))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attn = VisionAttention(config)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        mlp_hidden = int(config.hidden_size * config.mlp_ratio)
        self.mlp = nn.Sequential()
        self.mlp.add_module("fc1", nn.Linear(config.hidden_size, mlp_hidden))
        self.mlp.add_module("act", ACTIVATIONS[config.hidden_act]())
        self.mlp.add_module("fc2", nn.Linear(mlp_hidden, config.hidden_size))

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[int]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """merge² neighbouring patches (consecutive rows, by the preprocess layout) → one LM token."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.group = config.merge_size**2
        width = config.hidden_size * self.group
        self.ln_q = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, config.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_q(x)  # [N, E]
        return self.mlp(x.reshape(-1, x.shape[-1] * self.group))  # [N / merge², out_hidden]


class VisionTower(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Linear(config.patch_dim, config.hidden_size, bias=False)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config)
        head_dim = config.hidden_size // config.num_heads
        quarter = torch.arange(0, head_dim // 2, 2, dtype=torch.float32) / (head_dim // 2)
        self.register_buffer("inv_freq", 1.0 / config.rope_theta**quarter, persistent=False)  # [Dh/4]

    def forward(self, patches: torch.Tensor, grid_thw: Sequence[Sequence[int]]) -> torch.Tensor:
        """patches [sum_i t_i·h_i·w_i, C·T·P·P] of media with grids grid_thw (in order)
        → embeddings [sum_i t_i·h_i·w_i / merge², out_hidden_size], one per placeholder token."""
        grids = [tuple(int(v) for v in g) for g in grid_thw]
        expected = sum(t * h * w for t, h, w in grids)
        if patches.shape != (expected, self.config.patch_dim):
            raise ValueError(
                f"patches {tuple(patches.shape)} do not match grids {grids}: "
                f"expected ({expected}, {self.config.patch_dim})"
            )
        x = self.patch_embed.proj(patches.to(self.patch_embed.proj.weight.dtype))  # [N, E]
        cos, sin = self._rotary(grids, x.dtype)  # [N, Dh]
        segments = [h * w for t, h, w in grids for _ in range(t)]  # one temporal patch attends to itself
        for block in self.blocks:
            x = block(x, cos, sin, segments)
        return self.merger(x)

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load HF Qwen2-VL `visual.*` weights (prefix stripped): the Conv3d patch weight
        [E, C, T, P, P] becomes the linear's [E, C·T·P·P]; every other name matches."""
        state = dict(state)
        weight = state["patch_embed.proj.weight"]
        state["patch_embed.proj.weight"] = weight.reshape(weight.shape[0], -1)
        self.load_state_dict(state, strict=True)

    def embed_media(self, media: Sequence[Any]) -> torch.Tensor:
        """Preprocessed MediaItems (numpy patches) → embeddings [total placeholders, out_hidden]."""
        device = self.inv_freq.device
        patches = torch.cat([torch.from_numpy(m.patches) for m in media]).to(device)
        return self.forward(patches, [m.grid_thw for m in media])

    def _rotary(
        self, grids: list[tuple[int, int, int]], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, Dh]: half of each head rotates with the patch row, half with the column."""
        positions = torch.cat([_patch_rows_cols(t, h, w, self.config.merge_size) for t, h, w in grids])
        positions = positions.to(self.inv_freq.device, torch.float32)  # [N, 2]
        freqs = (positions[:, :, None] * self.inv_freq[None, None, :]).flatten(1)  # [N, Dh/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [N, Dh]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _patch_rows_cols(t: int, h: int, w: int, merge: int) -> torch.Tensor:
    """(row, col) of each patch in the preprocess order (t, h/m, w/m, m, m): [t·h·w, 2]."""
    rows = torch.arange(h)[:, None].expand(h, w)
    cols = torch.arange(w)[None, :].expand(h, w)
    order = [
        x.reshape(h // merge, merge, w // merge, merge).permute(0, 2, 1, 3).flatten() for x in (rows, cols)
    ]
    return torch.stack(order, dim=-1).repeat(t, 1)


def _runs(lengths: list[int]) -> list[tuple[int, int]]:
    """[4, 4, 6] → [(4, 2), (6, 1)]: runs of equal lengths, batched together."""
    runs: list[tuple[int, int]] = []
    for length in lengths:
        if runs and runs[-1][0] == length:
            runs[-1] = (length, runs[-1][1] + 1)
        else:
            runs.append((length, 1))
    return runs


# ---- placeholders: media ↔ token positions ---------------------------------------------------
# expand_placeholders, placeholder_spans and media_hashes_per_page live beside the page hash
# (msaserve.kvcache.page_hash, torch-free): the engine and the router hash media prompts with them.


def merge_media_embeddings(
    input_embeds: torch.Tensor,
    input_ids: torch.Tensor,
    media_embeds: torch.Tensor,
    image_token_id: int,
    video_token_id: int,
    placeholders_before: int = 0,
) -> torch.Tensor:
    """Write media rows into the placeholder positions of one sequence's (chunk of) embeddings.

    input_embeds [T, H] (embed_tokens(input_ids)); input_ids [T]; media_embeds [M, H] for the whole
    prompt (VisionTower output, in media order); placeholders_before: placeholder tokens of this
    sequence before this chunk (0 for a whole prompt) so chunked prefill takes the right rows.
    Returns a new [T, H] tensor, ready for MSATransformer.forward(..., input_embeds=...)."""
    mask = (input_ids == image_token_id) | (input_ids == video_token_id)  # [T]
    count = int(mask.sum())
    if placeholders_before + count > media_embeds.shape[0]:
        raise ValueError(
            f"{placeholders_before + count} placeholders reach past the {media_embeds.shape[0]} media rows"
        )
    merged = input_embeds.clone()
    merged[mask] = media_embeds[placeholders_before : placeholders_before + count].to(merged.dtype)
    return merged
