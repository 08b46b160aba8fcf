"""Which architecture a checkpoint directory holds: `model_type` of its config.json → how to read
its config, which model class to build and how to load its weights.

Adding an architecture is one new module that defines `ARCHITECTURE` plus one line in
`_MODULES`. Modules are imported on first use, so reading the registry pulls in no model code.
"""

import json
from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path
from typing import Any

import torch
from torch import nn

from msaserve.models.config import MSAConfig

# Module defining ARCHITECTURE, per architecture (in the order errors list them).
_MODULES = (
    "msaserve.models.msa_architecture",
    "msaserve.models.minimax_m3.architecture",
)
# msaserve's own checkpoints written before model_type was read carry none; they are MSA.
DEFAULT_MODEL_TYPE = "msa"

LoadFn = Callable[[Path, torch.device | str, torch.dtype, str, bool], tuple[nn.Module, MSAConfig]]


@dataclass(frozen=True)
class Architecture:
    """One model family: its config.json reader, its model class and its checkpoint loader."""

    name: str
    model_types: tuple[str, ...]
    """config.json `model_type` values this architecture loads."""
    parse_config: Callable[[dict[str, Any]], MSAConfig]
    """config.json dict → the model's config (an MSAConfig, so the engine can size its pages)."""
    model_class: Callable[[MSAConfig, str], nn.Module]
    """(config, attention_backend) → the model with uninitialised weights."""
    load: LoadFn
    """(directory, device, dtype, attention_backend, progress) → (model in eval mode, config)."""


class UnsupportedModelType(ValueError):
    """A config.json whose model_type no registered architecture loads."""


def architectures() -> list[Architecture]:
    return [import_module(name).ARCHITECTURE for name in _MODULES]


def supported_model_types() -> list[str]:
    return [t for arch in architectures() for t in arch.model_types]


def architecture_for(model_type: str | None) -> Architecture:
    """The architecture registered for `model_type` (None: msaserve's own MSA)."""
    model_type = model_type or DEFAULT_MODEL_TYPE
    for arch in architectures():
        if model_type in arch.model_types:
            return arch
    raise UnsupportedModelType(
        f"model_type={model_type!r} is not supported: allowed {', '.join(supported_model_types())}"
    )


def read_config_json(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{directory} has no config.json: not a checkpoint directory")
    return json.loads(path.read_text())


def architecture_of(directory: str | Path) -> Architecture:
    """The architecture of the checkpoint in `directory`, by its config.json's model_type."""
    return architecture_for(read_config_json(directory).get("model_type"))
