"""Storage tiers of a page store, fastest first: host memory and a disk directory, and a registry
so that another kind of tier (another medium, a remote store) is one new class.

Each tier keeps its pages in least-recently-used order and counts its bytes; it never decides
what to evict (the store does, so that pins and the fastest → slowest → dropped order live in one
place). Tiers return the checksum that was stored with a page; the store verifies it.
"""

import itertools
import os
import struct
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import xxhash

from msaserve.kvcache.arena import PageArena, Slot
from msaserve.kvcache.codec import Payload
from msaserve.kvcache.keys import KeyGroups

_DISK_MAGIC = b"MSAKVPG1"
_DISK_HEADER = struct.Struct("<8sQQI")  # magic, checksum, payload bytes, key bytes
_SUFFIX = ".page"


@dataclass(eq=False)
class StoredPage:
    payload: Payload
    checksum: int
    slot: Slot | None = None
    """Where the payload lives in the memory tier's arena (None: a plain array of its own)."""


class Tier(Protocol):
    """What the store needs of a tier. `kind` names it in stats and metrics; `durable` tiers keep
    their pages across a restart (write-through goes to the last durable tier)."""

    kind: str
    durable: bool
    capacity_bytes: int
    bytes_used: int

    def __contains__(self, key: str) -> bool: ...
    def __len__(self) -> int: ...
    def put(self, key: str, payload: Payload, page_checksum: int) -> None: ...
    def get(self, key: str) -> StoredPage | None: ...
    def pop(self, key: str) -> Any:
        """Remove the page (the return value is the tier's own; the store does not use it)."""
        ...
    def nbytes(self, key: str) -> int: ...
    def lru_keys(self) -> Iterator[str]:
        """Keys from least to most recently used (a snapshot: safe to pop while iterating)."""
        ...


TIER_KINDS: dict[str, type] = {}
"""Tier classes by kind; `register_tier` adds one."""


def register_tier(cls: type) -> type:
    """Class decorator: make a tier kind available to `make_tier` under its `kind`."""
    TIER_KINDS[cls.kind] = cls
    return cls


def make_tier(kind: str, **kwargs: Any) -> Tier:
    """A tier of a registered kind, built with that class's own arguments."""
    if kind not in TIER_KINDS:
        raise ValueError(f"tier kind={kind!r} is invalid: allowed {', '.join(sorted(TIER_KINDS))}")
    return TIER_KINDS[kind](**kwargs)


@register_tier
class MemoryTier:
    """Pages in host memory, in LRU order (oldest first). Each page is the tier's own copy: in a
    slot of its `arena` when it has one (`arena.py`: segments allocated once, pinned when the
    engine reading them is on a GPU), else (no arena, or no slot fits) in an array of its own.

    `acquire` hands a reader the stored bytes themselves (zero-copy) and keeps them from being
    overwritten until `release`, even if the page is removed or replaced meanwhile.

    With `groups` (keys.PageKeyGroups: a page's keys of every layer form a group) and an arena, the
    tier also keeps, per group, the arena slot id of each member it holds there, and each slot's
    checksum, so that `acquire_groups` leases many groups' members in one lookup per group and one
    numpy call."""

    kind = "memory"
    durable = False

    def __init__(self, capacity_bytes: int, arena: PageArena | None = None,
                 groups: KeyGroups | None = None) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"memory capacity_bytes={capacity_bytes} must be ≥ 0")
        self.capacity_bytes = capacity_bytes
        self.bytes_used = 0
        self.arena = arena
        self._pages: OrderedDict[str, StoredPage] = OrderedDict()
        self.groups = groups if arena is not None else None
        self._members: dict[Hashable, list[int]] = {}  # group → slot id of each member (-1: not in the arena)
        self._checksum_of = np.zeros(0, np.uint64)  # per arena slot id
        self._key_of: list[str | None] = []
        """The key stored in each arena slot id (None: none now): cleared when its page goes, so a
        lease's end touches its pages by slot without building their keys (`touch_slots`)."""

    def __contains__(self, key: str) -> bool:
        return key in self._pages

    def __len__(self) -> int:
        return len(self._pages)

    def put(self, key: str, payload: Payload, page_checksum: int) -> None:
        """Store a copy of payload (the caller may reuse its buffer)."""
        self.pop(key)
        slot = None if self.arena is None else self.arena.allocate(payload.nbytes)
        if slot is None:
            stored = payload.copy()
        else:
            stored = self.arena.view(slot)
            stored[:] = payload
            self._slot_taken(key, slot, page_checksum)
        self._pages[key] = StoredPage(stored, page_checksum, slot)
        self.bytes_used += payload.nbytes

    def _slot_taken(self, key: str, slot: Slot, page_checksum: int) -> None:
        if slot.id >= len(self._checksum_of):
            grown = np.zeros(len(self.arena.readers), np.uint64)
            grown[: len(self._checksum_of)] = self._checksum_of
            self._checksum_of = grown
            self._key_of.extend([None] * (len(grown) - len(self._key_of)))
        self._checksum_of[slot.id] = page_checksum
        self._key_of[slot.id] = key
        split = None if self.groups is None else self.groups.split(key)
        if split is not None:
            group, member = split
            ids = self._members.setdefault(group, [])
            if member >= len(ids):
                ids.extend([-1] * (member + 1 - len(ids)))
            ids[member] = slot.id

    def _slot_given_up(self, key: str, slot: Slot) -> None:
        if self._key_of[slot.id] == key:  # (a slot given up was taken: the table covers it)
            self._key_of[slot.id] = None
        split = None if self.groups is None else self.groups.split(key)
        if split is not None:
            group, member = split
            ids = self._members.get(group)
            if ids is not None and member < len(ids) and ids[member] == slot.id:
                ids[member] = -1
                if max(ids) < 0:
                    del self._members[group]

    def get(self, key: str) -> StoredPage | None:
        page = self._pages.get(key)
        if page is not None:
            self._pages.move_to_end(key)
        return page

    def acquire(self, key: str) -> StoredPage | None:
        """`get`, and the page's bytes stay as they are until `release(page)` (unverified: the
        reader checks them against `page.checksum`)."""
        return self.acquire_many([key])[0]

    def acquire_many(self, keys: Sequence[str]) -> list[StoredPage | None]:
        """`acquire` of each key in one call (a lease of a million-token session is 32K keys: a
        call per key was most of its time)."""
        get, touch = self._pages.get, self._pages.move_to_end
        out = [get(key) for key in keys]
        for key, page in zip(keys, out, strict=True):
            if page is not None:
                touch(key)
        if self.arena is not None:  # (a slot implies the arena)
            self.arena.acquire_ids(_slot_ids(out))
        return out

    def release_many(self, pages: Iterable[StoredPage | None]) -> None:
        """`release` of each page (None: skipped), in one call."""
        if self.arena is not None:
            self.arena.release_ids(_slot_ids(pages))

    def release(self, page: StoredPage) -> None:
        if page.slot is not None:
            self.arena.release(page.slot)

    def acquire_groups(self, groups: Sequence[Hashable], members: int) -> np.ndarray:
        """The arena slot id of members 0..members-1 of each group → int64 [len(groups), members],
        -1 where the tier holds no such member in its arena; each slot found is held as `acquire`
        holds it, until `release_ids`. One dictionary lookup per group; no LRU touch (`touch`
        that at the lease's end: a page in use for minutes should count as used when it ends)."""
        if self.groups is None:
            raise ValueError("acquire_groups needs a memory tier with an arena and key groups")
        rows, pad = list(map(self._members.get, groups)), [-1] * members
        if None in rows or set(map(len, rows)) - {members}:  # (usually every group is whole)
            rows = [pad if ids is None else (ids + pad)[:members] for ids in rows]
        flat = np.fromiter(itertools.chain.from_iterable(rows), np.int64, len(groups) * members)
        self.arena.acquire_ids(flat[flat >= 0])
        return flat.reshape(len(groups), members)

    def checksums_of(self, ids: np.ndarray) -> np.ndarray:
        """The checksum stored with the page in each slot id (uint64; ids ≥ 0, slots in use)."""
        return self._checksum_of[ids]

    def release_ids(self, ids: np.ndarray) -> None:
        """End the holds `acquire_groups` took (ids ≥ 0)."""
        self.arena.release_ids(ids)

    def touch_slots(self, ids: np.ndarray) -> None:
        """Mark the pages in these arena slots (those still stored there) most recently used: a
        million-token lease's end touches 32K pages, and building their keys took 3/4 of it."""
        key_of, touch = self._key_of, self._pages.move_to_end
        for slot_id in ids.tolist():
            key = key_of[slot_id]
            if key is not None:  # (cleared when its page went: the key is stored, in this slot)
                touch(key)

    def touch(self, keys: Iterable[str]) -> None:
        """Mark these keys (those still held) most recently used."""
        pages, touch = self._pages, self._pages.move_to_end
        for key in keys:
            if key in pages:
                touch(key)

    def holds(self, key: str, page: StoredPage) -> bool:
        """Whether `page` (from `acquire`) is still the stored copy of key (not replaced since)."""
        return self._pages.get(key) is page

    def holds_slot(self, key: str, slot_id: int) -> bool:
        """Whether key's stored copy is the one in arena slot `slot_id` (from `acquire_groups`)."""
        page = self._pages.get(key)
        return page is not None and page.slot is not None and page.slot.id == slot_id

    def pop(self, key: str) -> StoredPage | None:
        page = self._pages.pop(key, None)
        if page is not None:
            self.bytes_used -= page.payload.nbytes
            if page.slot is not None:
                self._slot_given_up(key, page.slot)
                self.arena.free(page.slot)
        return page

    def nbytes(self, key: str) -> int:
        return self._pages[key].payload.nbytes

    def lru_keys(self) -> Iterator[str]:
        """Keys from least to most recently used (a snapshot: safe to pop while iterating)."""
        return iter(list(self._pages))


def _slot_ids(pages: Iterable[StoredPage | None]) -> np.ndarray:
    """The arena slot id of each page that has one."""
    return np.fromiter((page.slot.id for page in pages if page is not None and page.slot is not None),
                       np.int64)


@register_tier
class DiskTier:
    """Pages as files under `path`, one file each, written atomically (temp file + rename).

    File: header (magic, checksum, payload length, key length) + key + payload. The key lives in
    the file so that a restarted store rebuilds its index by scanning the directory; LRU order
    survives a restart through file modification times (touched on every read).
    """

    kind = "disk"
    durable = True

    def __init__(self, path: str | os.PathLike[str], capacity_bytes: int, fsync: bool = False) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"disk capacity_bytes={capacity_bytes} must be ≥ 0")
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self.bytes_used = 0
        self._sizes: OrderedDict[str, int] = OrderedDict()  # key → payload bytes, LRU order
        self._scan()

    def file_of(self, key: str) -> Path:
        return self.path / (xxhash.xxh3_128_hexdigest(key.encode()) + _SUFFIX)

    def __contains__(self, key: str) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def put(self, key: str, payload: Payload, page_checksum: int) -> None:
        self.pop(key)
        final = self.file_of(key)
        tmp = final.with_name(f".tmp-{os.getpid()}-{final.name}")
        key_bytes = key.encode()
        with open(tmp, "wb") as f:
            f.write(_DISK_HEADER.pack(_DISK_MAGIC, page_checksum, payload.nbytes, len(key_bytes)))
            f.write(key_bytes)
            f.write(memoryview(payload))
            if self.fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, final)  # atomic: a reader sees the old file or the whole new one
        self._sizes[key] = payload.nbytes
        self.bytes_used += payload.nbytes

    def get(self, key: str) -> StoredPage | None:
        """The page, or None if absent. A file whose header is unreadable comes back with
        checksum -1, so the store counts it as corrupt and drops it."""
        if key not in self._sizes:
            return None
        file = self.file_of(key)
        try:
            with open(file, "rb") as f:
                raw = f.read()
        except FileNotFoundError:  # removed behind our back: forget it
            self.pop(key)
            return None
        self._sizes.move_to_end(key)
        os.utime(file)
        header = _parse_header(raw)
        if header is None or header[2] != key.encode():
            return StoredPage(np.frombuffer(raw, dtype=np.uint8), -1)
        page_checksum, start, _ = header
        return StoredPage(np.frombuffer(raw, dtype=np.uint8)[start:], page_checksum)

    def pop(self, key: str) -> int:
        """Remove a page; returns the bytes freed (0 if absent)."""
        size = self._sizes.pop(key, None)
        if size is None:
            return 0
        self.file_of(key).unlink(missing_ok=True)
        self.bytes_used -= size
        return size

    def nbytes(self, key: str) -> int:
        return self._sizes[key]

    def lru_keys(self) -> Iterator[str]:
        return iter(list(self._sizes))

    def _scan(self) -> None:
        """Rebuild the index from the files (oldest modification first); remove stale temp files
        and files whose header cannot be read."""
        entries = []
        for file in self.path.iterdir():
            if file.name.startswith(".tmp-"):
                file.unlink(missing_ok=True)
                continue
            if not file.name.endswith(_SUFFIX):
                continue
            with open(file, "rb") as f:
                head = f.read(_DISK_HEADER.size + 4096)
            header = _parse_header(head, payload_may_be_partial=True)
            if header is None:
                file.unlink(missing_ok=True)
                continue
            _, start, key = header
            payload_bytes = file.stat().st_size - start
            entries.append((file.stat().st_mtime_ns, key.decode(), payload_bytes))
        for _, key, size in sorted(entries):
            self._sizes[key] = size
            self.bytes_used += size


def _parse_header(raw: bytes, payload_may_be_partial: bool = False) -> tuple[int, int, bytes] | None:
    """(checksum, payload offset, key) of a page file, or None if it is not one."""
    if len(raw) < _DISK_HEADER.size:
        return None
    magic, page_checksum, payload_len, key_len = _DISK_HEADER.unpack_from(raw)
    start = _DISK_HEADER.size + key_len
    if magic != _DISK_MAGIC or len(raw) < start:
        return None
    if not payload_may_be_partial and len(raw) != start + payload_len:
        return None
    return page_checksum, start, raw[_DISK_HEADER.size : start]
