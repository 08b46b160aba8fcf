"""Pinned host memory for the arenas of KV cache shards in this process (`kvcache/arena.py`).

The service imports no torch; the engine that runs it in-process hands its shards this allocator,
so that the index pages it adopts can be copied to the GPU straight from the service's memory
(`direct_index.py`). Segments live as long as the process (an arena never gives one back); each is
remembered by its address so that a reader gets the pinned tensor back from the numpy view the
service hands out (a tensor made with `torch.from_numpy` would not be known as pinned).
"""

import threading

import numpy as np
import torch

_segments: dict[int, torch.Tensor] = {}
_lock = threading.Lock()


def pinned_segment(nbytes: int) -> np.ndarray:
    """A segment allocator (`kvcache.arena.SegmentAllocator`): nbytes of pinned host memory."""
    tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    with _lock:
        _segments[tensor.data_ptr()] = tensor
    return tensor.numpy()


def segment_tensor(segment: np.ndarray) -> torch.Tensor:
    """The host tensor over a segment's bytes: the pinned tensor it was allocated as, or (a
    segment of plain memory) a tensor sharing its memory."""
    with _lock:
        tensor = _segments.get(segment.ctypes.data)
    if tensor is not None and tensor.numel() == segment.nbytes:
        return tensor
    return torch.from_numpy(segment)


def segment_allocators(device: torch.device | str, stores: tuple[str, ...] = ("index",)) -> dict | None:
    """What to give in-process shards (`KVCacheClient.in_process(..., segment_allocators=)`) for an
    engine on `device`: pinned arenas for `stores` on CUDA (the index store by default: the
    adoption copies index pages to the GPU from there; K/V pages reach the GPU through the
    session's own pinned host tier), None elsewhere (plain pages, as before)."""
    if torch.device(device).type != "cuda":
        return None
    return {store: pinned_segment for store in stores}
