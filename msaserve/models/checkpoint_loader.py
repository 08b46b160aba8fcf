"""Load a safetensors checkpoint directory into a registered architecture's model, shard by shard
straight onto the target device, after `checkpoint_plan` has checked every name and shape."""

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from msaserve.models.checkpoint_plan import LoadPlan, Piece, TensorInfo, plan_load, read_headers
from msaserve.models.config import MSAConfig
from msaserve.models.fp8_blocks import dequantize_blocks, fp8_block_size
from msaserve.models.memory_check import check_fits
from msaserve.models.registry import read_config_json


@dataclass
class LoadedCheckpoint:
    model: nn.Module
    config: MSAConfig
    vision_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """The vision tower's tensors by checkpoint name (on the device, in the dtype) when asked for."""


def load_checkpoint(
    directory: str | Path,
    parse_config: Callable[[dict], MSAConfig],
    model_class: Callable[[MSAConfig, str], nn.Module],
    map_name: Callable[[str], Piece | str],
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    attention_backend: str = "msa",
    progress: bool = True,
    keep_vision: bool = False,
) -> LoadedCheckpoint:
    """Build `model_class(config)` without memory, plan the load (raises CheckpointMismatch naming
    every missing, unexpected or misshapen tensor before any weight is read), then read the shards
    one by one onto `device`, dequantizing block-fp8 weights, into `dtype`."""
    directory = Path(directory)
    raw = read_config_json(directory)
    config = parse_config(raw)
    infos = read_headers(directory)
    with torch.device("meta"):
        model = model_class(config, attention_backend)
    params = {name: tuple(p.shape) for name, p in model.named_parameters()}
    tied = ("lm_head.weight",) if getattr(config, "tie_word_embeddings", False) else ()
    block = fp8_block_size(raw)
    plan = plan_load(infos, params, map_name, block, ignored_params=tied)
    check_fits(model, directory.name, dtype, device)
    model = model.to(dtype=dtype).to_empty(device=device)
    state = dict(model.named_parameters())
    vision: dict[str, torch.Tensor] = {}
    wanted = set(plan.pieces) | (set(plan.vision) if keep_vision else set())
    files = sorted({infos[name].file for name in wanted})
    for path in tqdm(files, desc="loading shards", unit="shard", file=sys.stderr, disable=not progress):
        names = [info.name for info in infos.values() if info.file == path and info.name in wanted]
        with safe_open(str(path), framework="pt", device=str(device)) as f, torch.no_grad():
            for name in names:
                tensor = _read(f, path, name, plan, block, device)
                if name in plan.pieces:
                    piece = plan.pieces[name]
                    piece.view(state[piece.param]).copy_(tensor.to(dtype))
                else:
                    vision[name] = tensor.to(dtype)
    return LoadedCheckpoint(model.eval(), config, vision)


def _read(f, path: Path, name: str, plan: LoadPlan, block: tuple[int, int] | None, device) -> torch.Tensor:
    """Tensor `name` of the open shard `f` (at `path`), dequantized if it is block-fp8."""
    tensor = f.get_tensor(name)
    scale_info: TensorInfo | None = plan.scales.get(name)
    if scale_info is None:
        return tensor
    assert block is not None, "plan_load accepts fp8 weights only with a block size"
    if scale_info.file == path:
        return dequantize_blocks(tensor, f.get_tensor(scale_info.name), block)
    with safe_open(str(scale_info.file), framework="pt", device=str(device)) as g:  # in another shard
        return dequantize_blocks(tensor, g.get_tensor(scale_info.name), block)
