"""MiniMax-M3's vision tower and projector, loading the checkpoint's own tensor names.

patches [N, C·T·P·P] (msaserve.preprocess.minimax_m3's layout: each run of merge² rows is one
2×2 group) → patch embedding (a linear layer equal to the checkpoint's Conv3d with kernel =
stride = (T, P, P), no bias) → pre-LayerNorm → `num_hidden_layers` CLIP-style blocks with a 3-D
(t, h, w) axial rotary on the first `3·2·⌊⌊Dh/3⌋/2⌋` channels of each head (the rest pass
through), full attention within one grid entry (an image, or one chunk of ≤ 4 temporal patches
of a video) → projector: per patch Linear-GELU-Linear to the LM width, then each merge² group
concatenated and fused by a second Linear-GELU-Linear → [N / merge², text hidden], one row per
placeholder token.

The reference is transformers' `MiniMaxM3VLVisionModel` + `MiniMaxM3VLMultiModalProjector`
(models/minimax_m3_vl). Checkpoint names (as `save_pretrained` writes them):
`vision_tower.vision_model.{embeddings.patch_embedding, pre_layrnorm, encoder.layers.i.*}`,
`multi_modal_projector.linear_{1,2}`, `patch_merge_mlp.linear_{1,2}`; the module tree below uses
the same names, so loading is a prefix strip plus the Conv3d reshape.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VISION_PREFIX = "vision_tower.vision_model."
PROJECTOR_PREFIX = "multi_modal_projector."
MERGE_PREFIX = "patch_merge_mlp."
# transformers' in-memory names (model.state_dict()) → the checkpoint's names.
_IN_MEMORY_NAMES = (
    ("model.vision_tower.embeddings.proj.", VISION_PREFIX + "embeddings.patch_embedding."),
    ("model.vision_tower.layers.", VISION_PREFIX + "encoder.layers."),
    ("model.vision_tower.", VISION_PREFIX),
    ("model.multi_modal_projector.merge_linear_", MERGE_PREFIX + "linear_"),
    ("model.multi_modal_projector.", PROJECTOR_PREFIX),
)


@dataclass(frozen=True)
class M3VisionConfig:
    """The tower's `vision_config` plus the two projector widths from the top-level config."""

    hidden_size: int = 1280
    intermediate_size: int = 5120
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    num_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    layer_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    hidden_act: str = "gelu"
    projector_hidden_size: int = 6144
    text_hidden_size: int = 6144

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_channels", "patch_size", "temporal_patch_size", "spatial_merge_size",
                     "projector_hidden_size", "text_hidden_size"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ValueError(f"M3VisionConfig.{name}={getattr(self, name)} must be > 0")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"M3VisionConfig.hidden_size={self.hidden_size} must be a multiple of "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.hidden_act != "gelu":
            raise ValueError(f"M3VisionConfig.hidden_act={self.hidden_act!r}: allowed 'gelu'")

    @property
    def merge_size(self) -> int:
        return self.spatial_merge_size

    @property
    def patch_dim(self) -> int:
        """Length of one flattened patch: C · T · P · P."""
        return self.num_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> "M3VisionConfig":
        """From a MiniMax-M3 `config.json` (model_type minimax_m3_vl) as a dict."""
        vision = dict(config["vision_config"])
        text = config["text_config"]
        rope = vision.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(
                f"vision_config.rope_parameters.rope_type={rope['rope_type']!r}: allowed 'axial'"
            )
        fields = {k: v for k, v in vision.items() if k in cls.__dataclass_fields__}
        return cls(
            **fields,
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            projector_hidden_size=int(config.get("projector_hidden_size", 6144)),
            text_hidden_size=int(text["hidden_size"]),
        )


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, Dh]; cos/sin [N, R] with R ≤ Dh: the first R channels rotate, the rest pass."""
    rotary = cos.shape[-1]
    x_rot, x_pass = x[..., :rotary], x[..., rotary:]
    x_rot = x_rot * cos[:, None] + rotate_half(x_rot) * sin[:, None]
    return torch.cat([x_rot, x_pass], dim=-1)


def vision_positions(grids: Sequence[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """(t, row, col) of each patch in the preprocess order (t, h/m, w/m, m, m): [Σ t·h·w, 3] int64;
    t restarts at 0 in each grid entry (each video chunk)."""
    out = []
    for t, h, w in grids:
        rows = torch.arange(h)[:, None].expand(h, w)
        cols = torch.arange(w)[None, :].expand(h, w)
        rows, cols = (
            x.reshape(h // merge, merge, w // merge, merge).transpose(1, 2).flatten() for x in (rows, cols)
        )
        times = torch.arange(t).repeat_interleave(h * w)
        out.append(torch.stack([times, rows.repeat(t), cols.repeat(t)], dim=-1))
    return torch.cat(out)


class AxialRotary(nn.Module):
    """Equal frequency bands for t, h and w: cos/sin [N, 3·2·F] laid out [t, h, w, t, h, w]."""

    def __init__(self, config: M3VisionConfig) -> None:
        super().__init__()
        spatial = 2 * ((config.head_dim // 3) // 2)
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float32) / spatial))
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [F]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq  # [N, 3, F]
        freqs = freqs.flatten(1)
        emb = torch.cat([freqs, freqs], dim=-1)  # [N, 6F]
        return emb.cos().to(dtype), emb.sin().to(dtype)


class VisionAttention(nn.Module):
    def __init__(self, config: M3VisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        width = config.hidden_size
        self.q_proj = nn.Linear(width, width)
        self.k_proj = nn.Linear(width, width)
        self.v_proj = nn.Linear(width, width)
        self.out_proj = nn.Linear(width, width)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[int]
    ) -> torch.Tensor:
        """x [N, E]; cos/sin [N, R]; segments: lengths of the runs that attend among themselves."""
        n, e = x.shape
        q, k, v = (proj(x).view(n, self.num_heads, -1) for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k = apply_partial_rotary(q, cos, sin), apply_partial_rotary(k, cos, sin)
        outputs, start = [], 0
        for length in segments:
            qs, ks, vs = (
                t[start : start + length].transpose(0, 1)[None] for t in (q, k, v)
            )  # [1, heads, L, Dh]
            outputs.append(F.scaled_dot_product_attention(qs, ks, vs)[0].transpose(0, 1).reshape(length, e))
            start += length
        return self.out_proj(torch.cat(outputs))


class VisionMLP(nn.Module):
    def __init__(self, config: M3VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class VisionEncoderLayer(nn.Module):
    def __init__(self, config: M3VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = VisionAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = VisionMLP(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[int]
    ) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), cos, sin, segments)
        return x + self.mlp(self.layer_norm2(x))


class TwoLayerGELU(nn.Module):
    """linear_2(gelu(linear_1(x))): the shape of both projector stages."""

    def __init__(self, width_in: int, hidden: int, width_out: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(width_in, hidden)
        self.linear_2 = nn.Linear(hidden, width_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(x)))


class M3VisionModel(nn.Module):
    """The tower alone: patches → per-patch hidden states [N, hidden_size]."""

    def __init__(self, config: M3VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = nn.Module()
        self.embeddings.patch_embedding = nn.Linear(config.patch_dim, config.hidden_size, bias=False)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(
            VisionEncoderLayer(config) for _ in range(config.num_hidden_layers)
        )
        self.rotary = AxialRotary(config)

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        weight = self.embeddings.patch_embedding.weight
        x = self.embeddings.patch_embedding(patches.to(weight.dtype))  # [N, E]
        positions = vision_positions(grids, self.config.spatial_merge_size).to(x.device)
        cos, sin = self.rotary(positions, x.dtype)  # [N, R]
        segments = [t * h * w for t, h, w in grids]  # one image or one video chunk attends to itself
        x = self.pre_layrnorm(x)
        for layer in self.encoder.layers:
            x = layer(x, cos, sin, segments)
        return x


class M3VisionTower(nn.Module):
    """Tower + projector: what the engine calls `model.visual` (see msaserve.engine.media)."""

    def __init__(self, config: M3VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.vision_model = M3VisionModel(config)
        merged = config.text_hidden_size * config.spatial_merge_size**2
        self.projector = TwoLayerGELU(
            config.hidden_size, config.projector_hidden_size, config.text_hidden_size
        )
        self.patch_merge = TwoLayerGELU(merged, config.projector_hidden_size, config.text_hidden_size)

    def forward(self, patches: torch.Tensor, grid_thw: Sequence[Sequence[int]]) -> torch.Tensor:
        """patches [Σ t·h·w, C·T·P·P] of grid entries grid_thw (images, video chunks; in order)
        → embeddings [Σ t·h·w / merge², text hidden], one per placeholder token."""
        grids = [(int(t), int(h), int(w)) for t, h, w in grid_thw]
        expected = (sum(t * h * w for t, h, w in grids), self.config.patch_dim)
        merge = self.config.spatial_merge_size
        if tuple(patches.shape) != expected or any(h % merge or w % merge for _, h, w in grids):
            raise ValueError(
                f"patches {tuple(patches.shape)} do not match grids {grids}: expected {expected} "
                f"on grids whose h and w are multiples of {merge}"
            )
        x = self.projector(self.vision_model(patches, grids))  # [N, text hidden]
        return self.patch_merge(x.reshape(x.shape[0] // merge**2, -1))

    def embed_media(self, media: Sequence[Any]) -> torch.Tensor:
        """Preprocessed MediaItems (numpy patches; a video's `grids` are its chunks) → embeddings
        [total placeholders, text hidden]."""
        device = self.vision_model.rotary.inv_freq.device
        patches = torch.cat([torch.from_numpy(m.patches) for m in media]).to(device)
        grids = [grid for m in media for grid in media_grids(m)]
        return self.forward(patches, grids)

    def load_hf_state_dict(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Load the vision tensors of an M3 checkpoint (checkpoint names, or transformers'
        in-memory `model.vision_tower.*` names); other names are ignored. Missing or unexpected
        vision tensors and wrong shapes raise ValueError naming them."""
        state = {}
        for name, tensor in tensors.items():
            ours = m3_vision_name(name)
            if ours is not None:
                state[ours] = tensor
        key = "vision_model.embeddings.patch_embedding.weight"
        if key in state:  # Conv3d [E, C, T, P, P] → the linear's [E, C·T·P·P]
            state[key] = state[key].reshape(state[key].shape[0], -1)
        expected = self.state_dict()
        missing = sorted(set(expected) - set(state))
        unexpected = sorted(set(state) - set(expected))
        wrong = [f"{n} {tuple(state[n].shape)} (expected {tuple(expected[n].shape)})"
                 for n in set(state) & set(expected) if state[n].shape != expected[n].shape]  # fmt: skip
        if missing or unexpected or wrong:
            raise ValueError(
                f"M3 vision tensors do not match the config: missing {missing[:8]}, unexpected "
                f"{unexpected[:8]}, wrong shape {wrong[:8]}"
            )
        self.load_state_dict(state, strict=True)


def m3_vision_name(name: str) -> str | None:
    """A checkpoint (or transformers in-memory) tensor name → its name in M3VisionTower, or None
    for a tensor that is not the tower's or the projector's."""
    for old, new in _IN_MEMORY_NAMES:
        if name.startswith(old):
            name = new + name[len(old) :]
            break
    for prefix, ours in ((VISION_PREFIX, "vision_model."), (PROJECTOR_PREFIX, "projector."),
                         (MERGE_PREFIX, "patch_merge.")):  # fmt: skip
        if name.startswith(prefix):
            return ours + name[len(prefix) :]
    return None


def media_grids(item: Any) -> list[tuple[int, int, int]]:
    """The grid entries one medium feeds the tower: its `grids` (a video's chunks) when it has
    them, else its single `grid_thw`."""
    grids = getattr(item, "grids", None)
    return [tuple(g) for g in grids] if grids else [tuple(item.grid_thw)]


def build_vision_tower(
    raw_config: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    device: torch.device | str,
    dtype: torch.dtype,
) -> M3VisionTower:
    """The tower of a VL checkpoint (config.json as a dict, its vision tensors by checkpoint name)
    on `device` in `dtype`, without initialising weights that are about to be overwritten."""
    config = M3VisionConfig.from_hf(raw_config)
    with torch.device("meta"):
        tower = M3VisionTower(config)
    tower = tower.to_empty(device=device).to(dtype)
    tower.vision_model.rotary = AxialRotary(config).to(device)  # its buffer is computed, not loaded
    tower.load_hf_state_dict(tensors)
    return tower.eval()
