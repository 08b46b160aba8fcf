"""The KV cache service: host-memory page stores with a disk tier, the index store apart from the
block store, sharded Ray actors, and the client a replica uses to reach them.

The service moves bytes; it imports nothing of the engine, the models or the kernels. The
replica-side code that turns a layer's pages into payloads and back (persist, adoption, swap, the
second-level prefix cache) lives in `msaserve.engine.kv` and talks to the service only through
`KVCacheClient`.

Pieces, from the bytes up:
- `codec`: page payloads (uint8 arrays), their xxh3 checksums, row copies.
- `tiers` / `store`: `PageStore`, host memory over a disk directory: checksums verified on every
  read, pins, LRU eviction memory → disk → dropped, byte caps per tier. Pure Python.
- `arena` / `views` / `leases`: the memory tier's pages in segments allocated once (pinned when an
  engine in this process provides them), and zero-copy leases of them for such a reader, who
  verifies what it uses.
- `keys` / `page_hash`: model identity, shard keys, the chained page hash (the one function the
  replicas and the router both use).
- `session_records`: `SessionRecord` (tokens, page hashes, tail, sampling state, model identity) and
  `SessionStore`, its incrementally appended on-disk manifest.
- `shard` / `transport` / `client`: the Ray actors (`shard = page_hash % num_shards`) and the client
  that routes and batches; `start_shards(ServiceConfig)` / `KVCacheClient.connect(...)`.
- `config` / `metrics`: the service's settings and its Ray metrics.
"""
