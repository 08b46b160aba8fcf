"""Moving many page payloads from host memory to a device: packed into reused pinned buffers.

A million-token session's index is 8,192 payloads of 64 KiB (M3 shape, 2 layers) — 0.5 GiB.
Stacking them into one fresh host array and copying that from pageable memory measured 1.3 GB/s
on the H200's host (most of it first-touch page faults of the fresh array). Here the payloads are
packed, a chunk at a time, into one of two pinned buffers that live as long as the process, and
each chunk's copy to the device runs asynchronously while the CPU packs the next chunk into the
other buffer; the caller consumes each chunk on the device (a scatter into the caches) in stream
order. On CPU the chunks are plain host arrays.
"""

import itertools
import os
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from msaserve.kvcache.codec import Payload, as_payload

CHUNK_BYTES = 32 << 20
"""Size of each of the two pinned buffers per device (a page larger than this gets its own size)."""


PACK_THREADS = max(1, min(8, (os.cpu_count() or 1) // 2))
"""Threads packing one chunk (numpy's copies release the GIL; one core's memcpy into pinned memory
measured ~3 GB/s on the H200's host, below the host→device link)."""

_packers: ThreadPoolExecutor | None = None


def _pack(arrays: Sequence[np.ndarray], out: np.ndarray) -> None:
    """Copy arrays (each out.shape[1] bytes) into the rows of out, in slices on PACK_THREADS threads."""
    global _packers
    rows = len(arrays)
    if PACK_THREADS == 1 or rows < 2 * PACK_THREADS:
        np.stack(arrays, out=out)
        return
    if _packers is None:
        _packers = ThreadPoolExecutor(PACK_THREADS, thread_name_prefix="kvcache-pack")
    bounds = [rows * i // PACK_THREADS for i in range(PACK_THREADS + 1)]
    jobs = [_packers.submit(np.stack, arrays[a:b], out=out[a:b]) for a, b in itertools.pairwise(bounds)]
    for job in jobs:
        job.result()


class PinnedStaging:
    """Two pinned host buffers for one CUDA device, reused by every upload to it."""

    def __init__(self, device: torch.device, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.device = device
        self.chunk_bytes = chunk_bytes
        self._buffers: list[torch.Tensor] = []
        self._done: list[torch.cuda.Event | None] = [None, None]
        self._lock = threading.Lock()

    def _buffer(self, which: int, nbytes: int) -> torch.Tensor:
        """Pinned buffer `which` (0 or 1) of at least nbytes, idle (its last copy has finished)."""
        done = self._done[which]
        if done is not None:
            done.synchronize()
        if len(self._buffers) < 2 or self._buffers[which].numel() < nbytes:
            for other in self._done:  # both buffers are replaced: the other's copy must be over too
                if other is not None:
                    other.synchronize()
            size = max(nbytes, self.chunk_bytes)
            self._buffers = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            self._done = [None, None]
        return self._buffers[which]

    def upload(self, arrays: Sequence[np.ndarray], nbytes: int) -> Iterator[tuple[int, torch.Tensor]]:
        """Yield (first row, device tensor [rows, nbytes] uint8) chunk by chunk, in order. Each
        chunk's copy is enqueued on the current stream; work the caller enqueues on that stream
        after receiving a chunk sees its bytes."""
        rows_per_chunk = max(1, self.chunk_bytes // nbytes)
        with self._lock:
            for i, start in enumerate(range(0, len(arrays), rows_per_chunk)):
                part = arrays[start : start + rows_per_chunk]
                host = self._buffer(i % 2, len(part) * nbytes)[: len(part) * nbytes]
                _pack(part, host.numpy().reshape(len(part), nbytes))
                chunk = torch.empty(len(part), nbytes, dtype=torch.uint8, device=self.device)
                chunk.view(-1).copy_(host, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                self._done[i % 2] = event
                yield start, chunk


_staging: dict[int, PinnedStaging] = {}
_staging_lock = threading.Lock()


def staging_for(device: torch.device) -> PinnedStaging:
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _staging_lock:
        if index not in _staging:
            _staging[index] = PinnedStaging(torch.device("cuda", index))
        return _staging[index]


def check_sizes(payloads: Sequence[Payload], nbytes: int, what: str, model_name: str) -> list[np.ndarray]:
    """The payloads as uint8 arrays, each checked to be nbytes long."""
    arrays = [as_payload(p) for p in payloads]
    for a in arrays:
        if a.nbytes != nbytes:
            raise ValueError(
                f"{what} payload has {a.nbytes} bytes; the layout of {model_name} needs {nbytes}"
            )
    return arrays


def to_device_chunks(
    payloads: Sequence[Payload], nbytes: int, device: torch.device, what: str, model_name: str,
    chunk_bytes: int = CHUNK_BYTES,
) -> Iterator[tuple[int, torch.Tensor]]:
    """Payloads (each nbytes) → (first row, tensor [rows, nbytes] uint8 on `device`) chunks."""
    arrays = check_sizes(payloads, nbytes, what, model_name)
    if device.type == "cuda":
        yield from staging_for(device).upload(arrays, nbytes)
        return
    rows = max(1, chunk_bytes // nbytes)
    for start in range(0, len(arrays), rows):
        yield start, torch.from_numpy(np.stack(arrays[start : start + rows])).to(device)
