"""The engine's face for loading a model: what its callers (the CLI, the Serve deployments) need, so
that they reach `msaserve.models` only through the engine (the layering in docs/design.md §1)."""

from msaserve.models.checkpoint_plan import CheckpointMismatch
from msaserve.models.gguf_loader import ModelFileMissing
from msaserve.models.loader import LoadedModel, check_model_spec, load_model, validation_problems
from msaserve.models.memory_check import ModelTooLarge
from msaserve.models.registry import UnsupportedModelType
from msaserve.models.tokenizer import Tokenizer

__all__ = [
    "CheckpointMismatch", "LoadedModel", "ModelFileMissing", "ModelTooLarge", "Tokenizer",
    "UnsupportedModelType", "check_model_spec", "load_model", "validation_problems",
]
