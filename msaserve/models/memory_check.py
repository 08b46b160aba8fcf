"""Refuse, before allocating, a model whose weights cannot fit where it is to be loaded.

A preset or checkpoint is built on the meta device first, so its parameter bytes in the target dtype
are known before any memory is taken; loading `m3-mini` (≈ 50 GB in bf16, twice that in fp32) on a
24 GiB CPU machine would otherwise end in the kernel's OOM killer with no message.
"""

from pathlib import Path

import torch
from torch import nn


class ModelTooLarge(MemoryError):
    """The model's weights exceed the memory available on the target device; the message says how much
    each is and what to change."""


def weight_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """Bytes of the model's parameters and buffers once materialised in `dtype` (float ones; others keep
    their own dtype)."""
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        itemsize = dtype.itemsize if tensor.dtype.is_floating_point else tensor.dtype.itemsize
        total += tensor.numel() * itemsize
    return total


def available_bytes(device: torch.device | str) -> int | None:
    """Free memory on `device`: CUDA's free bytes, or the host's MemAvailable (Linux); None if unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    meminfo = Path("/proc/meminfo")
    if device.type != "cpu" or not meminfo.is_file():
        return None
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def check_fits(model: nn.Module, name: str, dtype: torch.dtype, device: torch.device | str) -> None:
    """Raise ModelTooLarge if `model` (on the meta device) would not fit on `device` in `dtype`."""
    needed, free = weight_bytes(model, dtype), available_bytes(device)
    if free is None or needed <= free:
        return
    dtype_name = str(dtype).removeprefix("torch.")
    raise ModelTooLarge(
        f"model {name!r} needs {needed / 2**30:.1f} GiB for its weights in {dtype_name} on "
        f"{torch.device(device).type}, and {free / 2**30:.1f} GiB is available: load it on a device with "
        "more memory (model.device: cuda), in a smaller dtype, or with fewer layers (the "
        "num_hidden_layers override)"
    )
