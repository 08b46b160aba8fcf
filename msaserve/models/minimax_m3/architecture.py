"""MiniMax-M3 in the model registry: config.json of model_type minimax_m3_vl (the VL wrapper) or
minimax_m3_vl_text (text only), the text model, and its checkpoint names."""

from pathlib import Path

import torch
from torch import nn

from msaserve.models.checkpoint_loader import load_checkpoint
from msaserve.models.minimax_m3.config import TEXT_MODEL_TYPE, VL_MODEL_TYPE, M3Config, m3_config_from_hf
from msaserve.models.minimax_m3.model import M3ForCausalLM
from msaserve.models.minimax_m3.weights import m3_piece
from msaserve.models.registry import Architecture


def load_m3(
    directory: Path, device: torch.device | str, dtype: torch.dtype, attention_backend: str, progress: bool
) -> tuple[nn.Module, M3Config]:
    """The text model of an M3 checkpoint. A VL checkpoint's vision tensors are checked by name
    (they must be the tower's) and not read here: the vision tower is attached by its own loader."""
    loaded = load_checkpoint(
        directory, m3_config_from_hf, M3ForCausalLM, m3_piece, device, dtype, attention_backend, progress
    )
    return loaded.model, loaded.config


ARCHITECTURE = Architecture(
    name="minimax_m3",
    model_types=(VL_MODEL_TYPE, TEXT_MODEL_TYPE),
    parse_config=m3_config_from_hf,
    model_class=M3ForCausalLM,
    load=load_m3,
)
