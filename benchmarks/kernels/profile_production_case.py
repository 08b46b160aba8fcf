"""Where a small production prefill case's time goes (a diagnostic for docs/performance-kernels.md).

`kernels.production_prefill_tflops` times each MiniMax case's indexer and sparse attention as single
event-timed calls (msa_production.py). Its heaviest short cases (171–338 query tokens over 55K–75K of
KV) take milliseconds while their FLOPs take microseconds. For the named cases this times each op
three ways — as the benchmark does, replayed as a CUDA graph (no host launch time), and the host time
of one call — and lists the kernels and host ops of one call under torch.profiler. Prints, writes
nothing.

    python benchmarks/kernels/profile_production_case.py [--cases 9467c4ec ee6aa442 d1ee5648]
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from msa_baselines import index_keys, index_queries, time_graph_ms, time_ms
from msa_production import BF16, DI, HKI, HKV, HQ, N_INIT, TOP_K, D, P, case_lengths

from msaserve.kernels.dispatch import get_ops
from msaserve.kernels.indexer_prefill.triton import choose_path

CASES = Path(__file__).resolve().parents[1] / "data" / "msa_prefill_benchmark_cases_v1.json"


def host_ms(fn, reps: int = 5) -> float:
    """Wall time of one call on the host (the launch work), the device idle before it."""
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    torch.cuda.synchronize()
    return best * 1e3


def profile_table(fn) -> None:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = sorted((e for e in events if e.device_type.name == "CUDA"),
                     key=lambda e: -e.self_device_time_total)
    print("    kernels (µs, count):")
    for e in kernels[:12]:
        print(f"      {e.self_device_time_total:9.1f} {e.count:4d}  {e.key[:90]}")
    host = sorted((e for e in events if e.device_type.name == "CPU"), key=lambda e: -e.self_cpu_time_total)
    print("    host ops (self µs, count):")
    for e in host[:12]:
        print(f"      {e.self_cpu_time_total:9.1f} {e.count:4d}  {e.key[:90]}")


def one_case(ops, case: dict, index: int) -> None:
    queries, finals = case_lengths(case, index)
    pages = [(f + P - 1) // P for f in finals]
    k_cache = torch.randn(sum(pages) + 1, P, HKV, D, device="cuda", dtype=BF16)
    v_cache, index_cache = torch.randn_like(k_cache), index_keys(sum(pages) + 1, P, HKI, DI)
    tables = torch.full((len(finals), max(pages)), -1, dtype=torch.int32, device="cuda")
    offset = 0
    for b, n in enumerate(pages):
        tables[b, :n] = torch.arange(offset, offset + n, device="cuda", dtype=torch.int32)
        offset += n
    seq_lens = torch.tensor(finals, dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(queries), HQ, D, device="cuda", dtype=BF16)
    q_index = torch.cat([index_queries(n, f - n, P, HKV, DI)
                         for n, f in zip(queries, finals, strict=True)])
    selected = ops.indexer_prefill(q_index, index_cache, tables, seq_lens, cu, TOP_K, N_INIT)
    calls = {
        f"indexer {path}": lambda path=path: ops.indexer_prefill(q_index, index_cache, tables, seq_lens, cu,
                                                                 TOP_K, N_INIT, path=path)
        for path in ("tiles", "groups")
    }
    same = torch.equal(calls["indexer tiles"]().sort(-1).values, calls["indexer groups"]().sort(-1).values)
    print(f"  indexer paths select the same blocks: {same}")
    calls["sparse"] = lambda: ops.sparse_prefill(q, k_cache, v_cache, tables, seq_lens, cu, selected)
    print(f"\ncase {case['case_id'][-8:]}: batch {len(finals)}, {sum(queries)} queries, KV {max(finals)}")
    for name, fn in calls.items():
        event = time_ms(fn, reps=3, warmup=1)
        try:
            graph = f"{time_graph_ms(fn):.4f} ms"
        except RuntimeError as error:  # an op that cannot be captured is a finding, not the end
            graph = f"not capturable ({str(error)[:80]})"
            torch.cuda.synchronize()
        print(f"  {name}: as the benchmark times it {event:.3f} ms; CUDA graph {graph}; "
              f"host time of one call {host_ms(fn):.3f} ms")
        profile_table(fn)


def sweep(ops) -> None:
    """Both indexer paths, graph-replayed, for one sequence: chunks of 64 … 8192 queries at the end of
    64K and 128K tokens (where the short-chunk path stops paying)."""
    print("\nindexer paths by chunk size (ms, CUDA graph):")
    print(f"{'kv':>8} {'queries':>8} {'tiles':>9} {'groups':>9} {'auto':>7}")
    for kv in (65536, 131072):
        pages = kv // P
        index_cache = index_keys(pages + 1, P, HKI, DI)
        tables = torch.arange(pages, device="cuda", dtype=torch.int32)[None]
        seq_lens = torch.tensor([kv], dtype=torch.int32, device="cuda")
        for n in (64, 171, 512, 1024, 2048, 4096, 8192):
            cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
            q_index = index_queries(n, kv - n, P, HKV, DI)
            args = (q_index, index_cache, tables, seq_lens, cu, TOP_K, N_INIT)
            times = {path: time_graph_ms(lambda path=path, args=args: ops.indexer_prefill(*args, path=path))
                     for path in ("tiles", "groups")}
            auto = choose_path(n, 1, HKI, HKV, P, DI, q_index.device)
            print(f"{kv:>8} {n:>8} {times['tiles']:>9.4f} {times['groups']:>9.4f} {auto:>7}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=["9467c4ec", "ee6aa442", "d1ee5648"])
    parser.add_argument("--no-sweep", action="store_true")
    args = parser.parse_args()
    ops = get_ops("triton", "cuda")
    if not args.no_sweep:
        sweep(ops)
    cases = json.loads(CASES.read_text())["cases"]
    for index, case in enumerate(cases):
        if case["case_id"][-8:] in args.cases:
            one_case(ops, case, index)
    return 0


if __name__ == "__main__":
    sys.exit(main())
