"""Pinned host memory for the arenas of KV cache shards in this process (`kvcache/arena.py`).

The service imports no torch; the engine that runs it in-process hands its shards this allocator,
so that the index pages it adopts can be copied to the GPU straight from the service's memory
(`direct_index.py`). A segment is the numpy view of a pinned tensor, which holds that tensor
(`ndarray.base`): the reader gets the pinned tensor back from it (one made with `torch.from_numpy`
would not be known to torch as pinned), and the memory goes when the arena does.
"""

import contextlib
import ctypes
import logging

import numpy as np
import torch

log = logging.getLogger(__name__)


def pinned_segment(nbytes: int) -> np.ndarray:
    """A segment allocator (`kvcache.arena.SegmentAllocator`): nbytes of pinned host memory."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()


_REGISTER_TRIED: set[int] = set()
"""Addresses of segments this process asked CUDA to page-lock (once each, whatever the answer)."""


def segment_tensor(segment: np.ndarray, device: torch.device | str | None = None) -> torch.Tensor:
    """The host tensor over a segment's bytes: the pinned tensor it is a view of, or (a segment of
    plain memory) a tensor sharing its memory. With a CUDA `device`, a segment of plain memory —
    a shard's shared segment file mapped into this process (`kvcache/shared_segments.py`) — is
    page-locked in place first (`cudaHostRegister`, once per segment), so copies from it are
    asynchronous DMA; where that fails it stays pageable (copies still correct, slower)."""
    base = segment.base
    if isinstance(base, torch.Tensor) and base.dtype == torch.uint8 and base.numel() == segment.nbytes \
            and base.data_ptr() == segment.ctypes.data:
        return base
    tensor = torch.from_numpy(segment)
    if device is not None and torch.device(device).type == "cuda" and segment.nbytes:
        _register(tensor)
    return tensor


def _register(tensor: torch.Tensor) -> None:
    """Page-lock the tensor's memory in place, once; where CUDA refuses, it stays pageable and the
    refusal is logged once (Linux pins writable file-backed memory long-term only on shmem: a
    segment file outside a tmpfs such as /dev/shm is refused)."""
    address = tensor.data_ptr()
    if address in _REGISTER_TRIED:
        return
    _REGISTER_TRIED.add(address)
    try:
        code = torch.cuda.cudart().cudaHostRegister(address, tensor.numel(), 0)  # a cudaError_t
        refused = int(getattr(code, "value", code)) != 0
    except (RuntimeError, AttributeError, TypeError) as error:
        code, refused = error, True
    if refused:
        _clear_last_cuda_error()
        log.warning("cudaHostRegister of a %d-byte shared segment refused (%s): its copies stay "
                    "pageable, slower; keep shared segment files on a tmpfs (/dev/shm)", tensor.numel(), code)


def _clear_last_cuda_error() -> None:
    """Reset the runtime's last error after a refused cudaHostRegister (not a sticky error): else
    torch's next kernel-launch check would read it and raise on an unrelated launch."""
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(name).cudaGetLastError()  # the copy torch loaded: same soname
            return


def segment_allocators(device: torch.device | str, stores: tuple[str, ...] = ("index",)) -> dict | None:
    """What to give in-process shards (`KVCacheClient.in_process(..., segment_allocators=)`) for an
    engine on `device`: pinned arenas for `stores` on CUDA (the index store by default: the
    adoption copies index pages to the GPU from there; with "kv" too, a sparse-resident adoption
    leases its K/V pages and its kernels read them there, `HostKV.attach_lease`), None elsewhere
    (plain pages, as before)."""
    if torch.device(device).type != "cuda":
        return None
    return {store: pinned_segment for store in stores}
