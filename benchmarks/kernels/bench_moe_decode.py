"""MoE experts of a decode step: the weight-streaming decode path against the grouped GEMM path.

At batch 1, M3's MoE layer reads top-4 experts' weights (4 × 3 × 6144 × 3072 bf16 = 453 MB); the
grouped GEMM path (sort, gather, two CUTLASS grouped GEMMs, combine) measured 0.19 ms per layer in
the 1M-session profile (2.4 TB/s). `moe/triton.py::decode_experts` streams each slot's expert
weights in two launches. This times both, per token count (1, 2, 4, 8 tokens; top-4 of 128 experts
at M3's widths, bf16), as CUDA graphs of 20 calls (so launch overhead counts as in the engine), and
reports GB/s of distinct expert weights read against the copy bandwidth measured in the same run.
`grouped.DECODE_MAX_SLOTS` is where `grouped.experts` switches: the table shows whether it should move.
Prints a table last; writes benchmarks/results/moe_decode.json (key `kernels.moe_decode_speedup_t1`).

    python benchmarks/kernels/bench_moe_decode.py
"""

import argparse
import os
import statistics
import sys
from datetime import UTC, datetime
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "kvcache"))
sys.path.insert(0, str(ROOT / "benchmarks" / "serving"))

from adopt import git_revision, hardware, merge_results  # noqa: E402
from byte_ceiling import copy_bandwidth_tbps  # noqa: E402

from msaserve.kernels.moe import grouped  # noqa: E402
from msaserve.kernels.moe import triton as moe_triton  # noqa: E402

ALPHA, LIMIT = 1.702, 7.0
CALLS = 20


def graph_time(fn, repeats: int) -> float:
    """Median seconds per call of `fn`, CALLS calls captured in one CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / CALLS)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=6144)
    parser.add_argument("--inter", type=int, default=3072)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "moe_decode.json"))
    args = parser.parse_args()
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    e, h, i = args.experts, args.hidden, args.inter
    gate_up = torch.randn(e, 2 * i, h, device=device, dtype=torch.bfloat16, generator=gen) * 0.02
    down = torch.randn(e, h, i, device=device, dtype=torch.bfloat16, generator=gen) * 0.02
    bandwidth = copy_bandwidth_tbps("cuda")  # the session benchmark's copy figure (4 GiB copy_)
    rows = []
    for tokens in args.tokens:
        x = torch.randn(tokens, h, device=device, dtype=torch.bfloat16, generator=gen)
        logits = torch.randn(tokens, e, device=device, generator=gen)
        weights, ids = grouped.route(logits, None, args.top_k)
        distinct = int(torch.unique(ids).numel())
        weight_bytes = distinct * 3 * h * i * 2
        decode = graph_time(lambda x=x, w=weights, d=ids: moe_triton.decode_experts(
            x, gate_up, down, d, w, ALPHA, LIMIT), args.repeats)
        gemm = graph_time(lambda x=x, w=weights, d=ids: grouped.experts_grouped_gemm(
            x, gate_up, down, d, w, ALPHA, LIMIT), args.repeats)
        a = moe_triton.decode_experts(x, gate_up, down, ids, weights, ALPHA, LIMIT).float()
        b = grouped.experts_grouped_gemm(x, gate_up, down, ids, weights, ALPHA, LIMIT).float()
        rel = float((a - b).norm() / b.norm())
        rows.append(dict(tokens=tokens, slots=tokens * args.top_k, distinct_experts=distinct,
                         weight_mb=weight_bytes / 1e6, decode_ms=decode * 1e3, grouped_gemm_ms=gemm * 1e3,
                         speedup=gemm / decode, decode_tbps=weight_bytes / decode / 1e12,
                         grouped_gemm_tbps=weight_bytes / gemm / 1e12, relative_difference=rel))
    meta = dict(command="python benchmarks/kernels/bench_moe_decode.py " + " ".join(sys.argv[1:]),
                hardware=hardware(device), date=datetime.now(UTC).isoformat(timespec="seconds"),
                git_revision=os.environ.get("MSASERVE_GIT_REVISION") or git_revision())
    shape = f"{e} experts, top-{args.top_k}, hidden {h}, intermediate {i}, bf16; CUDA graphs of {CALLS} calls"
    first = rows[0]
    entries = {
        "kernels.moe_decode_speedup_t1": dict(
            value=round(first["speedup"], 3), unit="x (grouped GEMM path / decode path)",
            note=f"{first['tokens']} token: decode {first['decode_ms']:.4f} ms "
            f"({first['decode_tbps']:.2f} TB/s of expert weights) vs grouped GEMM "
            f"{first['grouped_gemm_ms']:.4f} ms ({first['grouped_gemm_tbps']:.2f} TB/s); copy "
            f"bandwidth {bandwidth:.2f} TB/s; DECODE_MAX_SLOTS {grouped.DECODE_MAX_SLOTS}",
            workload=shape, table=rows, copy_tbps=round(bandwidth, 3), **meta),
    }
    out = merge_results(args.output, entries)
    print(f"\n{shape}; copy {bandwidth:.2f} TB/s; results → {out}")
    print(f"{'tokens':>6}{'slots':>6}{'experts':>8}{'MB':>8}{'decode ms':>11}{'TB/s':>6}{'grouped ms':>11}"
          f"{'TB/s':>6}{'speedup':>8}{'rel diff':>10}")
    for r in rows:
        print(f"{r['tokens']:>6}{r['slots']:>6}{r['distinct_experts']:>8}{r['weight_mb']:>8.0f}"
              f"{r['decode_ms']:>11.4f}{r['decode_tbps']:>6.2f}{r['grouped_gemm_ms']:>11.4f}"
              f"{r['grouped_gemm_tbps']:>6.2f}{r['speedup']:>8.2f}{r['relative_difference']:>10.1e}")


if __name__ == "__main__":
    main()
