"""Arena segments that a reader in another process on the node maps by name (shared memory files).

A shard that runs as a Ray actor is a process of its own; `lease_index` views of its memory cannot
reach an engine in another process. With `ServiceConfig.shared_index_arena` the shard's index
store allocates its arena segments (`arena.py`) as files in a shared-memory directory (`/dev/shm`
on Linux) that it maps; a lease then answers with where each page lies — segment file name,
offset, size — and the reader maps the same files (`map_segment`, once per file per process) and
reads the stored bytes in place: zero-copy across processes, as `lease_index` is within one.

Lifetime: the shard unlinks its files when it closes (or its process exits); a shard that starts
under the same name first removes a predecessor's leftovers (a crashed actor's). A reader's mapping
stays valid after the unlink, until it drops it. Leases are the guard against reuse: a leased slot
is not reused until the lease ends (`KVCacheShard.release_lease`, or its expiry).
"""

import atexit
import mmap
import os
import tempfile
import uuid
from pathlib import Path

import numpy as np


def default_directory() -> Path:
    """Where segment files go: /dev/shm (memory) when this system has it, else the temp directory."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


class SharedSegments:
    """A segment allocator (`arena.SegmentAllocator`) of named shared-memory files; `names[i]` is
    the file of the i-th segment it made (the arena's segment i)."""

    def __init__(self, prefix: str, directory: Path | None = None) -> None:
        if not prefix or "/" in prefix:
            raise ValueError(f"prefix={prefix!r}: allowed a non-empty file name prefix without '/'")
        self.prefix, self.directory = prefix, Path(directory or default_directory())
        self.names: list[str] = []
        self._maps: list[mmap.mmap] = []
        for stale in self.directory.glob(f"{prefix}-*"):  # a predecessor's (a crashed actor's)
            stale.unlink(missing_ok=True)
        atexit.register(self.close)

    def __call__(self, nbytes: int) -> np.ndarray:
        """A new segment file of nbytes, its memory reserved now: raises OSError when the directory
        (a tmpfs: /dev/shm) has no room — the arena then keeps pages in plain memory — instead of a
        SIGBUS on the first write past what tmpfs can hold."""
        name = f"{self.prefix}-{len(self.names)}-{uuid.uuid4().hex[:12]}"
        path = self.directory / name
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, nbytes)
            else:
                os.ftruncate(fd, nbytes)
            mapped = mmap.mmap(fd, nbytes)
        except OSError:
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        self.names.append(name)
        self._maps.append(mapped)
        return np.frombuffer(mapped, dtype=np.uint8)

    def close(self) -> None:
        """Unlink the files (mappings, the shard's and readers', stay valid until dropped)."""
        for name in self.names:
            (self.directory / name).unlink(missing_ok=True)


_MAPPED: dict[tuple[str, str], np.ndarray] = {}


def map_segment(directory: str | Path, name: str) -> np.ndarray:
    """A shard's segment file, mapped into this process (once; later calls return the same array).
    Writable only so that tensors can be made over it without copies: readers must not write."""
    key = (str(directory), name)
    if key not in _MAPPED:
        if "/" in name:
            raise ValueError(f"segment name {name!r}: allowed a file name without '/'")
        fd = os.open(Path(directory) / name, os.O_RDWR)
        try:
            mapped = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        _MAPPED[key] = np.frombuffer(mapped, dtype=np.uint8)
    return _MAPPED[key]
