"""A tiered page store: a chain of tiers, fastest first (host memory over an optional disk
directory by default), with pins and LRU eviction.

What must stay true:
- every read verifies the xxh3 checksum stored with the page; a mismatch is a miss, counts one
  corruption and drops that copy (a slower tier's copy may still be served after its own check).
  The one exception is a lease (`lease`: zero-copy, for a reader in this process), whose reader
  verifies the bytes itself and reports a bad page (`drop_corrupt`);
- a leased page's bytes do not change until its lease ends (its arena slot is not reused);
- every tier's `bytes_used ≤ capacity_bytes` after every call (a put that cannot fit without
  evicting pinned pages raises CapacityError);
- pinned pages (pin count > 0) are never evicted from the tier they are in;
- eviction goes down the chain — memory → disk → dropped — least recently used first.

Pure Python: the Ray actor (`shard.py`) wraps it, and tests drive it directly. The tiers are any
`tiers.Tier`; a new kind is one class registered in `tiers.TIER_KINDS`.
"""

import os
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from msaserve.kvcache.arena import PageArena, SegmentAllocator
from msaserve.kvcache.codec import Payload, as_payload, checksum
from msaserve.kvcache.keys import KeyGroups
from msaserve.kvcache.tiers import StoredPage, Tier, make_tier


class CapacityError(RuntimeError):
    """A page does not fit: the tiers are full of pinned pages (or it is larger than a tier)."""


class StoreStats:
    """Counters since the store was created (the shard turns them into metrics): hits per tier
    kind, misses, corruptions, evictions to each tier kind or dropped, puts and bytes. Read as
    attributes (`hits_memory`, `evictions_to_disk`, `evictions_dropped`, ...)."""

    def __init__(self, tier_kinds: Sequence[str]) -> None:
        names = ["misses", "corruptions", "evictions_dropped", "puts", "bytes_written", "bytes_read"]
        names += [f"hits_{kind}" for kind in tier_kinds]
        names += [f"evictions_to_{kind}" for kind in tier_kinds[1:]]
        self._counts = Counter({name: 0 for name in names})

    def add(self, name: str, amount: int = 1) -> None:
        self._counts[name] += amount

    def __getattr__(self, name: str) -> int:
        counts = self.__dict__.get("_counts")
        if counts is None or name not in counts:
            raise AttributeError(name)
        return counts[name]

    def as_dict(self) -> dict[str, int]:
        return dict(self._counts)


@dataclass
class GroupLease:
    """`PageStore.lease_groups`'s answer: item i is member i % members of group i // members."""

    groups: list[Hashable]
    members: int
    ids: np.ndarray
    """[n] int64: the arena slot id of each item, held until `release_groups`; -1 where none."""
    loose: dict[int, StoredPage]
    """Items held outside the arena (no slot), by position."""
    store: str = "kv"
    """The name of the shard's store that leased it (`KVCacheShard`: "kv" or "index")."""

    def key(self, item: int, key_groups: KeyGroups) -> str:
        return key_groups.join(self.groups[item // self.members], item % self.members)


class PageStore:
    """Pages by string key over a chain of tiers. `write_through` also writes every put to the
    last durable tier at once (so a restart keeps it); otherwise pages reach slower tiers only when
    evicted from faster ones.

    `PageStore(memory_bytes, disk_path, disk_bytes)` builds the default chain; `tiers=` takes any."""

    def __init__(
        self,
        memory_bytes: int = 0,
        disk_path: str | os.PathLike[str] | None = None,
        disk_bytes: int = 0,
        write_through: bool = True,
        fsync: bool = False,
        tiers: Sequence[Tier] | None = None,
        segment_allocator: SegmentAllocator | None = None,
        key_groups: KeyGroups | None = None,
    ) -> None:
        """segment_allocator: the memory tier keeps its pages in a `PageArena` of segments from it
        (pinned host memory for an engine in this process that copies pages to a GPU); key_groups:
        its keys form groups (`group/member`) that `lease_groups` leases whole."""
        if tiers is None:
            arena = None if segment_allocator is None else PageArena(memory_bytes, segment_allocator)
            tiers = [make_tier("memory", capacity_bytes=memory_bytes, arena=arena, groups=key_groups)]
            if disk_path is not None and disk_bytes > 0:
                tiers.append(make_tier("disk", path=disk_path, capacity_bytes=disk_bytes, fsync=fsync))
        if not tiers:
            raise ValueError("PageStore needs at least one tier")
        self.tiers: list[Tier] = list(tiers)
        durable = [i for i, tier in enumerate(self.tiers) if tier.durable]
        self._write_through_tier = durable[-1] if write_through and durable else None
        self.write_through = self._write_through_tier is not None
        self.stats = StoreStats([tier.kind for tier in self.tiers])
        self._pins: dict[str, int] = {}

    @property
    def memory(self) -> Tier:
        """The fastest tier."""
        return self.tiers[0]

    @property
    def disk(self) -> Tier | None:
        """The first disk tier, if any (stats and tests read it by name)."""
        return next((tier for tier in self.tiers if tier.kind == "disk"), None)

    # ---- reads -------------------------------------------------------------------------------
    def get(self, key: str) -> Payload | None:
        """The page's bytes (read-only array when served from disk), or None on a miss."""
        return self._find(key, 0)

    def _find(self, key: str, first_level: int) -> Payload | None:
        """`get` over the tiers from `first_level` on: the first verified copy (promoted from a
        slower tier), a bad copy dropped and counted; a miss counts once."""
        for level in range(first_level, len(self.tiers)):
            tier = self.tiers[level]
            page = tier.get(key)
            if page is None:
                continue
            if checksum(page.payload) == page.checksum:
                self.stats.add(f"hits_{tier.kind}")
                self.stats.add("bytes_read", page.payload.nbytes)
                if level > 0:
                    self._promote(key, page.payload, page.checksum)
                return page.payload
            tier.pop(key)
            self.stats.add("corruptions")
        self.stats.add("misses")
        return None

    def get_many(self, keys: Sequence[str]) -> list[Payload | None]:
        return [self.get(key) for key in keys]

    def read_into(self, keys: Sequence[str], dest: np.ndarray, rows: Sequence[int]) -> list[bool]:
        """Copy each key's page into row `rows[i]` of dest [R, row bytes] (uint8) and verify the
        copy there: one pass over the stored bytes (the hash then reads the row while it is still
        in cache), and what is checked is what the reader gets. Per key whether a valid copy
        arrived; the row of a missing or corrupt page is zeros. The same tier order, statistics
        and promotion as `get`."""
        row_bytes = dest.shape[1]
        ok = []
        for key, row in zip(keys, rows, strict=True):
            found, out = False, dest[row]
            for level, tier in enumerate(self.tiers):
                page = tier.get(key)
                if page is None:
                    continue
                size_ok = page.payload.nbytes == row_bytes
                if not size_ok and checksum(page.payload) == page.checksum:
                    raise ValueError(f"page {key!r} has {page.payload.nbytes} bytes; the reader's layout "
                                     f"needs {row_bytes} (a model identity mismatch)")
                if size_ok:
                    out[:] = page.payload
                if size_ok and checksum(out) == page.checksum:
                    self.stats.add(f"hits_{tier.kind}")
                    self.stats.add("bytes_read", row_bytes)
                    if level > 0:
                        self._promote(key, page.payload, page.checksum)
                    found = True
                    break
                tier.pop(key)
                self.stats.add("corruptions")
            if not found:
                self.stats.add("misses")
                out[:] = 0
            ok.append(found)
        return ok

    def lease(self, keys: Sequence[str]) -> list[StoredPage | None]:
        """Zero-copy reads for a reader in this process: per key the stored page itself (its bytes
        and checksum) or None on a miss. A page in the fastest tier is handed out unverified and
        held (not overwritten, even if removed or replaced) until `release`: the reader verifies it
        against `page.checksum` (off its critical path) and reports a bad one with `drop_corrupt`.
        A page found only in a slower tier is verified here and promoted first, as `get` does."""
        fastest = self.tiers[0]
        many = getattr(fastest, "acquire_many", None)
        out = many(keys) if many is not None else [_acquire(fastest, key) for key in keys]
        found = [page for page in out if page is not None]
        self.stats.add(f"hits_{fastest.kind}", len(found))
        self.stats.add("bytes_read", sum(page.payload.nbytes for page in found))
        if len(found) < len(out):
            for i in [i for i, page in enumerate(out) if page is None]:
                payload = self._find(keys[i], 1)
                if payload is not None:  # promoted into the fastest tier if it fit, else its own array
                    out[i] = _acquire(fastest, keys[i]) or StoredPage(payload, checksum(payload))
        return out

    def release(self, pages: Iterable[StoredPage | None]) -> None:
        """End the leases of `lease`'s pages."""
        fastest = self.tiers[0]
        many = getattr(fastest, "release_many", None)
        if many is not None:
            many(pages)
            return
        for page in pages:
            if page is not None:
                _release(fastest, page)

    def lease_groups(self, groups: Sequence[Hashable], members: int) -> "GroupLease":
        """`lease` of members 0..members-1 of each group (keys `groups.join(group, member)`,
        group-major), with one lookup per group where the fastest tier keeps groups in its arena
        (`MemoryTier.acquire_groups`: a million-token session's K/V is 8K pages of 4 layers). A
        member it does not hold there is leased by key, as `lease` does (promoted from a slower
        tier, or a page outside the arena)."""
        fastest = self.tiers[0]
        key_groups = getattr(fastest, "groups", None)
        if key_groups is None:
            raise ValueError("lease_groups needs a memory tier with an arena and key groups")
        ids = fastest.acquire_groups(groups, members).reshape(-1)
        held = ids[ids >= 0]
        _, _, nbytes = fastest.arena.where(held)
        self.stats.add(f"hits_{fastest.kind}", len(held))
        self.stats.add("bytes_read", int(nbytes.sum()))
        lease = GroupLease(list(groups), members, ids, {})
        missing = np.flatnonzero(ids < 0).tolist()
        if missing:
            keys = [lease.key(i, key_groups) for i in missing]
            for i, page in zip(missing, self.lease(keys), strict=True):
                if page is None:
                    continue
                if page.slot is not None:
                    ids[i] = page.slot.id  # held by `lease`, released with the others
                else:
                    lease.loose[i] = page
        return lease

    def release_groups(self, lease: "GroupLease", corrupt: Sequence[int] = ()) -> None:
        """End `lease_groups`'s lease; `corrupt`: items whose bytes failed the reader's check
        (dropped where the fastest tier still holds them, and counted). Every leased page still
        held counts as used now (LRU)."""
        fastest = self.tiers[0]
        for i in corrupt:
            key = lease.key(i, fastest.groups)
            slot_id = int(lease.ids[i])
            if (fastest.holds_slot(key, slot_id) if slot_id >= 0
                    else i in lease.loose and fastest.holds(key, lease.loose[i])):
                fastest.pop(key)
            self.stats.add("corruptions")
        held = lease.ids[lease.ids >= 0]
        fastest.release_ids(held)
        fastest.touch_slots(held)  # (in the lease's order, as the keys were touched before)
        if lease.loose:  # pages outside the arena: by key
            fastest.touch([lease.key(i, fastest.groups) for i in sorted(lease.loose)])

    def drop_corrupt(self, key: str, page: StoredPage) -> None:
        """A leased page failed the reader's check: drop that copy (if still stored) and count it."""
        fastest = self.tiers[0]
        if getattr(fastest, "holds", lambda k, p: False)(key, page):
            fastest.pop(key)
        self.stats.add("corruptions")

    def contains(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is held in some tier (not verified: a later get may still miss)."""
        return [any(key in tier for tier in self.tiers) for key in keys]

    # ---- writes ------------------------------------------------------------------------------
    def put(self, key: str, data: Payload | bytes, pin: bool = False) -> None:
        """Store a page (copied: callers may reuse their buffer; object-store arguments are not
        held). pin=True also takes one pin on it."""
        payload = as_payload(data)  # each tier keeps its own copy (memory) or writes it out (disk)
        page_checksum = checksum(payload)
        if pin:
            self._pins[key] = self._pins.get(key, 0) + 1
        try:
            self._place(key, payload, page_checksum)
        except CapacityError:
            if pin:
                self._release_pin(key)
            raise
        self.stats.add("puts")
        self.stats.add("bytes_written", payload.nbytes)

    def put_many(self, items: Iterable[tuple[str, Payload | bytes]], pin: bool = False) -> None:
        for key, data in items:
            self.put(key, data, pin)

    def delete(self, keys: Iterable[str]) -> None:
        """Remove pages from every tier, pinned or not (pins on them are dropped too)."""
        for key in keys:
            for tier in self.tiers:
                tier.pop(key)
            self._pins.pop(key, None)

    # ---- pins --------------------------------------------------------------------------------
    def pin(self, keys: Iterable[str]) -> None:
        """Take one pin per key (a key may be pinned before its page arrives)."""
        for key in keys:
            self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, keys: Iterable[str]) -> None:
        for key in keys:
            self._release_pin(key)

    def is_pinned(self, key: str) -> bool:
        return self._pins.get(key, 0) > 0

    def _release_pin(self, key: str) -> None:
        count = self._pins.get(key, 0)
        if count <= 1:
            self._pins.pop(key, None)
        else:
            self._pins[key] = count - 1

    # ---- placement and eviction --------------------------------------------------------------
    def _place(self, key: str, payload: Payload, page_checksum: int) -> None:
        through = self._write_through_tier
        written = False
        if through is not None and self._make_room(through, payload.nbytes, exclude=key):
            self.tiers[through].put(key, payload, page_checksum)
            written = True
        for level, tier in enumerate(self.tiers):
            if level == through and written:
                return
            if self._make_room(level, payload.nbytes, exclude=key):
                tier.put(key, payload, page_checksum)
                return
            tier.pop(key)  # an older copy must not outlive the new one
        if written:
            return
        held = ", ".join(f"{t.kind} {t.bytes_used}/{t.capacity_bytes} bytes" for t in self.tiers)
        raise CapacityError(
            f"page {key!r} of {payload.nbytes} bytes does not fit: {held}, {len(self._pins)} pinned "
            "pages; unpin finished sessions or raise the capacity"
        )

    def _promote(self, key: str, payload: Payload, page_checksum: int) -> None:
        """Bring a hit in a slower tier back to the fastest when that needs no pinned page to move."""
        if self._make_room(0, payload.nbytes, exclude=key):
            self.tiers[0].put(key, payload, page_checksum)

    def _make_room(self, level: int, nbytes: int, exclude: str, also: str | None = None) -> bool:
        """Evict unpinned LRU pages of tier `level` (down the chain where they fit, else dropped)
        until nbytes fit; `exclude` (the page being placed) and `also` (the page whose placement
        caused this demotion) are never chosen."""
        tier = self.tiers[level]
        freed_if_replaced = tier.nbytes(exclude) if exclude in tier else 0
        need = tier.bytes_used - freed_if_replaced + nbytes - tier.capacity_bytes
        if need <= 0:
            return True
        victims = self._victims(tier.lru_keys(), tier.nbytes, need, exclude, also)
        if victims is None:
            return False
        for victim in victims:
            self._demote(level, victim, exclude)
        return True

    def _demote(self, level: int, victim: str, cause: str) -> None:
        """Move `victim` from tier `level` to the next tier down, or drop it there."""
        tier = self.tiers[level]
        lower = self.tiers[level + 1] if level + 1 < len(self.tiers) else None
        if lower is not None and victim in lower:
            tier.pop(victim)
            self.stats.add(f"evictions_to_{lower.kind}")  # already there (write-through)
            return
        # Held while it moves: an arena slot freed by the pop is not reused before the copy below.
        page = _acquire(tier, victim) if lower is not None else None
        tier.pop(victim)
        try:
            if page is not None and self._make_room(level + 1, page.payload.nbytes, victim, also=cause):
                lower.put(victim, page.payload, page.checksum)
                self.stats.add(f"evictions_to_{lower.kind}")
            elif not any(victim in other for other in self.tiers):
                self.stats.add("evictions_dropped")
        finally:
            if page is not None:
                _release(tier, page)

    def _victims(
        self, lru_keys, nbytes_of, need: int, exclude: str, also: str | None = None
    ) -> list[str] | None:
        """The least recently used unpinned keys that free ≥ need bytes, or None if impossible
        (then nothing is evicted: a failed put leaves the store as it was)."""
        victims, freed = [], 0
        for key in lru_keys:
            if key in (exclude, also) or self.is_pinned(key):
                continue
            victims.append(key)
            freed += nbytes_of(key)
            if freed >= need:
                return victims
        return None


def _acquire(tier: Tier, key: str) -> StoredPage | None:
    """The tier's page, held until `_release` where the tier can hold one (memory), else `get`."""
    acquire = getattr(tier, "acquire", None)
    return acquire(key) if acquire is not None else tier.get(key)


def _release(tier: Tier, page: StoredPage) -> None:
    release = getattr(tier, "release", None)
    if release is not None:
        release(page)
