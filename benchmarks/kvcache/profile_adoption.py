"""Where a sparse-resident adoption's first token goes, without the model: the data movement only.

m3-mini's page shapes (P 128, Hkv 4, D 128, index 1 × 128, bf16: K/V pages of 256 KiB per layer,
index pages of 128 KiB with 4 layers), a session of `--pages` pages persisted to in-process KV cache
shards (4), then adopted by `ResidentSession.adopt` (10 % budget, a host tier allocated before, as
a replica keeps it) — each phase timed (`ResidentSession.adopt_phases`) — and its first decode
step's residency work per layer (`make_resident` on a random selection of top-16 pages per KV head,
as a random-weight model makes them: ~all miss, read from the service through the host tier).
The shards keep the index in pinned arenas on CUDA (the index copied to the GPU straight from
there, `engine/kv/direct_index.py`). Median of `--repeats` adoptions, each by a fresh session. The
selected slots' K/V are checked equal to the stored pages'. At 1M tokens (8,192 pages) an H200
adoption measured 195–228 ms for 'caches + index' and 46–49 ms for the first step (git 4195171,
residency.py).

    python benchmarks/kvcache/profile_adoption.py                      # CPU, 512 pages
    python benchmarks/kvcache/profile_adoption.py --device cuda --pages 8192
"""

import argparse
import os
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

from adopt import git_revision, hardware, merge_results  # noqa: E402

from msaserve.engine.kv.host_tier import HostKV  # noqa: E402
from msaserve.engine.kv.pages import identity_for  # noqa: E402
from msaserve.engine.kv.persist import SessionWriter  # noqa: E402
from msaserve.engine.kv.pinned_segments import segment_allocators  # noqa: E402
from msaserve.engine.kv.resident_session import ResidentSession  # noqa: E402
from msaserve.kvcache.client import KVCacheClient  # noqa: E402
from msaserve.kvcache.config import ServiceConfig  # noqa: E402
from msaserve.models.cache import allocate_caches  # noqa: E402
from msaserve.models.presets import get_preset  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def stored_session(config, pages: int, device: torch.device, dtype: torch.dtype):
    """An in-process service holding a session of `pages` full pages of random K/V and index."""
    caches = allocate_caches(config, pages, device, dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    for c in caches:
        for t in (c.k_cache, c.v_cache, c.index_cache):
            t.copy_(torch.randn(t.shape, generator=gen, device=device, dtype=torch.float32))
    identity = identity_for(config, "profile-adoption", dtype)
    kv_bytes = pages * config.num_layers * 2 * config.page_size * config.num_kv_heads * config.head_dim * 2
    # Index pages in pinned arenas on CUDA, as residency.py: adoption copies them straight from there.
    client = KVCacheClient.in_process(ServiceConfig(num_shards=4, memory_bytes=2 * kv_bytes + (64 << 20)),
                                      identity, segment_allocators=segment_allocators(device))
    gen_tokens = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, 500, (pages * config.page_size + 1,), generator=gen_tokens)
    SessionWriter(client, "s").sync(tokens.tolist(), caches, range(pages), pages * config.page_size)
    return client, caches


def first_step(session: ResidentSession, config, pages: int, gen: torch.Generator) -> list[float]:
    """Each layer's residency work of one decode step on a random selection → seconds per layer."""
    times = []
    for layer in range(config.num_layers):
        picks = torch.stack([torch.randperm(pages, generator=gen)[: config.top_k]
                             for _ in range(config.num_kv_heads)])
        selected = picks[None, None].to(session.device, torch.int32)
        sync(session.device)
        t0 = time.perf_counter()
        session.make_resident(layer, selected)
        sync(session.device)
        times.append(time.perf_counter() - t0)
    return times


def check(session: ResidentSession, caches, layer: int) -> bool:
    """Every resident page's slot holds the stored page's K/V (per head: each KV head's working set
    is a row of its own, `layer * heads + head`, and its column of a slot is [P, D] of that head)."""
    heads = session.heads if session.per_head else 1
    for h in range(heads):
        row = layer * heads + h
        table = session.working.table(row)[0]
        for page in session.working.resident_pages(row):
            slot = int(table[page])
            if page >= caches[layer].k_cache.shape[0]:
                continue  # the write page (ring)
            pool = session.pools[layer]
            for kv, stored in ((0, caches[layer].k_cache[page]), (1, caches[layer].v_cache[page])):
                got = pool[slot, kv, h] if session.per_head else pool[slot, kv]
                if not torch.equal(got, stored[:, h] if session.per_head else stored):
                    return False
    return True


def run(args) -> dict:
    device = torch.device(args.device)
    dtype = torch.bfloat16
    config = get_preset("m3-mini", num_hidden_layers=args.num_layers)
    client, caches = stored_session(config, args.pages, device, dtype)
    max_pages = args.pages + 2
    budget = max(2 + config.num_kv_heads * config.top_k, round(0.1 * args.pages))
    page_shape = (config.page_size, config.num_kv_heads, config.head_dim)
    host = HostKV(config.num_layers, max_pages, page_shape, dtype, pin=device.type == "cuda")
    gen = torch.Generator().manual_seed(2)
    rows, ok, session = [], True, None
    for _ in range(args.repeats + 1):  # the first is a warm-up
        sync(device)
        t0 = time.perf_counter()
        into = session if args.into else None  # the last adoption's object (ResidentSession.adopt(into=))
        session, covered = ResidentSession.adopt(client, client.get_session_head("s"), config, budget,
                                                 max_pages, device, dtype, host=host, into=into)
        sync(device)
        adopt_s = time.perf_counter() - t0
        assert covered == args.pages * config.page_size, covered
        step = first_step(session, config, args.pages, gen)
        ok = ok and all(check(session, caches, layer) for layer in range(config.num_layers))
        rows.append(dict(adopt_s=adopt_s, step_s=sum(step), **session.adopt_phases))
        if not args.into:
            session = None
    rows = rows[1:]
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    return dict(config=config, device=device, median=med, checked=ok, budget=budget)


def report(args, r: dict) -> None:
    m, n = r["median"], args.pages
    meta = dict(command="python benchmarks/kvcache/profile_adoption.py " + " ".join(sys.argv[1:]),
                hardware=hardware(r["device"]), date=datetime.now(UTC).isoformat(timespec="seconds"),
                git_revision=os.environ.get("MSASERVE_GIT_REVISION") or git_revision(),
                workload=f"m3-mini page shapes, {r['config'].num_layers} layers, {n} pages, 4 in-process "
                f"shards, budget {r['budget']} pages, median of {args.repeats}"
                f"{', each into the last session object' if args.into else ''}")
    suffix = ("cpu" if r["device"].type == "cpu" else "gpu") + ("_into" if args.into else "")
    entries = {
        f"kvcache.adopt_index_us_per_page_{suffix}": dict(value=round(m["index_s"] / n * 1e6, 2), unit="us"),
        f"kvcache.adopt_first_step_residency_ms_{suffix}": dict(
            value=round(m["step_s"] * 1e3, 3), unit="ms",
            note=f"{r['config'].num_layers} layers, top-{r['config'].top_k} × Hkv random pages each, read "
            f"from the service; slots checked equal to the stored pages: {r['checked']}"),
    }
    for entry in entries.values():
        entry.update(meta)
    out = merge_results(args.output, entries)
    print(f"\n{meta['workload']}; results → {out}")
    print(f"first step's slots equal to the stored pages: {r['checked']}")
    print(f"{'phase':<34}{'ms':>10}{'us/page':>10}")
    for key in ("host_reset_s", "allocate_s", "index_s", "adopt_s", "step_s"):
        print(f"{key.removesuffix('_s'):<34}{m[key] * 1e3:>10.2f}{m[key] / n * 1e6:>10.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--pages", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--into", action="store_true",
                        help="each adoption into the last one's session object (its device memory reused)")
    parser.add_argument("--output",
                        default=str(ROOT / "benchmarks" / "results" / "kvcache_adoption_profile.json"))
    args = parser.parse_args()
    report(args, run(args))


if __name__ == "__main__":
    main()
