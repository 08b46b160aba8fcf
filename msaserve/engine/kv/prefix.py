"""The service as a second-level prefix cache: pages evicted on one replica, found by another.

For the engine's block manager (docs/design.md §3, prefix caching):
- on eviction of a cached page (before it is reused): `store(hashes, caches, pages)` uploads the
  page unless the service already holds it (content-addressed: each prefix is stored once);
- on admission, after the local prefix-cache lookup matched `k` pages: `held_prefix(hashes[k:])`
  says how many following pages the service holds; allocate that many, `load(...)` them into the
  caches (index-K and every layer's K/V) and register them like computed pages.
"""

from collections.abc import Sequence

from msaserve.engine.kv.pages import PageCodec
from msaserve.kvcache.client import KVCacheClient
from msaserve.models.cache import LayerKVCache


class PrefixPageIO:
    def __init__(self, client: KVCacheClient) -> None:
        self.client = client
        self.codec = PageCodec(client.model)
        self.bytes_stored = 0
        self.bytes_loaded = 0

    def held_prefix(self, page_hashes: Sequence[int]) -> int:
        """How many of the leading pages (chained hashes, in order) the service holds completely."""
        if not page_hashes:
            return 0
        held = self.client.has_pages(page_hashes)
        return next((i for i, h in enumerate(held) if not h), len(held))

    def store(
        self, page_hashes: Sequence[int], caches: Sequence[LayerKVCache], physical_pages: Sequence[int]
    ) -> int:
        """Upload the full pages not yet in the service; returns the bytes sent."""
        held = self.client.has_pages(page_hashes)
        missing = [i for i, h in enumerate(held) if not h]
        if not missing:
            return 0
        exported = self.codec.export_pages(caches, [physical_pages[i] for i in missing])
        sent = self.client.put_pages(
            [(page_hashes[i], kv, ix) for i, (kv, ix) in zip(missing, exported, strict=True)]
        )
        self.bytes_stored += sent
        return sent

    def load(
        self, page_hashes: Sequence[int], caches: Sequence[LayerKVCache], physical_pages: Sequence[int]
    ) -> int:
        """Fetch pages into the caches; returns how many leading pages arrived intact (a missing or
        corrupt one ends the prefix there: the caller computes the rest)."""
        num_layers = len(caches)
        index = self.client.get_index_async(page_hashes)
        kv = [self.client.get_kv_async([(h, layer) for h in page_hashes]) for layer in range(num_layers)]
        index_payloads = index.result()
        kv_payloads = [fetch.result() for fetch in kv]
        intact = len(page_hashes)
        for i in range(len(page_hashes)):
            if index_payloads[i] is None or any(layer[i] is None for layer in kv_payloads):
                intact = i
                break
        pages = list(physical_pages[:intact])
        self.codec.import_index(caches, pages, index_payloads[:intact])
        for layer, cache in enumerate(caches):
            self.codec.import_kv(cache, pages, kv_payloads[layer][:intact])
        self.bytes_loaded += sum(p.nbytes for p in index_payloads[:intact])
        self.bytes_loaded += sum(p.nbytes for layer in kv_payloads for p in layer[:intact])
        return intact
