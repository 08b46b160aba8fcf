"""The host side of an adoption's two service reads, before and after they copied each page once.

m3-mini's pages (bf16: K/V 256 KiB per layer, index 128 KiB with 4 layers) in 4 in-process shards:
- **miss read**: one layer-step's misses of a sparse-resident session whose pages are still in the
  service (60 pages, 15 MiB: what every layer of the first step after adoption reads). Before (git
  4f41f5e `HostKV.ensure`): a list read (each page verified), `np.stack` into one array, a CPU
  `index_put` into the host tier. After: `ServiceSource.read_into` — the shards copy each page into
  its host-tier row and verify the copy there (`PageStore.read_into`);
- **index read**: packed reads of index pages into a buffer (`get_index_packed_async`, groups of
  256 as `load_index`). Before: verify every page, then one `np.stack`; after: copy + verify per page.
The minimum and median over `--repeats` reads are reported (the host is shared: the minimum is the
figure to compare); the bytes are checked equal to the service's. CPU only: the host side.

    python benchmarks/kvcache/profile_adoption_reads.py
"""

import argparse
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

from adopt import git_revision, hardware, merge_results  # noqa: E402

from msaserve.engine.kv.host_tier import HostKV, ServiceSource  # noqa: E402
from msaserve.engine.kv.pages import PageCodec, identity_for  # noqa: E402
from msaserve.kvcache import shard as shard_module  # noqa: E402
from msaserve.kvcache.client import KVCacheClient  # noqa: E402
from msaserve.kvcache.config import ServiceConfig  # noqa: E402
from msaserve.models.presets import get_preset  # noqa: E402


def stack_then_copy(self, store_name, keys, row_bytes, out):
    """`KVCacheShard._get_packed` before: verify every page, then one np.stack of them all."""
    payloads = self._get(store_name, keys)
    ok = [p is not None for p in payloads]
    packed = np.empty((len(keys), row_bytes), dtype=np.uint8) if out is None else None
    np.stack(payloads, out=packed if out is None else out)
    return packed, ok


def timed(fn, cases) -> list[float]:
    times = []
    for case in cases:
        t0 = time.perf_counter()
        fn(case)
        times.append(time.perf_counter() - t0)
    return sorted(times)


def run(args) -> dict:
    config = get_preset("m3-mini", num_hidden_layers=4)
    identity = identity_for(config, "profile-reads", torch.bfloat16)
    codec = PageCodec(identity)
    n = args.pages
    client = KVCacheClient.in_process(ServiceConfig(num_shards=4, memory_bytes=4 * n * codec.kv_bytes,
                                                    index_fraction=0.5), identity)
    rng = np.random.default_rng(0)
    hashes = [int(h) for h in rng.integers(1, 2**62, n)]
    client.put_pages([(h, [rng.integers(0, 255, codec.kv_bytes, dtype=np.uint8)],
                       rng.integers(0, 255, codec.index_bytes, dtype=np.uint8)) for h in hashes])
    host = HostKV(1, n, (config.page_size, config.num_kv_heads, config.head_dim), torch.bfloat16, pin=False)
    source = ServiceSource(client, hashes, "s")

    def miss_before(items):
        kv = codec.decode_kv(client.get_kv([(hashes[p], layer) for p, layer in items]))
        host.data[torch.tensor([layer for _, layer in items]), torch.tensor([p for p, _ in items])] = kv

    def miss_after(items):
        source.read_into(items, host._rows, [p for p, _ in items])

    picks = [[(int(p), 0) for p in np.random.default_rng(s).choice(n, 60, replace=False)]
             for s in range(args.repeats)]
    out = np.zeros((n, codec.index_bytes), np.uint8)
    groups = [list(range(i, min(n, i + 256))) for i in range(0, n, 256)]

    def index_read(_):
        fetches = [client.get_index_packed_async([hashes[p] for p in g], out[g[0] : g[-1] + 1])
                   for g in groups]
        for f in fetches:
            f.result()

    after_packed = shard_module.KVCacheShard._get_packed
    times: dict[str, list[float]] = {}
    for _ in range(2):  # interleaved, twice: the host is shared
        for name, fn, packed in (("miss_before", miss_before, None), ("miss_after", miss_after, None),
                                 ("index_before", index_read, stack_then_copy),
                                 ("index_after", index_read, after_packed)):
            if packed is not None:
                shard_module.KVCacheShard._get_packed = packed
            cases = picks if name.startswith("miss") else range(args.repeats)
            times.setdefault(name, []).extend(timed(fn, cases))
    shard_module.KVCacheShard._get_packed = after_packed
    miss_after(picks[0])
    equal = all(np.array_equal(host._rows[p], client.get_kv([(hashes[p], 0)])[0]) for p, _ in picks[0])
    fetch = client.get_index_packed_async(hashes[:256], out[:256])  # rows are grouped by shard
    fetch.result()
    stored = client.get_index(hashes[:256])
    equal = equal and all(np.array_equal(out[fetch.rows[i]], stored[i]) for i in range(len(stored)))
    return dict(times={k: sorted(v) for k, v in times.items()}, equal=equal, pages=n)


def report(args, r: dict) -> None:
    meta = dict(command="python benchmarks/kvcache/profile_adoption_reads.py " + " ".join(sys.argv[1:]),
                hardware=hardware(torch.device("cpu")), date=datetime.now(UTC).isoformat(timespec="seconds"),
                git_revision=os.environ.get("MSASERVE_GIT_REVISION") or git_revision())
    t, n = r["times"], r["pages"]
    rows = {
        "miss read, 60 K/V pages (15 MiB), ms": ("miss", 1e3, "ms", "adopt_miss_read"),
        f"index read, {n} pages ({n // 8} MiB), us/page": ("index", 1e6 / n, "us", "adopt_index_read"),
    }
    entries = {}
    for label, (kind, scale, unit, key) in rows.items():
        for when in ("before", "after"):
            values = t[f"{kind}_{when}"]
            entries[f"kvcache.{key}_{when}_{unit}_cpu"] = dict(
                value=round(values[0] * scale, 2), unit=unit, **meta,
                note=f"minimum of {len(values)} (median {values[len(values) // 2] * scale:.2f}); bytes "
                f"equal to the service's: {r['equal']}",
                workload=f"m3-mini pages, 4 in-process shards; {label.split(',')[0]}")
    out = merge_results(args.output, entries)
    print(f"results → {out}; bytes equal to the service's: {r['equal']}")
    print(f"{'read':<44}{'before min':>12}{'after min':>12}{'before med':>12}{'after med':>12}")
    for label, (kind, scale, _, _) in rows.items():
        b, a = t[f"{kind}_before"], t[f"{kind}_after"]
        print(f"{label:<44}{b[0] * scale:>12.2f}{a[0] * scale:>12.2f}"
              f"{b[len(b) // 2] * scale:>12.2f}{a[len(a) // 2] * scale:>12.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--output",
                        default=str(ROOT / "benchmarks" / "results" / "kvcache_adoption_profile.json"))
    args = parser.parse_args()
    report(args, run(args))


if __name__ == "__main__":
    main()
