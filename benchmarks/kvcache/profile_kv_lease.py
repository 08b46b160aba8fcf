"""What an adoption's K/V lease costs (`HostKV.request_lease` + `attach_lease`), and where.

A sparse-resident adoption leases every stored page's K/V where the in-process shards keep it
(`engine/kv/host_tier.py`); on the H200 that was ~50 ms of a 134 ms first token at 1M tokens
(`residency.py`, git 7a13dbb), all of it Python on the host. This measures, for `--pages` pages of
`--layers` layers in `--shards` in-process shards with a K/V arena (pinned on CUDA, plain on the
CPU):
- `lease_kv` of one shard, alone (its keys, lookups and slot holds), for the pages it holds;
- the whole lease as an adoption asks for it (`request_lease` + `attach_lease`: the shards' threads
  and the reader's merge), with and without its release;
- the release;
- request + attach again, with the adoption's index leases (`--index-groups` leases of the same
  pages, as `direct_index.load_index_leased` takes them) released beside it, their releases started
  right after the K/V lease request (as adoptions did from c72f456 to 62b013f) or after the attach
  (since 62b013f: at the session's second step).
Median of `--repeats`. Prints a table last; writes benchmarks/results/kvcache_kv_lease[_cpu].json.

    python benchmarks/kvcache/profile_kv_lease.py                  # 8,192 pages x 4 layers (1M tokens)
    python benchmarks/kvcache/profile_kv_lease.py --pages 1024     # a quick run
"""

import argparse
import os
import random
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(HERE)]

from adopt import git_revision, hardware, merge_results  # noqa: E402

from msaserve.engine.kv.host_tier import HostKV, ServiceSource  # noqa: E402
from msaserve.engine.kv.pinned_segments import segment_allocators  # noqa: E402
from msaserve.kvcache.arena import numpy_segment  # noqa: E402
from msaserve.kvcache.client import KVCacheClient  # noqa: E402
from msaserve.kvcache.config import ServiceConfig  # noqa: E402
from msaserve.kvcache.keys import ModelIdentity, shards_of_pages  # noqa: E402

PAGE_SHAPE = (8, 1, 32)
"""(P, Hkv, D) of the stored pages: small (1 KiB), since the cost measured is per item, not per byte."""


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--index-groups", type=int, default=8,
                        help="index leases an adoption holds (8,192 pages / direct_index.GROUP_PAGES)")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    identity = ModelIdentity("lease-profile", args.layers, *PAGE_SHAPE, 1, 32, "bfloat16", "bfloat16")
    allocators = segment_allocators(device, ("kv", "index")) or {"kv": numpy_segment, "index": numpy_segment}
    client = KVCacheClient.in_process(ServiceConfig(num_shards=args.shards, memory_bytes=2 << 30), identity,
                                      segment_allocators=allocators)
    rng = random.Random(0)
    hashes = [rng.getrandbits(63) for _ in range(args.pages)]
    payload = np.zeros(2 * int(np.prod(PAGE_SHAPE)) * 2, np.uint8)
    index_payload = np.zeros(args.layers * PAGE_SHAPE[0] * 32 * 2, np.uint8)  # 1 index head of 32, bf16
    client.put_pages([(h, [payload] * args.layers, index_payload) for h in hashes])
    host = HostKV(args.layers, args.pages, PAGE_SHAPE, torch.bfloat16, pin=device.type == "cuda",
                  source=ServiceSource(client, hashes, "profile"))
    items = args.pages * args.layers

    shard = client.shards[0]
    own = [h for h, s in zip(hashes, shards_of_pages(hashes, args.shards).tolist(), strict=True) if s == 0]
    own_items = len(own) * args.layers
    one_shard_ms = median_ms(lambda: shard.release_lease(
        shard.lease_kv(client.model_key, own, args.layers).lease_id), args.repeats)
    leased = []

    def lease() -> None:
        leased.append(host.attach_lease(host.request_lease(hashes), args.pages, cuda=device.type == "cuda"))
        host.release_lease()

    lease_ms = median_ms(lease, args.repeats)
    attaches, releases = [], []
    for _ in range(args.repeats):  # the part on the first token's path (request + attach), the release
        start = time.perf_counter()
        host.attach_lease(host.request_lease(hashes), args.pages, cuda=device.type == "cuda")
        middle = time.perf_counter()
        host.release_lease()
        attaches.append(middle - start)
        releases.append(time.perf_counter() - middle)
    attach_ms, release_ms = statistics.median(attaches) * 1e3, statistics.median(releases) * 1e3
    group = -(-args.pages // args.index_groups)

    def index_leases() -> list:
        held = [client.lease_index_async(hashes[g:g + group]).result() for g in range(0, args.pages, group)]
        if sum(int((held_lease.nbytes >= 0).sum()) for held_lease in held) != args.pages:
            raise SystemExit("the index leases did not hold every page")
        return held

    beside, after = [], []
    for _ in range(args.repeats):  # alternated: index releases beside the attach, then after it
        held = index_leases()
        start = time.perf_counter()
        fetch = host.request_lease(hashes)
        waits = [held_lease.release_async() for held_lease in held]  # each shard: K/V lease first
        host.attach_lease(fetch, args.pages, cuda=device.type == "cuda")
        beside.append(time.perf_counter() - start)
        for wait in waits:
            wait()
        host.release_lease()
        held = index_leases()
        start = time.perf_counter()
        host.attach_lease(host.request_lease(hashes), args.pages, cuda=device.type == "cuda")
        after.append(time.perf_counter() - start)
        for wait in [held_lease.release_async() for held_lease in held]:
            wait()
        host.release_lease()
    beside_ms, after_ms = statistics.median(beside) * 1e3, statistics.median(after) * 1e3
    if min(leased) != items:
        raise SystemExit(f"leased {min(leased)} of {items} items: the K/V arena did not hold every page")

    meta = dict(
        command="python benchmarks/kvcache/profile_kv_lease.py " + " ".join(sys.argv[1:]),
        hardware=hardware(device), date=datetime.now(UTC).isoformat(timespec="seconds"),
        git_revision=os.environ.get("MSASERVE_GIT_REVISION") or git_revision(),
        workload=f"{args.pages} pages x {args.layers} layers ({items} items) in {args.shards} in-process "
        f"shards, median of {args.repeats}",
    )
    suffix = "" if device.type == "cuda" else "_cpu"
    entries = {
        f"kvcache.kv_lease{suffix}_ms": dict(
            value=round(lease_ms, 2), unit="ms",
            note="HostKV.request_lease + attach_lease + release_lease of every item, as an adoption does",
            **meta),
        f"kvcache.kv_lease_request_attach{suffix}_ms": dict(
            value=round(attach_ms, 2), unit="ms",
            note="HostKV.request_lease + attach_lease of every item: the part an adoption's first token "
            f"waits for (the release, {release_ms:.2f} ms here, comes at the next session's second step)",
            **meta),
        f"kvcache.kv_lease_release{suffix}_ms": dict(
            value=round(release_ms, 2), unit="ms",
            note="HostKV.release_lease of every item (the shards end the lease and touch its pages for "
            "the LRU): off the first token's path, but the shards' threads hold the GIL meanwhile",
            **meta),
        f"kvcache.kv_lease_attach_index_releases_beside{suffix}_ms": dict(
            value=round(beside_ms, 2), unit="ms",
            note=f"request + attach with the adoption's {args.index_groups} index leases released beside it "
            f"(started right after the K/V lease request, as from c72f456 to 62b013f); started after the "
            f"attach instead (since 62b013f): {after_ms:.2f} ms; alternated, median of each",
            **meta),
        f"kvcache.kv_lease_one_shard{suffix}_us_per_item": dict(
            value=round(one_shard_ms * 1e3 / own_items, 3), unit="us per item",
            note=f"KVCacheShard.lease_kv + release_lease of the {own_items} items one shard holds, alone "
            f"({one_shard_ms:.2f} ms)", **meta),
    }
    out = merge_results(args.output or ROOT / "benchmarks" / "results" / f"kvcache_kv_lease{suffix}.json",
                        entries)
    print(f"\n{meta['workload']}, {meta['hardware']}; results → {out}")
    print(f"{'part':<52}{'ms':>9}{'us/item':>9}")
    for name, ms, n in (("one shard's lease_kv + release, its own items", one_shard_ms, own_items),
                        ("request + attach + release (as adoption)", lease_ms, items),
                        ("request + attach (the first token's part)", attach_ms, items),
                        ("release alone", release_ms, items),
                        ("request + attach, index releases beside it", beside_ms, items),
                        ("request + attach, index releases after it", after_ms, items)):
        print(f"{name:<52}{ms:>9.2f}{ms * 1e3 / n:>9.3f}")


if __name__ == "__main__":
    main()
