"""Sharded safetensors checkpoints with HF-style names (`model.layers.{i}.self_attn.q_proj.weight`).

A directory holds `config.json` and either `model.safetensors` or shards listed by
`model.safetensors.index.json` (`weight_map`: tensor name → shard file).
"""

import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from msaserve.models.config import MSAConfig
from msaserve.models.transformer import MSATransformer

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def hf_name(name: str) -> str:
    """Our parameter name → the HF checkpoint name (everything but the LM head sits under model.)."""
    return name if name.startswith("lm_head.") else f"model.{name}"


def our_name(name: str) -> str:
    return name.removeprefix("model.")


def _shard_files(directory: Path) -> list[Path]:
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [directory / name for name in sorted(set(weight_map.values()))]
    single = directory / SINGLE_FILE
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"{directory} has neither {INDEX_FILE} nor {SINGLE_FILE}")


def load_safetensors(
    directory: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    attention_backend: str = "msa",
    progress: bool = True,
) -> tuple[MSATransformer, MSAConfig]:
    """Build the model of `directory/config.json` and load every tensor by name (strict)."""
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"{directory} has no config.json: not a safetensors checkpoint directory")
    config = MSAConfig.from_json(directory / "config.json")
    state: dict[str, torch.Tensor] = {}
    shards = tqdm(_shard_files(directory), desc="loading shards", unit="shard", file=sys.stderr,
                  disable=not progress)
    for shard in shards:
        with safe_open(str(shard), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                state[our_name(name)] = f.get_tensor(name).to(dtype)
    with torch.device("meta"):
        model = MSATransformer(config, attention_backend)
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(device=device, dtype=dtype).eval(), config


def save_safetensors(
    model: MSATransformer, directory: str | Path, max_shard_bytes: int = 5 << 30
) -> list[Path]:
    """Write config.json and the weights in shards of at most `max_shard_bytes` (a tensor larger
    than that gets a shard of its own); an index file when there is more than one shard."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=2))
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in model.state_dict().items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][hf_name(name)] = tensor.detach().cpu().contiguous()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(directory / SINGLE_FILE), metadata={"format": "pt"})
        return [directory / SINGLE_FILE]
    paths, weight_map = [], {}
    for i, shard in enumerate(shards):
        path = directory / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path), metadata={"format": "pt"})
        weight_map.update({name: path.name for name in shard})
        paths.append(path)
    total = sum(t.numel() * t.element_size() for shard in shards for t in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return paths
