"""A CUDA tensor over pinned host memory (unified virtual addressing): kernels read it over PCIe
without a copy first, so a host-memory page can be fetched by a kernel that decides on the GPU
which pages it needs (no device → host sync to tell the host)."""

import torch


class _CudaArray:
    """The `__cuda_array_interface__` of pinned memory: under UVA its host address is its device one."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor  # keeps the memory alive as long as the view
        self.__cuda_array_interface__ = dict(
            shape=(tensor.numel() * tensor.element_size(),), typestr="|u1",
            data=(tensor.data_ptr(), False), strides=None, version=3, stream=None)


def host_view(tensor: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """pinned CPU tensor (contiguous) → a CUDA tensor of the same shape and dtype over the same
    memory, or None where that is not possible (not pinned, no UVA, not CUDA)."""
    device = torch.device(device)
    if device.type != "cuda" or not tensor.is_pinned() or not tensor.is_contiguous():
        return None
    try:
        with torch.cuda.device(device):
            raw = torch.as_tensor(_CudaArray(tensor), device=device)
    except (RuntimeError, TypeError, ValueError):
        return None
    if raw.device.type != "cuda" or raw.data_ptr() != tensor.data_ptr():
        return None
    view = raw.view(tensor.dtype).view(tensor.shape)
    view._msaserve_host = tensor  # type: ignore[attr-defined]  # the host tensor outlives the view
    return view
