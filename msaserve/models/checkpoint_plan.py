"""Plan a checkpoint load before reading any weight: every tensor of a safetensors directory is
mapped to the piece of a model parameter it fills, and a wrong or partial checkpoint is refused
with the names and shapes of the missing, unexpected or misshapen tensors.

Only safetensors headers are read here (names, shapes, dtypes), so the check costs no weight I/O.
"""

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
IGNORED = "<ignored>"
"""map_name result: a tensor the model does not use (e.g. multi-token-prediction heads)."""
VISION = "<vision>"
"""map_name result: a tensor of the vision tower, loaded by the tower, not the text model."""
SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
_MAX_LISTED = 12


@dataclass(frozen=True)
class Piece:
    """The part of parameter `param` one checkpoint tensor fills: all of it, or the slice of one
    expert (`expert`: index on the first axis) and/or one half of the rows (`half` 0 = the first
    half, gate; 1 = the second, up)."""

    param: str
    expert: int | None = None
    half: int | None = None

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        target = tensor if self.expert is None else tensor[self.expert]
        if self.half is None:
            return target
        rows = target.shape[0] // 2
        return target[self.half * rows:(self.half + 1) * rows]

    def shape(self, full: tuple[int, ...]) -> tuple[int, ...] | None:
        """The piece's shape inside a parameter of shape `full` (None: the piece does not fit)."""
        shape = full
        if self.expert is not None:
            if not shape or not 0 <= self.expert < shape[0]:
                return None
            shape = shape[1:]
        if self.half is not None:
            if not shape or shape[0] % 2:
                return None
            shape = (shape[0] // 2, *shape[1:])
        return shape

    def describe(self) -> str:
        parts = [] if self.expert is None else [f"expert {self.expert}"]
        parts += [] if self.half is None else [("gate", "up")[self.half] + " half"]
        return self.param + (f" ({', '.join(parts)})" if parts else "")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    shape: tuple[int, ...]
    dtype: str
    """safetensors dtype name: F32, BF16, F8_E4M3, ..."""


@dataclass
class LoadPlan:
    pieces: dict[str, Piece] = field(default_factory=dict)
    """checkpoint tensor name → the piece it fills."""
    scales: dict[str, TensorInfo] = field(default_factory=dict)
    """fp8 weight name → its block scales (`<weight>_scale_inv`)."""
    vision: list[str] = field(default_factory=list)
    """names of the vision tower's tensors."""


class CheckpointMismatch(ValueError):
    """The checkpoint's tensors do not match the model its config.json describes."""


def read_headers(directory: Path) -> dict[str, TensorInfo]:
    """Every tensor of the checkpoint (from the index's shards, or model.safetensors), by name."""
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (directory / SINGLE_FILE).is_file():
        weight_map, files = {}, [SINGLE_FILE]
    else:
        raise FileNotFoundError(f"{directory} has neither {INDEX_FILE} nor {SINGLE_FILE}")
    infos: dict[str, TensorInfo] = {}
    for file in files:
        path = directory / file
        if not path.is_file():
            raise CheckpointMismatch(f"shard {file} listed in {INDEX_FILE} is missing from {directory}")
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                part = f.get_slice(name)
                infos[name] = TensorInfo(name, path, tuple(part.get_shape()), part.get_dtype())
    absent = [name for name in weight_map if name not in infos]
    if absent:
        raise CheckpointMismatch(f"{INDEX_FILE} lists tensors its shards do not hold: {absent[:_MAX_LISTED]}")
    return infos


def plan_load(
    infos: dict[str, TensorInfo],
    params: dict[str, tuple[int, ...]],
    map_name: Callable[[str], Piece | str],
    fp8_block: tuple[int, int] | None,
    ignored_params: tuple[str, ...] = (),
) -> LoadPlan:
    """Map every tensor to its piece and check that, together, they fill every parameter exactly
    once with the right shapes; raise CheckpointMismatch listing every problem otherwise."""
    plan, problems = LoadPlan(), []
    covered: dict[str, set[tuple[int | None, int | None]]] = {name: set() for name in params}
    for name, info in infos.items():
        if name.endswith(SCALE_SUFFIX):
            if name.removesuffix(SCALE_SUFFIX) not in infos:
                problems.append(f"unexpected tensor {name} {list(info.shape)} (a scale of no weight)")
            continue
        target = map_name(name)
        if target == VISION:
            plan.vision.append(name)
            continue
        if target == IGNORED or (isinstance(target, Piece) and target.param in ignored_params):
            continue
        if not isinstance(target, Piece) or target.param not in params:
            problems.append(f"unexpected tensor {name} {list(info.shape)}")
            continue
        expected = target.shape(params[target.param])
        if expected != info.shape:
            problems.append(f"tensor {name} has shape {list(info.shape)}: expected "
                            f"{list(expected) if expected else '(no such slice)'} for {target.describe()}")
            continue
        key = (target.expert, target.half)
        if key in covered[target.param]:
            problems.append(f"tensor {name} fills {target.describe()}, which another tensor fills too")
        covered[target.param].add(key)
        plan.pieces[name] = target
        problems += _check_scale(name, info, infos, fp8_block, plan)
    for param, got in covered.items():
        if param in ignored_params:
            continue
        for expert, half in _missing(params[param], got):
            piece = Piece(param, expert, half)
            problems.append(f"missing tensor for {piece.describe()} {list(piece.shape(params[param]) or ())}")
    if problems:
        listed = "\n  ".join(problems[:_MAX_LISTED])
        more = f"\n  ... and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
        raise CheckpointMismatch(f"checkpoint does not match its config.json:\n  {listed}{more}")
    return plan


def _check_scale(name: str, info: TensorInfo, infos: dict[str, TensorInfo],
                 fp8_block: tuple[int, int] | None, plan: LoadPlan) -> list[str]:
    scale = infos.get(name + SCALE_SUFFIX)
    if info.dtype not in FP8_DTYPES:
        return [] if scale is None else [f"unexpected tensor {scale.name} {list(scale.shape)}: "
                                         f"{name} is {info.dtype}, not fp8"]
    if scale is None or fp8_block is None:
        missing = "quantization_config.weight_block_size"
        if scale is None:
            missing = f"its scale {name}{SCALE_SUFFIX}"
        return [f"fp8 tensor {name} {list(info.shape)} has no {missing}"]
    rows, cols = info.shape[-2:]
    expected = (*info.shape[:-2], -(-rows // fp8_block[0]), -(-cols // fp8_block[1]))
    if scale.shape != expected:
        return [f"tensor {scale.name} has shape {list(scale.shape)}: expected {list(expected)} "
                f"(blocks of {list(fp8_block)} over {list(info.shape)})"]
    plan.scales[name] = scale
    return []


def _missing(
    shape: tuple[int, ...], got: set[tuple[int | None, int | None]]
) -> list[tuple[int | None, int | None]]:
    """The (expert, half) units of a parameter of `shape` that no tensor filled."""
    if (None, None) in got:
        return []
    if not got:
        return [(None, None)]
    experts = range(shape[0]) if any(e is not None for e, _ in got) else [None]
    halves = (0, 1) if any(h is not None for _, h in got) else [None]
    return [
        (e, h) for e in experts for h in halves
        if (e, h) not in got and (e, None) not in got and (None, h) not in got
    ]
