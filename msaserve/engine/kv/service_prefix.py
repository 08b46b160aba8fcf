"""The KV cache service as the engine's second-level prefix cache (docs/design.md §3).

- Evicted prefix-cache pages go to the service (content-addressed: a prefix is stored once,
  whichever replica evicted it), and so do the pages of persisted sessions (same chained hashes).
- A new request whose prompt runs past the local prefix-cache hit into pages the service holds
  gets those pages loaded (index-K and every layer's K/V, checksums verified) instead of
  prefilling them, and registered in the local prefix cache like computed pages.
Text prompts only: media pages hash with their content, which the service's keys do not carry.
"""

import logging

from msaserve.engine.block_manager import BlockManager
from msaserve.engine.kv.prefix import PrefixPageIO
from msaserve.engine.scheduler import Scheduler
from msaserve.engine.sequence import Sequence, SequenceStatus
from msaserve.kvcache.client import CapacityError, KVCacheClient, ServiceUnavailable
from msaserve.kvcache.page_hash import page_hashes
from msaserve.models.cache import LayerKVCache

logger = logging.getLogger(__name__)


class ServicePrefixCache:
    def __init__(self, client: KVCacheClient, caches: list[LayerKVCache], block_manager: BlockManager,
                 scheduler: Scheduler) -> None:
        self.io = PrefixPageIO(client)
        self.caches = caches
        self.block_manager = block_manager
        self.scheduler = scheduler
        self.num_loaded_pages = 0
        if block_manager.on_evict is None:  # an injected sink wins
            block_manager.on_evict = self.store_evicted

    def store_evicted(self, pages: list[int], hashes: list[int]) -> None:
        """BlockManager.on_evict: the pages still hold their contents; upload the missing ones."""
        try:
            self.io.store(hashes, self.caches, pages)
        except (ServiceUnavailable, CapacityError) as e:  # the pages are dropped, as without a service
            logger.warning("evicted pages not kept in the KV cache service: %s", e)

    def load_into(self, seq: Sequence) -> bool:
        """Start seq from its local prefix-cache hit plus the pages after it that the service holds.
        Returns True when seq was started (it is then running), False to admit it as usual."""
        manager, page_size, scheduler = self.block_manager, self.block_manager.page_size, self.scheduler
        if (not (manager.enable_prefix_caching and seq.enable_prefix_caching) or seq.media is not None
                or len(scheduler.running) >= scheduler.max_num_seqs):
            return False
        max_pages = (seq.num_tokens - 1) // page_size  # the last prompt token is always computed
        hashes = page_hashes(seq.token_ids[: max_pages * page_size], page_size)
        local = manager.lookup(hashes, seq.token_ids)
        try:
            held = self.io.held_prefix(hashes[len(local) :])
        except ServiceUnavailable:
            return False
        if held == 0 or held > manager.num_free_pages:
            return False
        manager.acquire(local)
        fresh = manager.allocate(held)
        try:
            intact = self.io.load(hashes[len(local) : len(local) + held], self.caches, fresh)
        except ServiceUnavailable:
            intact = 0
        manager.release(fresh[intact:])
        if intact == 0:
            manager.release(local)
            return False
        seq.block_table = local + fresh[:intact]
        seq.page_hashes = hashes[: len(seq.block_table)]
        manager.register(seq, len(local))
        seq.num_computed_tokens = seq.num_cached_tokens = len(seq.block_table) * page_size
        manager.num_queried_tokens += seq.num_tokens
        manager.num_hit_tokens += seq.num_cached_tokens
        seq.status = SequenceStatus.RUNNING
        scheduler.running.append(seq)
        self.num_loaded_pages += intact
        return True
