"""Disaggregated KV cache service: index store apart from block store, memory and disk tiers, migration.

Pieces, from the bytes up:
- `codec` / `pages`: page payloads (uint8 arrays) and their xxh3 checksums; K+V per (page, layer),
  index-K per page for all layers.
- `tiers` / `store`: `PageStore`, host memory over a disk directory: checksums verified on every
  read, pins, LRU eviction memory → disk → dropped, byte caps per tier. Pure Python.
- `session`: `SessionRecord` (tokens, page hashes, tail, sampling state, model identity) and its
  incrementally appended on-disk manifest.
- `shard` / `client`: the Ray actors (`shard = page_hash % num_shards`) and the replica-side client
  that routes and batches; `start_shards(ServiceConfig)` / `KVCacheClient.connect(...)`.
- `persist` / `adoption`: `SessionWriter` (persist a generating sequence page by page) and
  `LazyPageFetcher` (adopt: the index first, then the K/V pages each layer selects).
- `engine_adapter`: `ServicePageStore`, the engine's swap protocol over the service.
"""
