"""Moving many page payloads from host memory to a device: through reused pinned buffers.

A million-token session's index is 8,192 payloads of 64 KiB (M3 shape, 2 layers) — 0.5 GiB.
Stacking them into one fresh host array and copying that from pageable memory measured 1.3 GB/s
on the H200's host (most of it first-touch page faults of the fresh array). Here every upload goes
through an `UploadRing`: pinned buffers that live as long as the process, each chunk's copy to the
device running asynchronously while the next buffer is filled; the caller consumes each chunk on
the device (a scatter into the caches) in stream order. Bulk loads (`ring_for`: 4 buffers) have
the shards write packed rows straight into the buffers; imports of payload lists
(`PinnedStaging`: a ring of 2) pack the payloads into them. On CPU the chunks are host arrays.
"""

import itertools
import threading
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from msaserve.kvcache.codec import PACK_THREADS, Payload, as_payload, pack_pool

CHUNK_BYTES = 32 << 20
"""Size of each upload-ring buffer (a ring grows its buffers for a row larger than this)."""


def _pack(arrays: Sequence[np.ndarray], out: np.ndarray) -> None:
    """Copy arrays (each out.shape[1] bytes) into the rows of out, in slices on PACK_THREADS threads."""
    rows = len(arrays)
    if PACK_THREADS == 1 or rows < 2 * PACK_THREADS:
        np.stack(arrays, out=out)
        return
    bounds = [rows * i // PACK_THREADS for i in range(PACK_THREADS + 1)]
    jobs = [pack_pool().submit(np.stack, arrays[a:b], out=out[a:b]) for a, b in itertools.pairwise(bounds)]
    for job in jobs:
        job.result()


class UploadRing:
    """Host buffers that readers fill in place (packed reads: `KVCacheClient.get_*_packed_async`)
    and that are then copied to one device asynchronously: no packing copy between the service's
    pages and the device. Pinned on CUDA; used round-robin, `acquire` waits until the buffer's
    previous copy has finished. On CPU `upload` returns a view of the buffer itself: consume it
    (e.g. scatter it into the caches) before acquiring RING_BUFFERS more.

    One ring per device; hold `lock` for a whole load, so that concurrent loads do not interleave.
    """

    def __init__(self, device: torch.device, buffer_bytes: int, count: int = 4) -> None:
        self.device, self.count = device, count
        self.lock = threading.Lock()
        self._buffers: list[torch.Tensor] = []
        self._done: list[torch.cuda.Event | None] = []
        self._next = 0
        self._allocate(buffer_bytes)

    @property
    def buffer_bytes(self) -> int:
        return self._buffers[0].numel()

    def _allocate(self, nbytes: int) -> None:
        for event in self._done:  # buffers are replaced: no copy may still read them
            if event is not None:
                event.synchronize()
        pinned = self.device.type == "cuda"
        self._buffers = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned) for _ in range(self.count)]
        self._done = [None] * self.count

    def rows_per_buffer(self, row_bytes: int) -> int:
        """Rows of row_bytes one buffer holds (grows the buffers if not even one fits)."""
        if row_bytes > self.buffer_bytes:
            self._allocate(row_bytes)
        return self.buffer_bytes // row_bytes

    def acquire(self, rows: int, row_bytes: int) -> tuple[int, np.ndarray]:
        """(slot, host array [rows, row_bytes]) free to fill."""
        if rows * row_bytes > self.buffer_bytes:
            raise ValueError(f"{rows} rows of {row_bytes} bytes exceed the ring's "
                             f"{self.buffer_bytes}-byte buffers")
        slot = self._next
        self._next = (slot + 1) % self.count
        done = self._done[slot]
        if done is not None:
            done.synchronize()
            self._done[slot] = None
        return slot, self._buffers[slot].numpy()[: rows * row_bytes].reshape(rows, row_bytes)

    def upload(self, slot: int, rows: int, row_bytes: int) -> torch.Tensor:
        """The first `rows` rows of an acquired buffer on the device: [rows, row_bytes] uint8, the
        copy enqueued on the current stream (work enqueued after it sees the bytes)."""
        host = self._buffers[slot][: rows * row_bytes]
        if self.device.type != "cuda":
            return host.view(rows, row_bytes)
        chunk = torch.empty(rows * row_bytes, dtype=torch.uint8, device=self.device)
        chunk.copy_(host, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._done[slot] = event
        return chunk.view(rows, row_bytes)


class PinnedStaging:
    """Imports of payload lists (on-demand and prefetched K/V) to one CUDA device: each chunk
    packed into a buffer of a two-buffer `UploadRing` of its own (apart from the bulk-load ring,
    so an import never waits for a bulk load's lock), copied while the next chunk is packed."""

    def __init__(self, device: torch.device, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.ring = UploadRing(device, chunk_bytes, count=2)

    def upload(self, arrays: Sequence[np.ndarray], nbytes: int) -> Iterator[tuple[int, torch.Tensor]]:
        """Yield (first row, device tensor [rows, nbytes] uint8) chunk by chunk, in order. Each
        chunk's copy is enqueued on the current stream; work the caller enqueues on that stream
        after receiving a chunk sees its bytes."""
        ring = self.ring
        with ring.lock:
            rows_per_chunk = ring.rows_per_buffer(nbytes)
            for start in range(0, len(arrays), rows_per_chunk):
                part = arrays[start : start + rows_per_chunk]
                slot, host = ring.acquire(len(part), nbytes)
                _pack(part, host)
                yield start, ring.upload(slot, len(part), nbytes)


RING_BUFFERS = 4
"""Buffers per upload ring: a pipeline of depth 2 has 3 being filled and 1 being copied."""

_rings: dict[str, UploadRing] = {}


def indexed_device(device: torch.device | str) -> torch.device:
    """`device` with its index: a bare "cuda" names the current CUDA device, as a tensor's
    `.device` does (so devices given either way compare equal)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def ring_for(device: torch.device) -> UploadRing:
    """The process's upload ring for `device` (RING_BUFFERS × CHUNK_BYTES of host memory, pinned
    on CUDA, allocated on first use)."""
    device = indexed_device(device)
    with _staging_lock:
        key = str(device)
        if key not in _rings:
            _rings[key] = UploadRing(device, CHUNK_BYTES, RING_BUFFERS)
        return _rings[key]


_staging: dict[int, PinnedStaging] = {}
_staging_lock = threading.Lock()


def staging_for(device: torch.device) -> PinnedStaging:
    index = indexed_device(device).index
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
