"""Page payloads as flat byte buffers, and the checksum every tier stores beside them.

A payload is one `np.ndarray` of dtype uint8 (C-contiguous). Ray moves such arrays through its
object store without pickling the data (out-of-band buffers: a reader on the same node maps the
shared memory, zero-copy and read-only). `pages.py` gives the layouts of K/V and index payloads.
This module stays free of torch so that shard actors start without importing it.
"""

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import xxhash

Payload = np.ndarray
"""[nbytes] uint8, C-contiguous."""


def checksum(data: Payload) -> int:
    """xxh3_64 of the payload bytes; stored with each page and checked on every read."""
    return xxhash.xxh3_64_intdigest(data)


def as_payload(data: Payload | bytes | bytearray | memoryview) -> Payload:
    """Accept bytes-like or a uint8 array; return a C-contiguous uint8 array (no copy if possible)."""
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8 or data.ndim != 1:
            raise TypeError(f"a page payload must be a 1-D uint8 array, got {data.dtype} {data.shape}")
        return np.ascontiguousarray(data)
    return np.frombuffer(data, dtype=np.uint8)


PACK_THREADS = max(1, min(8, (os.cpu_count() or 1) // 2))
"""Threads for bulk copies of page bytes (numpy's copies release the GIL; one core's memcpy into
pinned memory measured ~3 GB/s on the H200's host, below the host→device link)."""

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def pack_pool() -> ThreadPoolExecutor:
    """The process's PACK_THREADS copy threads (created on first use)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(PACK_THREADS, thread_name_prefix="kvcache-copy")
        return _pool


def copy_rows(pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
    """dst[...] = src for each (src, dst) pair of equal-shape 2-D arrays, split by rows over the
    copy threads: packed rows that a shard in another process returned, into the reader's pinned
    upload buffer (one core's copy of many MiB runs far below the memory's rate)."""
    for src, dst in pairs:
        if src.shape != dst.shape:
            raise ValueError(f"copy_rows: source {src.shape} and destination {dst.shape} differ")
    total = sum(src.nbytes for src, _ in pairs)
    if PACK_THREADS == 1 or total < (4 << 20):
        for src, dst in pairs:
            np.copyto(dst, src)
        return
    rows_each = max(1, (total // PACK_THREADS) // max(1, pairs[0][0].shape[1]))
    jobs = [pack_pool().submit(np.copyto, dst[a : a + rows_each], src[a : a + rows_each])
            for src, dst in pairs for a in range(0, src.shape[0], rows_each)]
    for job in jobs:
        job.result()
