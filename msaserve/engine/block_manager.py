"""The page pool: allocation, reference counts, the prefix cache and its LRU eviction.

In our cache layout (docs/design.md §3) a physical page id addresses the same page of K, V and index-K
in every layer, so one allocator covers KV pages and index pages from one budget.

Prefix cache: every full page a sequence computes is registered under its chained hash
(`msaserve.kvcache.page_hash`), with its parent hash and token ids so that a hit is re-checked
against the tokens (a 64-bit hash can collide). A page whose reference count drops to 0 keeps its
contents and hash and becomes *evictable*; allocation takes never-used or unhashed pages first,
then evicts the least recently freed cached page.
"""

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from msaserve.engine.sequence import Sequence
from msaserve.engine.types import KVEvent
from msaserve.kvcache.page_hash import ROOT_HASH, hash_page, page_hashes


@dataclass
class _CachedPage:
    page_hash: int
    parent_hash: int
    token_ids: list[int]


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True,
                 on_evict: Callable[[list[int], list[int]], None] | None = None) -> None:
        """on_evict(pages, page_hashes) runs when cached pages are evicted, before they are reused:
        their contents are still intact, so it can persist them (to the KV cache service)."""
        self.num_pages = num_pages
        self.on_evict = on_evict
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_pages
        self._cached: list[_CachedPage | None] = [None] * num_pages
        self._hash_to_page: dict[int, int] = {}
        self._free_uncached: deque[int] = deque(range(num_pages))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        """Pages with ref count 0 that still hold a cached page; oldest first."""
        self._events: list[KVEvent] = []
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    # ---- pool state -------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        """Pages an allocation can take now (unused plus evictable cached ones)."""
        return len(self._free_uncached) + len(self._evictable)

    @property
    def num_cached_pages(self) -> int:
        return len(self._hash_to_page)

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def pages_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Pages to allocate so that seq can hold `num_new_tokens` more computed tokens."""
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.page_size)
        return max(0, total - len(seq.block_table))

    # ---- sequence lifecycle -----------------------------------------------------------------
    def admit(self, seq: Sequence) -> int:
        """Give a new sequence its prefix-cache pages. Returns the number of cached tokens.

        At least the last prompt token is left to compute: its logits give the first output token.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0, "admit() of a started sequence"
        if not (self.enable_prefix_caching and seq.enable_prefix_caching):
            return 0
        max_pages = (seq.num_tokens - 1) // self.page_size
        media = [seq.page_media_hashes(i) for i in range(max_pages)] if seq.media is not None else None
        hashes = page_hashes(seq.token_ids[: max_pages * self.page_size], self.page_size, media)
        pages = self.lookup(hashes, seq.token_ids)
        self.acquire(pages)
        seq.block_table = pages
        seq.page_hashes = hashes[: len(pages)]
        seq.num_computed_tokens = seq.num_cached_tokens = len(pages) * self.page_size
        self.num_queried_tokens += seq.num_tokens
        self.num_hit_tokens += seq.num_cached_tokens
        return seq.num_cached_tokens

    def lookup(self, hashes: list[int], token_ids: list[int]) -> list[int]:
        """Physical pages holding the longest cached run of `hashes` (tokens re-checked)."""
        pages: list[int] = []
        parent = ROOT_HASH
        for i, page_hash in enumerate(hashes):
            page = self._hash_to_page.get(page_hash)
            if page is None:
                break
            cached = self._cached[page]
            tokens = token_ids[i * self.page_size : (i + 1) * self.page_size]
            if cached is None or cached.parent_hash != parent or cached.token_ids != tokens:
                break  # a hash collision: the same hash for other tokens
            pages.append(page)
            parent = page_hash
        return pages

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Extend seq's block table to hold `num_new_tokens` more tokens; False if pages lack."""
        needed = self.pages_needed(seq, num_new_tokens)
        if needed > self.num_free_pages:
            return False
        seq.block_table.extend(self.allocate(needed))
        return True

    def commit(self, seq: Sequence) -> None:
        """Register the full pages seq computed since the last call in the prefix cache."""
        if not (self.enable_prefix_caching and seq.enable_prefix_caching):
            return
        first = len(seq.page_hashes)
        for i in range(first, seq.num_computed_tokens // self.page_size):
            parent = seq.page_hashes[-1] if seq.page_hashes else ROOT_HASH
            tokens = seq.page_tokens(i, self.page_size)
            seq.page_hashes.append(hash_page(parent, tokens, seq.page_media_hashes(i)))
        self.register(seq, first)

    def register(self, seq: Sequence, first_page: int) -> None:
        """Enter seq's hashed pages from `first_page` on into the prefix cache (once per hash)."""
        stored: list[int] = []
        for i in range(first_page, len(seq.page_hashes)):
            page_hash, page = seq.page_hashes[i], seq.block_table[i]
            if page_hash in self._hash_to_page or self._cached[page] is not None:
                continue  # already cached elsewhere (or this page is a shared cached page)
            parent = seq.page_hashes[i - 1] if i else ROOT_HASH
            self._cached[page] = _CachedPage(page_hash, parent, seq.page_tokens(i, self.page_size))
            self._hash_to_page[page_hash] = page
            stored.append(page_hash)
        if stored:
            self._events.append(KVEvent("stored", stored, time.time()))

    def free(self, seq: Sequence) -> None:
        """Drop seq's references; its cached pages stay reusable until evicted."""
        self.release(seq.block_table)
        seq.block_table = []

    # ---- page-level operations --------------------------------------------------------------
    def acquire(self, pages: list[int]) -> None:
        for page in pages:
            if self.ref_counts[page] == 0:
                self._evictable.pop(page)
            self.ref_counts[page] += 1

    def release(self, pages: list[int]) -> None:
        # Reverse order: a sequence's tail pages become the least recently used, so eviction
        # takes them before the prefix pages that other requests are likelier to share.
        for page in reversed(pages):
            self.ref_counts[page] -= 1
            assert self.ref_counts[page] >= 0, f"page {page} released more often than acquired"
            if self.ref_counts[page] == 0:
                if self._cached[page] is not None:
                    self._evictable[page] = None
                else:
                    self._free_uncached.append(page)

    def allocate(self, count: int) -> list[int]:
        if count > self.num_free_pages:
            raise RuntimeError(f"asked for {count} pages, {self.num_free_pages} free")
        pages: list[int] = []
        removed: list[int] = []
        evicted: list[int] = []
        for _ in range(count):
            if self._free_uncached:
                page = self._free_uncached.popleft()
            else:
                page, _ = self._evictable.popitem(last=False)
                removed.append(self._uncache(page))
                evicted.append(page)
            self.ref_counts[page] = 1
            pages.append(page)
        if removed:
            if self.on_evict is not None:
                self.on_evict(evicted, removed)
            self._events.append(KVEvent("removed", removed, time.time()))
        return pages

    def _uncache(self, page: int) -> int:
        cached = self._cached[page]
        assert cached is not None
        self._cached[page] = None
        del self._hash_to_page[cached.page_hash]
        return cached.page_hash

    def drop_cached(self, page_hashes: list[int]) -> list[int]:
        """Forget these cached pages where no sequence holds them (a session moved away); returns
        the hashes dropped (reported as a "removed" event)."""
        dropped: list[int] = []
        for page_hash in page_hashes:
            page = self._hash_to_page.get(page_hash)
            if page is not None and self.ref_counts[page] == 0:
                self._evictable.pop(page)
                dropped.append(self._uncache(page))
                self._free_uncached.append(page)
        if dropped:
            self._events.append(KVEvent("removed", dropped, time.time()))
        return dropped

    def reset_prefix_cache(self) -> None:
        """Forget every cached page that no sequence holds."""
        while self._evictable:
            page, _ = self._evictable.popitem(last=False)
            self._uncache(page)
            self._free_uncached.append(page)
        self._events.append(KVEvent("cleared", [], time.time()))

    def drain_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def check_consistency(self) -> None:
        """Raise if the pool's bookkeeping disagrees with itself (used by tests)."""
        held = sum(1 for n in self.ref_counts if n > 0)
        if held + self.num_free_pages != self.num_pages:
            raise AssertionError(
                f"{held} held + {self.num_free_pages} free pages != pool of {self.num_pages}"
            )
        for page_hash, page in self._hash_to_page.items():
            cached = self._cached[page]
            if cached is None or cached.page_hash != page_hash:
                raise AssertionError(f"hash {page_hash} maps to page {page} that does not hold it")
