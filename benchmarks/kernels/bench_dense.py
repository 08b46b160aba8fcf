"""Every dense attention candidate per shape and mask kind at the M3 shape (Hq 64, Hkv 4, D 128,
bf16), and which one won: the baseline that bench_msa.py's ratios divide by.

    python benchmarks/kernels/bench_dense.py --out DIR [--git-revision REV] [--cases a,b] [--budget-s S]

Cases: full causal 16K / 128K / 256K, a 16K chunk at the end of a 128K and of a 1M KV (lower-right
causal), decode over 1M tokens at batch 1 and 8 (contiguous K/V for the SDPA-style candidates, a
paged cache for the paged flash-decoding kernel). Each candidate: one warm-up call, then the median
of 5 event-timed calls (one call when a call takes over a second); decode shapes replay a CUDA
graph of the call instead (flex and fa4 stay event-timed: dense_baseline.GRAPH_CAPTURED). A
candidate that refuses the shape or whose output differs from the first candidate's (relative
L2 > 2e-2) is listed with its reason. Cases past --budget-s are skipped and listed as such.
Writes DIR/dense_baselines.json.
"""

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dense_baseline import PAGED, attention_flops, best_dense, contiguous_inputs, graph_timer, kv_bytes

from msaserve.kernels.dense.candidates import CANDIDATES, fa4_available
from msaserve.kernels.dense.select import DenseSelector, key_for

HQ, HKV, D = 64, 4, 128
K16, K128, M1 = 16384, 131072, 1 << 20
# name → (batch, q_len, kv_len)
CASES = {
    "causal_16k": (1, K16, K16),
    "causal_128k": (1, K128, K128),
    "chunk_16k_at_128k": (1, K16, K128),
    "chunk_16k_at_1m": (1, K16, M1),
    "decode_1m_b1": (1, 1, M1),
    "decode_1m_b8": (8, 1, M1),
    "causal_256k": (1, 2 * K128, 2 * K128),
}


def run_case(name: str, batch: int, q_len: int, kv_len: int, only: set[str] | None,
             cache: DenseSelector | None = None) -> dict:
    t = contiguous_inputs(batch, HQ, HKV, q_len, kv_len, D)
    started = time.time()
    timer = graph_timer() if q_len <= 16 else None  # decode: graph replays, as the MSA step is timed
    choice = best_dense(t["q"], t["k"], t["v"], paged=q_len == 1, only=only, timer=timer)
    if cache is not None and PAGED not in choice.times_ms:  # the engine's contiguous keys only
        cache.record(key_for(t["q"], t["k"]), choice)
    t.clear()
    torch.cuda.empty_cache()
    best = choice.times_ms[choice.winner]
    row = {"case": name, "batch": batch, "q_len": q_len, "kv_len": kv_len, "winner": choice.winner,
           "best_ms": best, "times_ms": choice.times_ms, "errors": choice.errors,
           "seconds": round(time.time() - started, 1)}
    if q_len == 1:
        row["best_tbps"] = kv_bytes(batch, HKV, kv_len, D) / (best * 1e-3) / 1e12
    else:
        row["best_tflops"] = attention_flops(batch, HQ, q_len, kv_len, D) / (best * 1e-3) / 1e12
    return row


def print_table(rows: list[dict], names: list[str]) -> None:
    print("\n== dense candidates (ms; '-' = refused or not run; * = winner)")
    print(f"{'case':>20} " + " ".join(f"{n:>14}" for n in names) + f" {'winner':>14} {'rate':>12}")
    for r in rows:
        if "skipped" in r:
            print(f"{r['case']:>20} skipped: {r['skipped']}")
            continue
        cells = []
        for n in names:
            ms = r["times_ms"].get(n)
            cells.append("-" if ms is None else f"{ms:.4g}{'*' if n == r['winner'] else ''}")
        rate = f"{r['best_tbps']:.2f} TB/s" if "best_tbps" in r else f"{r['best_tflops']:.0f} TFLOP/s"
        print(f"{r['case']:>20} " + " ".join(f"{c:>14}" for c in cells) + f" {r['winner']:>14} {rate:>12}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--git-revision", default="unknown")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--candidates", default="", help="comma-separated subset (default: all)")
    parser.add_argument("--selector-cache", type=Path, default=None,
                        help="also write the prefill choices where MSASERVE_DENSE_CACHE can point the engine")
    parser.add_argument("--budget-s", type=float, default=1e9, help="skip cases past this many seconds")
    args = parser.parse_args()
    torch.manual_seed(0)
    only = set(args.candidates.split(",")) if args.candidates else None
    cache = DenseSelector(cache_path=args.selector_cache) if args.selector_cache else None
    started, rows = time.time(), []
    for name in args.cases.split(","):
        if time.time() - started > args.budget_s:
            rows.append({"case": name, "skipped": f"past the {args.budget_s:.0f} s budget"})
            continue
        try:
            rows.append(run_case(name, *CASES[name], only, cache))
        except Exception as exc:  # a failed case is reported, the others still run
            rows.append({"case": name, "skipped": f"failed: {exc!r}"[:400]})
            torch.cuda.empty_cache()
        print(json.dumps(rows[-1], default=str), flush=True)
    doc = {"command": "python " + " ".join(sys.argv), "hardware": torch.cuda.get_device_name(),
           "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "git_revision": args.git_revision, "torch": torch.__version__, "fa4_installed": fa4_available(),
           "shape": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D, "dtype": "bfloat16"}, "cases": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dense_baselines.json").write_text(json.dumps(doc, indent=1, default=str))
    print_table(rows, [*CANDIDATES, "paged_triton"])


if __name__ == "__main__":
    main()
