"""The replica's side of KV paging: what moves a sequence's pages between this replica's GPU pool
and somewhere else, and back.

- `swap`: preemption by swapping (`SwapStore` protocol, `HostSwapStore` in pinned host memory).
- `service_swap`: `ServiceSwapStore`, the same protocol over the KV cache service.
- `pages` / `staging`: `PageCodec` (a layer's K/V/index pages ↔ service payloads) and the pinned
  staging buffers that overlap the copies.
- `prefix` / `service_prefix`: the KV cache service as the second-level prefix cache.
- `persist` / `adoption` / `sessions`: persist a generating session page by page; adopt one on
  another replica (the index first, then the K/V pages each layer selects); the engine's session
  manager that parks, moves and resumes them.

Everything here reaches the service only through `msaserve.kvcache.client.KVCacheClient` and the
service's wire types (`codec`, `keys`, `page_hash`, `session_records`).
"""
