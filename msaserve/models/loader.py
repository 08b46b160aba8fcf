"""`load_model(spec)`: one entry point for every model source the engine and CLI accept.

spec: "smollm2" (the bundled GGUF), a preset name ("tiny", "m3-mini", "m3-proxy"), a directory with
config.json + safetensors, or a path to a .gguf file.
"""

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from tokenizers import Tokenizer as BackendTokenizer

from msaserve.models.checkpoint_plan import CheckpointMismatch
from msaserve.models.config import MSAConfig
from msaserve.models.gguf_loader import ModelFileMissing, load_gguf, smollm2_gguf_path
from msaserve.models.memory_check import check_fits
from msaserve.models.minimax_m3.random_weights import init_m3_random_weights
from msaserve.models.presets import CHECKPOINT_PRESETS, PRESETS, get_preset, preset_config_json, preset_names
from msaserve.models.registry import architecture_for, architecture_of
from msaserve.models.tokenizer import Tokenizer
from msaserve.models.transformer import MSATransformer, init_random_weights
from msaserve.models.vision import VisionConfig, VisionTower


@dataclass
class LoadedModel:
    model: MSATransformer
    tokenizer: Tokenizer
    config: MSAConfig


def load_model(
    spec: str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    attention_backend: str = "msa",
    progress: bool = True,
    seed: int = 0,
    **overrides: Any,
) -> LoadedModel:
    """Load `spec` onto `device` in `dtype`, in eval mode.

    overrides: config fields to change — for presets any field (m3-proxy needs num_layers), for
    GGUF the MSA conversion (page_size, top_k, n_init). seed: presets' random weights.
    """
    if spec == "smollm2":
        spec = str(smollm2_gguf_path())
    if spec in CHECKPOINT_PRESETS:
        return _load_checkpoint_preset(spec, device, dtype, attention_backend, seed, progress, overrides)
    if spec in PRESETS:
        return _load_preset(spec, device, dtype, attention_backend, seed, progress, overrides)
    path = Path(spec)
    if path.suffix == ".gguf":
        model, tokenizer, config = load_gguf(path, device, dtype, attention_backend, progress, **overrides)
        return LoadedModel(model, tokenizer, config)
    if path.is_dir():
        try:
            model, config = architecture_of(path).load(path, device, dtype, attention_backend, progress)
        except ValidationError as e:  # config.json lacks or mistypes a field: one line per field
            raise CheckpointMismatch(f"{path / 'config.json'} does not describe a {e.title}: "
                                     f"{validation_problems(e)}") from None
        return LoadedModel(model, _directory_tokenizer(path, config), config)
    raise _not_found(spec)


def validation_problems(e: ValidationError) -> str:
    """pydantic's errors as `field: message; ...`, not its multi-line dump with documentation links (a
    model validator's error, whose message names its fields, without pydantic's "Value error, ")."""
    return "; ".join(
        ": ".join(filter(None, (".".join(map(str, err["loc"])), err["msg"].removeprefix("Value error, "))))
        for err in e.errors()
    )


def check_model_spec(spec: str) -> None:
    """Raise `load_model`'s ModelFileMissing now, reading no weights, for a spec it could not find:
    `msaserve serve` says so before it starts Ray (a missing path was a traceback from the readiness
    probe, after the whole app had deployed)."""
    if spec == "smollm2":
        smollm2_gguf_path()
        return
    path = Path(spec)
    if spec in CHECKPOINT_PRESETS or spec in PRESETS or path.is_dir():
        return
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelFileMissing(f"GGUF file {path} not found")
        return
    raise _not_found(spec)


def _not_found(spec: str) -> ModelFileMissing:
    return ModelFileMissing(
        f"model {spec!r} not found: expected 'smollm2', a preset ({', '.join(preset_names())}), a directory "
        "with config.json and safetensors, or a .gguf file"
    )


def _load_preset(name: str, device: torch.device | str, dtype: torch.dtype, backend: str, seed: int,
                 progress: bool, overrides: dict[str, Any]) -> LoadedModel:
    config = get_preset(name, **overrides)
    if progress:
        print(f"initialising {name} ({config.num_layers} layers) with random weights, seed {seed}",
              file=sys.stderr)
    with torch.device(device):
        model = MSATransformer(config, backend).to(dtype)
    init_random_weights(model, seed=seed)
    attach_random_vision_tower(model, seed, device, dtype)
    return LoadedModel(model.eval(), Tokenizer.byte_level(config.vocab_size), config)


def _load_checkpoint_preset(name: str, device: torch.device | str, dtype: torch.dtype, backend: str,
                            seed: int, progress: bool, overrides: dict[str, Any]) -> LoadedModel:
    """A config.json preset (m3-mini): config and model class from the registry by model_type,
    as for a checkpoint directory; built without memory, then materialised in `dtype` on
    `device` (never in fp32 first: m3-mini's experts alone are ≈ 44 GB in bf16) and filled with
    random weights instead of a checkpoint's."""
    raw = preset_config_json(name, **overrides)
    architecture = architecture_for(raw["model_type"])
    config = architecture.parse_config(raw)
    if progress:
        print(f"initialising {name} ({config.num_layers} layers) with random weights, seed {seed}",
              file=sys.stderr)
    with torch.device("meta"):
        model = architecture.model_class(config, backend)
    check_fits(model, name, dtype, device)
    model = model.to(dtype=dtype).to_empty(device=device)
    init_m3_random_weights(model, seed=seed)
    return LoadedModel(model.eval(), Tokenizer.byte_level(config.vocab_size), config)


def attach_random_vision_tower(
    model: MSATransformer, seed: int, device: torch.device | str, dtype: torch.dtype
) -> None:
    """`model.visual`: the config's vision tower with PyTorch's default init drawn from `seed`
    (unit LayerNorms, fan-in-scaled linears, so media embeddings have the scale of real ones).
    Presets only: checkpoint loaders build the text model, whose state dict has no tower."""
    if model.config.vision is None:
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tower = VisionTower(VisionConfig.from_dict(model.config.vision))
    model.visual = tower.to(device=device, dtype=dtype).eval()


def _directory_tokenizer(directory: Path, config: MSAConfig) -> Tokenizer:
    """tokenizer.json (+ chat template from tokenizer_config.json, or chat_template.jinja as
    transformers 5 writes it) if the checkpoint has one, else the byte-level tokenizer of the presets."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        return Tokenizer.byte_level(config.vocab_size)
    eos = set(getattr(config, "eos_token_ids", ()))
    if config.eos_token_id is not None:
        eos.add(config.eos_token_id)
    tokenizer_config = directory / "tokenizer_config.json"
    template = None
    if tokenizer_config.is_file():
        template = json.loads(tokenizer_config.read_text()).get("chat_template")
    if template is None and (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text()
    backend = BackendTokenizer.from_file(str(path))
    return Tokenizer(backend, bos_token_id=config.bos_token_id, eos_token_ids=eos, chat_template=template)
