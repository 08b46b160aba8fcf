"""`profile_index_load.py --compare`: adoption's index load, packed (before issue 30's arena)
against leased (copied straight from the shards' arenas, verified beside the copy). See there."""

import argparse
import os
import pickle
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch
from adopt import git_revision, hardware, merge_results

from msaserve.engine.kv import direct_index
from msaserve.engine.kv.adoption import LazyPageFetcher
from msaserve.engine.kv.pages import PageCodec, identity_for
from msaserve.engine.kv.pinned_segments import segment_allocators, segment_tensor
from msaserve.kernels.checksum import xxh3_64_rows
from msaserve.kvcache.arena import numpy_segment
from msaserve.kvcache.client import KVCacheClient
from msaserve.kvcache.codec import PACK_THREADS, pack_pool
from msaserve.kvcache.config import ServiceConfig
from msaserve.kvcache.session_records import SessionRecord
from msaserve.kvcache.shard import KVCacheShard
from msaserve.kvcache.transport import LocalTransport
from msaserve.models.cache import allocate_caches
from msaserve.models.presets import get_preset

ROOT = Path(__file__).resolve().parents[2]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(device: torch.device, fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, out


class OtherProcess(LocalTransport):
    """Shards as a replica sees the platform's shard actors (no Ray on the H200 image): no shared
    memory, and every answer pickled once (Ray's object store copies an answer's arrays once)."""

    shares_memory = False

    def gather(self, futures, timeout_s=None):
        answers = super().gather(futures, timeout_s)
        return [pickle.loads(pickle.dumps(answer, protocol=5)) for answer in answers]


def stored_client(args, identity, payloads, hashes, allocators, other_process: bool = False,
                  shared_arena: bool = False) -> KVCacheClient:
    memory = 2 * payloads.nbytes + (256 << 20)  # the index store's half holds every page
    config = ServiceConfig(num_shards=args.shards, memory_bytes=memory, index_fraction=0.5,
                           shared_index_arena=shared_arena)
    if other_process:
        shards = [KVCacheShard(config, i, publish_metrics=False) for i in range(args.shards)]
        client = KVCacheClient(shards, identity, OtherProcess(shards))
    else:
        client = KVCacheClient.in_process(config, identity, segment_allocators=allocators)
    for a in range(0, len(hashes), 512):
        client.put_pages([(h, None, payloads[i]) for i, h in enumerate(hashes[a : a + 512], start=a)])
    return client


def check_equal(caches, payloads: np.ndarray, codec: PageCodec) -> None:
    """Every cache page holds its payload's bytes (all layers)."""
    for a in range(0, len(payloads), 1024):
        rows = range(a, min(a + 1024, len(payloads)))
        ix = torch.stack([c.index_cache[a : rows.stop] for c in caches], dim=1).cpu()
        got = ix.contiguous().view(torch.uint8).reshape(len(rows), -1).numpy()
        if not np.array_equal(got, payloads[a : rows.stop, : codec.index_bytes]):
            raise SystemExit(f"index pages {a}..{rows.stop - 1} differ from the stored ones")


def packed_reads(args, device, client, hashes, codec) -> dict[str, float]:
    """The packed load's host side alone: the shards copy every page into a reused buffer and
    verify the copy (what the device waits for before its upload)."""
    row, group = codec.index_bytes + codec.scale_bytes, 512
    out = np.empty((group, row), np.uint8)

    def reads() -> None:
        for a in range(0, len(hashes), group):
            part = hashes[a : a + group]
            assert all(client.get_index_packed_async(part, out[: len(part)]).result())

    ms, _ = median_ms(device, reads, args.repeats)
    return {"packed part: shard copies + verify": ms}


def parts(args, device, client, hashes, codec) -> dict[str, float]:
    """The leased load's parts alone: the shards' lease calls, the checks, the copies."""
    row = codec.index_bytes + codec.scale_bytes
    out = {}
    out["lease (shard calls) + release"], _ = median_ms(
        device, lambda: client.lease_index_async(hashes).result().release(), args.repeats)
    lease = client.lease_index_async(hashes).result()
    checksums = lease.checksums.tolist()
    step = direct_index.VERIFY_PAGES

    def verify() -> None:
        check = direct_index._first_bad
        jobs = [pack_pool().submit(check, lease.views[a : a + step], checksums[a : a + step])
                for a in range(0, len(hashes), step)]
        assert all(job.result() < 0 for job in jobs)

    out[f"verify ({PACK_THREADS} threads)"], _ = median_ms(device, verify, args.repeats)
    staging = direct_index._Staging(device, direct_index.GROUP_PAGES, row)
    segments = [segment_tensor(s) for s in lease.segments]
    groups = [np.arange(a, min(a + direct_index.GROUP_PAGES, len(hashes)))
              for a in range(0, len(hashes), direct_index.GROUP_PAGES)]
    _, runs = direct_index.runs_of(lease.segment_of, lease.offsets, row)

    def copy() -> None:
        for g, items in enumerate(groups):
            staging.fill(g % 2, lease, segments, items, row)
        staging.finish()

    out[f"host→device copies ({len(runs)} runs)"], _ = median_ms(device, copy, args.repeats)
    if device.type == "cuda":  # the load's check on CUDA: the same digests from the copied rows
        def verify_device() -> None:
            for g, items in enumerate(groups):
                xxh3_64_rows(staging.buffers[g % 2][: len(items)])

        out["verify on the GPU (xxh3 kernel)"], _ = median_ms(device, verify_device, args.repeats)
    lease.release()
    return out


def compare(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="profile_index_load.py --compare")
    parser.add_argument("--compare", action="store_true")
    parser.add_argument("--pages", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=4, help="index page = layers × 32 KiB")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-other-process", dest="other_process", action="store_false",
                        help="skip the loads from shards behaving as another process (packed, and leased "
                        "from shared segment files)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    config = get_preset("m3-proxy", num_layers=args.layers)
    identity = identity_for(config, f"m3-proxy-L{args.layers}", torch.bfloat16)
    codec = PageCodec(identity)
    rng = np.random.default_rng(0)
    hashes = [int(h) for h in rng.integers(1, 2**62, args.pages)]
    payloads = rng.integers(0, 256, (args.pages, codec.index_bytes), dtype=np.uint8)
    record = SessionRecord("bench", identity, page_hashes=hashes)
    caches = allocate_caches(config, args.pages, device, torch.bfloat16)
    results, breakdown = {}, {}
    modes = ["packed", "leased"]
    if args.other_process:
        modes += ["other_process_packed", "other_process_shared"]
    for mode in modes:
        allocators = None if mode == "packed" else (segment_allocators(device) or {"index": numpy_segment})
        client = stored_client(args, identity, payloads, hashes, allocators, mode.startswith("other"),
                               mode == "other_process_shared")
        fetcher = LazyPageFetcher(client, record, caches, list(range(args.pages)))
        load = fetcher._load_index_packed if mode.endswith("packed") else fetcher._load_index_leased
        load()  # warm-up (the upload ring, the pool's threads, the allocator's cache)
        for c in caches:
            c.index_cache.zero_()
        results[mode], usable = median_ms(device, load, args.repeats)
        assert usable == args.pages, (mode, usable)
        check_equal(caches, payloads, codec)
        if mode == "packed":
            breakdown.update(packed_reads(args, device, client, hashes, codec))
        elif mode == "leased":
            breakdown.update(parts(args, device, client, hashes, codec))
        client = fetcher = None
    report(args, device, codec, results, breakdown)


def report(args, device, codec, results: dict[str, float], breakdown: dict[str, float]) -> None:
    gib = args.pages * (codec.index_bytes + codec.scale_bytes) / 2**30
    prefix = "kvcache.index_load_" if device.type == "cuda" else "kvcache.index_load_cpu_"
    meta = dict(command="python benchmarks/kvcache/profile_index_load.py " + " ".join(sys.argv[1:]),
                hardware=hardware(device) + f", {os.cpu_count()} host cores",
                date=datetime.now(UTC).isoformat(timespec="seconds"),
                git_revision=os.environ.get("MSASERVE_GIT_REVISION") or git_revision(),
                workload=f"{args.pages} index pages of {codec.index_bytes // 1024} KiB ({gib:.2f} GiB, "
                         f"m3-proxy attention shape, {args.layers} layers, bf16) in {args.shards} "
                         f"in-process shards, median of {args.repeats}")
    entries = {
        f"{prefix}packed_ms": dict(value=round(results["packed"], 2), unit="ms", **meta),
        f"{prefix}leased_ms": dict(value=round(results["leased"], 2), unit="ms", **meta),
        f"{prefix}leased_speedup": dict(value=round(results["packed"] / results["leased"], 2), unit="x",
                                        **meta),
    }
    other = ("other_process_packed", "other_process_shared")
    if all(mode in results for mode in other):
        note = ("shards behind a transport that shares no memory and pickles every answer once, as a "
                "replica reaches the platform's shard actors: packed reads, and leases of the shards' "
                "shared index segment files mapped by the reader")
        for mode in other:
            entries[f"{prefix}{mode}_ms"] = dict(value=round(results[mode], 2), unit="ms", note=note, **meta)
        entries[f"{prefix}other_process_shared_speedup"] = dict(
            value=round(results[other[0]] / results[other[1]], 2), unit="x", note=note, **meta)
    name = "kvcache_index_load.json" if device.type == "cuda" else "kvcache_index_load_cpu.json"
    out = merge_results(ROOT / "benchmarks" / "results" / name, entries)
    print(f"\n{meta['workload']}; {meta['hardware']}; results → {out}")
    print(f"{'index load':<44}{'ms':>9}{'GB/s':>8}")
    other_rows = [(label, results[mode]) for mode, label in (
        ("other_process_packed", "other process: packed (pickled once)"),
        ("other_process_shared", "other process: leased from shared files")) if mode in results]
    for label, ms in [("packed (copy into pinned ring + verify)", results["packed"]),
                      ("leased (arena → device, checked there)", results["leased"]), *other_rows,
                      *[(f"  {k if k.startswith('packed') else 'leased part: ' + k}", v)
                        for k, v in breakdown.items()]]:
        print(f"{label:<44}{ms:>9.1f}{gib * 2**30 / 1e9 / (ms / 1e3):>8.1f}")
    print(f"leased vs packed: {results['packed'] / results['leased']:.2f}x")
