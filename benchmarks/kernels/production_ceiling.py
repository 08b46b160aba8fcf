"""How high `kernels.production_prefill_tflops` can go on a GPU at all: the compute ceiling of MiniMax's
128 production prefill shapes (benchmarks/data/msa_prefill_benchmark_cases_v1.json) at the M3 shape.

The metric divides the file's `useful_flops` (2·128·128·Σ over query rows of floor(position / 128):
one 128-wide head against every earlier full block) by the latency of the indexer + sparse attention.
The work the M3 shape must do per query row at position p is larger than that:
- indexer: 4 index query heads (one index key head, 4 query heads per key head) · (p + 1) causal keys
  · 128 · 2 FLOPs;
- sparse attention: 64 heads · the keys of its min(16, p // 128 + 1) selected blocks (128 each, the
  query's own block only up to p) · 128 · 4 FLOPs (QKᵀ and PV).
So even at the GPU's peak matrix rate every case has a latency floor of (indexer + attention FLOPs) /
peak, and the aggregate over the representative cases (Σ w·useful / Σ w·floor, the benchmark's own
rule and lengths, msa_production.case_lengths) is the most the metric can show on that GPU. The top-k
and every byte read are left out: the real ceiling is lower still.

    python benchmarks/kernels/production_ceiling.py [--peak-tflops 989.4] [--gemm-tflops 789.6]
        [--measured-tflops 14.73] [--out benchmarks/results]

--gemm-tflops: the bf16 GEMM rate measured on the same H200 (`bench_msa.py`'s ceiling, 789.6 in the
f686f7e run that measured the production figure): the ceiling again at what a GEMM reaches there.

Runs on the CPU in seconds; writes `kernels.production_prefill_ceiling` to DIR/production_ceiling.json
(its own file: bench_msa.py rewrites kernels.json whole).
"""

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from msa_production import DI, HKV, HQ, TOP_K, P, case_lengths, useful_flops

CASES = Path(__file__).resolve().parents[1] / "data" / "msa_prefill_benchmark_cases_v1.json"
INDEX_QUERY_HEADS = HKV  # one index key head; M3's index uses 4 query heads per key head
H200_DENSE_BF16_TFLOPS = 989.4  # NVIDIA's H200 SXM figure for dense BF16 tensor-core math


def real_flops(queries: list[int], finals: list[int]) -> tuple[float, float]:
    """→ (indexer FLOPs, sparse attention FLOPs) the M3 shape must do for these sequences."""
    indexer = attention = 0.0
    for q, f in zip(queries, finals, strict=True):
        pos = np.arange(f - q, f, dtype=np.int64)
        indexer += 2.0 * INDEX_QUERY_HEADS * DI * float((pos + 1).sum())
        blocks = np.minimum(TOP_K, pos // P + 1)
        keys = (blocks - 1) * P + pos % P + 1  # full selected blocks, then the own block up to p
        attention += 4.0 * HQ * 128 * float(keys.sum())
    return indexer, attention


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peak-tflops", type=float, default=H200_DENSE_BF16_TFLOPS)
    parser.add_argument("--gemm-tflops", type=float, default=789.6)
    parser.add_argument("--measured-tflops", type=float, default=None,
                        help="the benchmark's measured aggregate, to print it as a fraction of the ceiling")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    cases = json.loads(CASES.read_text())["cases"]
    rows = []
    for i, case in enumerate(cases):
        queries, finals = case_lengths(case, i)
        idx, att = real_flops(queries, finals)
        useful = useful_flops(queries, finals)
        floor_ms = (idx + att) / (args.peak_tflops * 1e12) * 1e3
        rows.append({"case": case["case_id"][-8:], "batch": len(finals), "total_q": sum(queries),
                     "max_kv": max(finals), "weight": case.get("representative_weight", 0),
                     "useful_flops": useful, "indexer_flops": idx, "attention_flops": att,
                     "floor_ms": floor_ms, "ceiling_tflops": useful / floor_ms / 1e9 if floor_ms else 0.0})
    rep = [r for r in rows if r["weight"]]
    ceiling = (sum(r["weight"] * r["useful_flops"] for r in rep)
               / sum(r["weight"] * r["floor_ms"] for r in rep) / 1e9)
    at_gemm = ceiling * args.gemm_tflops / args.peak_tflops
    revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or "unknown"
    entry = {"value": round(ceiling, 2), "unit": "TFLOP/s (most the production aggregate can show)",
             "target": "context for kernels.production_prefill_tflops (goal 100)",
             "command": "python " + " ".join(sys.argv),
             "hardware": f"arithmetic at {args.peak_tflops} TFLOP/s (H200 dense bf16)",
             "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
             "git_revision": revision,
             "at_measured_gemm_rate": round(at_gemm, 2), "gemm_tflops": args.gemm_tflops,
             "note": "useful_flops of the representative cases over their FLOP floor at the peak rate "
                     "(indexer + sparse attention at the M3 shape; top-k and bytes left out, so the real "
                     "ceiling is lower); lengths by msa_production's rule",
             "table": sorted(rep, key=lambda r: -r["weight"])[:20]}
    path = args.out / "production_ceiling.json"
    path.write_text(json.dumps({"kernels.production_prefill_ceiling": entry}, indent=1) + "\n")
    print(f"{'case':>10} {'batch':>6} {'total_q':>8} {'max_kv':>8} {'weight':>7} {'useful/real':>12} "
          f"{'floor_ms':>9} {'ceiling TFLOP/s':>16}")
    for r in entry["table"]:
        ratio = r["useful_flops"] / (r["indexer_flops"] + r["attention_flops"])
        print(f"{r['case']:>10} {r['batch']:>6} {r['total_q']:>8} {r['max_kv']:>8} {r['weight']:>7} "
              f"{ratio:>12.3f} {r['floor_ms']:>9.4f} {r['ceiling_tflops']:>16.1f}")
    line = (f"\naggregate ceiling at {args.peak_tflops} TFLOP/s: {ceiling:.1f} TFLOP/s (goal 100); at the "
            f"measured GEMM rate {args.gemm_tflops}: {at_gemm:.1f}")
    if args.measured_tflops:
        line += f"; measured {args.measured_tflops} = {args.measured_tflops / ceiling:.2f} of it"
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
