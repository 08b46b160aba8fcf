"""MiniMax-M3 in the model registry: config.json of model_type minimax_m3_vl (the VL wrapper) or
minimax_m3_vl_text (text only), the text model, and its checkpoint names."""

from pathlib import Path

import torch
from torch import nn

from msaserve.models.checkpoint_loader import load_checkpoint
from msaserve.models.minimax_m3.config import TEXT_MODEL_TYPE, VL_MODEL_TYPE, M3Config, m3_config_from_hf
from msaserve.models.minimax_m3.model import M3ForCausalLM
from msaserve.models.minimax_m3.vision import build_vision_tower
from msaserve.models.minimax_m3.weights import m3_piece
from msaserve.models.registry import Architecture, read_config_json


def load_m3(
    directory: Path, device: torch.device | str, dtype: torch.dtype, attention_backend: str, progress: bool
) -> tuple[nn.Module, M3Config]:
    """An M3 checkpoint: the text model, and for a VL checkpoint its vision tower + projector as
    `model.visual` (the vision tensors are checked by name in the same plan, read in the same pass)."""
    raw = read_config_json(directory)
    has_vision = raw.get("model_type") == VL_MODEL_TYPE and raw.get("vision_config") is not None
    loaded = load_checkpoint(
        directory, m3_config_from_hf, M3ForCausalLM, m3_piece, device, dtype, attention_backend, progress,
        keep_vision=has_vision,
    )
    if has_vision:
        loaded.model.visual = build_vision_tower(raw, loaded.vision_tensors, device, dtype)
    return loaded.model, loaded.config


ARCHITECTURE = Architecture(
    name="minimax_m3",
    model_types=(VL_MODEL_TYPE, TEXT_MODEL_TYPE),
    parse_config=m3_config_from_hf,
    model_class=M3ForCausalLM,
    load=load_m3,
)
