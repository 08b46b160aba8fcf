"""Page payloads as flat byte buffers, and the checksum every tier stores beside them.

A payload is one `np.ndarray` of dtype uint8 (C-contiguous). Ray moves such arrays through its
object store without pickling the data (out-of-band buffers: a reader on the same node maps the
shared memory, zero-copy and read-only). Tensors of any dtype (bf16 and fp8 included, which numpy
lacks) are packed by viewing their bytes, with a small header naming each tensor's dtype and shape.
"""

import json
import struct
from collections.abc import Mapping

import numpy as np
import torch
import xxhash

Payload = np.ndarray
"""[nbytes] uint8, C-contiguous."""

_MAGIC = b"MSAP"
_HEADER = struct.Struct("<4sI")  # magic, JSON length


class CodecError(ValueError):
    """A buffer that is not a packed page (wrong magic or truncated)."""


def checksum(data: Payload | bytes | memoryview) -> int:
    """xxh3_64 of the payload bytes; stored with each page and checked on every read."""
    return xxhash.xxh3_64_intdigest(memoryview(data).cast("B") if isinstance(data, np.ndarray) else data)


def as_payload(data: Payload | bytes | bytearray | memoryview) -> Payload:
    """Accept bytes-like or a uint8 array; return a C-contiguous uint8 array (no copy if possible)."""
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8 or data.ndim != 1:
            raise TypeError(f"a page payload must be a 1-D uint8 array, got {data.dtype} {data.shape}")
        return np.ascontiguousarray(data)
    return np.frombuffer(data, dtype=np.uint8)


def pack_tensors(tensors: Mapping[str, torch.Tensor]) -> Payload:
    """Pack named tensors (any dtype, any device) into one uint8 payload."""
    meta = []
    parts = []
    for name, tensor in tensors.items():
        t = tensor.detach().contiguous().cpu()
        meta.append([name, str(t.dtype).removeprefix("torch."), list(t.shape)])
        parts.append(t.view(torch.uint8).reshape(-1).numpy())
    header = json.dumps(meta).encode()
    out = np.empty(_HEADER.size + len(header) + sum(p.size for p in parts), dtype=np.uint8)
    out[: _HEADER.size] = np.frombuffer(_HEADER.pack(_MAGIC, len(header)), dtype=np.uint8)
    offset = _HEADER.size
    out[offset : offset + len(header)] = np.frombuffer(header, dtype=np.uint8)
    offset += len(header)
    for part in parts:
        out[offset : offset + part.size] = part
        offset += part.size
    return out


def unpack_tensors(payload: Payload | bytes) -> dict[str, torch.Tensor]:
    """Inverse of pack_tensors. The tensors alias the payload when it is writable, else copy it
    (object-store reads are read-only, and torch needs writable memory)."""
    buf = as_payload(payload)
    if buf.size < _HEADER.size:
        raise CodecError(f"page payload of {buf.size} bytes is shorter than its header")
    magic, header_len = _HEADER.unpack(buf[: _HEADER.size].tobytes())
    if magic != _MAGIC:
        raise CodecError(f"page payload has magic {magic!r}, expected {_MAGIC!r}")
    offset = _HEADER.size + header_len
    meta = json.loads(buf[_HEADER.size : offset].tobytes())
    if not buf.flags.writeable:
        buf = buf.copy()
    out: dict[str, torch.Tensor] = {}
    for name, dtype_name, shape in meta:
        dtype = getattr(torch, dtype_name)
        nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        if offset + nbytes > buf.size:
            raise CodecError(f"page payload truncated in tensor {name!r}")
        raw = torch.from_numpy(buf[offset : offset + nbytes])
        out[name] = raw.view(dtype).reshape(shape)
        offset += nbytes
    return out
