"""Page payloads as flat byte buffers, and the checksum every tier stores beside them.

A payload is one `np.ndarray` of dtype uint8 (C-contiguous). Ray moves such arrays through its
object store without pickling the data (out-of-band buffers: a reader on the same node maps the
shared memory, zero-copy and read-only). `pages.py` gives the layouts of K/V and index payloads.
This module stays free of torch so that shard actors start without importing it.
"""

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
