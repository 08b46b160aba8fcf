"""What the driver sends the ranks each step: one `StepMessage` read by every rank (the step's one
broadcast; no per-layer round trips): inline in each rank's call when small, else put in Ray's
object store once (`group.py`)."""

import dataclasses
from dataclasses import dataclass

import torch

from msaserve.models.metadata import AttentionMetadata


@dataclass
class StepMessage:
    input_ids: torch.Tensor
    """[T] int64 on the host: the step's new tokens, flattened."""
    meta: AttentionMetadata
    """The step's metadata, its tensors on the host (each rank copies them to its device once)."""
    sample_rows: list[int]
    """Batch rows that get a token this step (their logits come back)."""
    decode_steps: int = 1
    """Above 1: a greedy decode round of that many steps on the ranks (tokens come back)."""

    @property
    def nbytes(self) -> int:
        tensors = [self.input_ids] + [getattr(self.meta, f.name) for f in dataclasses.fields(self.meta)]
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def meta_to(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    """A copy of `meta` with its tensors on `device`."""
    moved = {f.name: getattr(meta, f.name).to(device) for f in dataclasses.fields(meta)
             if isinstance(getattr(meta, f.name), torch.Tensor)}
    return dataclasses.replace(meta, **moved)
