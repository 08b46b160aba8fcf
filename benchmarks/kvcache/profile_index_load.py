"""Where the adoption index load spends its time, and the old against the new load.

Default (a diagnostic; prints, writes nothing): index pages of 64 KiB (m3-proxy, 2 layers, bf16)
in 4 in-process shards; each step of the packed load timed apart (best of 3), then the pipelined
load under cProfile.

`--compare`: `LazyPageFetcher`'s two index loads of the same pages (m3-proxy's attention shape with
`--layers` 4: M3's index page, 128 KiB; 8,192 pages = 1 GiB) from 4 in-process shards —
**packed** (the shards copy each page into a pinned upload buffer and verify the copy; before
issue 30's arena) and **leased** (the shards' memory tier keeps the pages in arenas, pinned on
CUDA; the device copies runs of them straight from there and checks them on the GPU — on the CPU
a thread pool verifies the same bytes — `engine/kv/direct_index.py`) — median of `--repeats`,
every page checked equal afterwards;
then the leased load's parts alone; then (unless `--no-other-process`) the same pages from shards
that behave as the platform's shard actors do for a replica (no shared memory, every answer pickled
once): packed reads, and leases of the shards' shared index segment files
(`kvcache/shared_segments.py`). Prints a table; writes benchmarks/results/kvcache_index_load.json
(`kvcache_index_load_cpu.json` with `kvcache.index_load_cpu_*` keys off CUDA).

    python benchmarks/kvcache/profile_index_load.py [num_pages]    # default 8192 (1M tokens)
    python benchmarks/kvcache/profile_index_load.py --compare [--pages 8192 --layers 4 --repeats 5]
"""

import cProfile
import pstats
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np
import torch
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from msaserve.engine.kv import adoption, staging
from msaserve.engine.kv.pages import PageCodec, identity_for
from msaserve.kvcache.client import KVCacheClient
from msaserve.kvcache.config import ServiceConfig
from msaserve.models.cache import allocate_caches
from msaserve.models.presets import get_preset

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def pipelined(groups, fetch, depth: int = 2):
    """The index load before packed reads (git 4755ee2): (group, fetch(group)) in order, up to
    `depth` later groups' fetches started ahead; each group's payloads then imported one by one."""
    pending = deque()
    for group in groups:
        pending.append((group, fetch(group)))
        if len(pending) > depth:
            yield pending.popleft()
    while pending:
        yield pending.popleft()


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def best_of(label: str, fn, reps: int = 3):
    best, result = float("inf"), None
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        result = fn()
        sync()
        best = min(best, time.perf_counter() - start)
    print(f"{label:<40} {best * 1e3:8.1f} ms", flush=True)
    return result


def main() -> None:
    if "--compare" in sys.argv:
        from index_load_compare import compare

        compare(sys.argv[1:])
        return
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    config = get_preset("m3-proxy", num_layers=2)
    identity = identity_for(config, "m3-proxy-L2", torch.bfloat16)
    codec = PageCodec(identity)
    service = ServiceConfig(num_shards=4, memory_bytes=4 << 30, index_fraction=0.5)
    client = KVCacheClient.in_process(service, identity)
    rng = np.random.default_rng(0)
    hashes = [int(h) for h in rng.integers(1, 2**62, n)]
    pages = rng.integers(0, 255, (n, codec.index_bytes), dtype=np.uint8)
    client.put_pages([(h, None, pages[i]) for i, h in enumerate(hashes)])
    caches = allocate_caches(config, n + 8, DEVICE, torch.bfloat16)

    payloads = best_of("read + verify (4 shard threads)", lambda: client.get_index(hashes))
    views = [pages[i] for i in range(n)]
    best_of("verify only, 1 thread", lambda: [xxhash.xxh3_64_intdigest(p) for p in views])
    best_of("size checks", lambda: staging.check_sizes(payloads, codec.index_bytes, "index", "m3"))
    out = np.empty((n, codec.index_bytes), np.uint8)
    best_of(f"pack ({staging.PACK_THREADS} threads)", lambda: staging._pack(payloads, out))
    best_of("pack (1 thread)", lambda: np.stack(payloads, out=out))
    host = torch.empty(n * codec.index_bytes, dtype=torch.uint8, pin_memory=DEVICE == "cuda")
    device = torch.empty(n * codec.index_bytes, dtype=torch.uint8, device=DEVICE)
    best_of("host→device copy (pinned)", lambda: device.copy_(host, non_blocking=True))
    best_of("import_index (all pages at once)", lambda: codec.import_index(caches, list(range(n)), payloads))

    def pipelined_load(depth: int = 2, size: int = adoption.INDEX_GROUP_PAGES) -> None:  # as load_index
        groups = [range(i, min(i + size, n)) for i in range(0, n, size)]
        fetch = lambda r: client.get_index_async([hashes[q] for q in r])  # noqa: E731
        for group, pending in pipelined(groups, fetch, depth):
            codec.import_index(caches, list(group), pending.result())

    best_of("pipelined load (per-page payloads, before)", pipelined_load)
    for depth, size in ((0, 512), (2, 2048)):
        best_of(f"pipelined load, depth {depth}, groups of {size}",
                lambda d=depth, g=size: pipelined_load(d, g))

    def packed_load() -> None:  # as load_index does it now: pages verified straight into pinned buffers
        ring = staging.ring_for(torch.device(DEVICE))
        row = codec.index_bytes
        size = min(adoption.INDEX_GROUP_PAGES, ring.rows_per_buffer(row))
        groups = [range(i, min(i + size, n)) for i in range(0, n, size)]
        units = [(row, len(r), lambda out, r=r: client.get_index_packed_async([hashes[q] for q in r], out))
                 for r in groups]
        physical = torch.arange(n, device=DEVICE)
        with ring.lock:
            for i, _, upload in adoption.load_packed(ring, units):
                group = groups[i]
                chunk, items = upload(len(group))
                codec.scatter_index(caches, physical[group.start + items], chunk)

    best_of("packed load (as load_index)", packed_load)
    shard_pages = [hashes[i::4] for i in range(4)]
    best_of("packed reads only (4 shard threads)", lambda: [
        f.result() for f in [client.get_index_packed_async(h, np.empty((len(h), codec.index_bytes), np.uint8))
                             for h in shard_pages]])
    profile = cProfile.Profile()
    profile.enable()
    packed_load()
    sync()
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
