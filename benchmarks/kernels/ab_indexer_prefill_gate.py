"""The prefill indexer's top-K insertion gate, on against off, on the same inputs (GPU).

    python benchmarks/kernels/ab_indexer_prefill_gate.py --out benchmarks/results --git-revision REV

The tile kernel (`indexer_prefill/triton.py`) folds every page's block maxima into a running top-K
per row. With the gate, a page whose scores beat no row's worst entry skips the insertion (one
comparison and a tile-wide any() instead of the insertion's six passes over [rows, K]); the
selections are the same. Inputs are bench_msa.py's (M3 index shape: Hkv=4 query heads, HkI=1,
DI=128, P=128, K=16, n_init=1, bf16; 16K-token chunks, queries drawn per 128-token tile plus noise).
Cases: every chunk of a 128K prefill, and chunks of a 1M prefill (the first, middle and last, each
timed alone; `--all-1m` times all 64). The two kernels alternate over `--rounds` rounds; each time is
the median of its rounds; selections are compared exactly. Prints a table last and writes
indexer_prefill_gate.json.
"""

import datetime
import json
import shlex
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from msa_baselines import bench_parser, gemm_tflops, index_keys, index_queries, time_ms

from msaserve.kernels.indexer_prefill import triton as prefill

P, HKV, HKI, DI, TOP_K, N_INIT, N_LOCAL, CHUNK = 128, 4, 1, 128, 16, 1, 1, 16384


def indexer_flops(first: int, count: int) -> float:
    """q·k FLOPs of `count` queries from position `first`: each scans the keys of its blocks up to its own."""
    positions = torch.arange(first, first + count, dtype=torch.float64)
    keys = (torch.div(positions, P, rounding_mode="floor") + 1) * P
    return float(keys.sum()) * HKV * DI * 2


def chunk_case(cache: torch.Tensor, tables: torch.Tensor, start: int, rounds: int) -> dict:
    cu = torch.tensor([0, CHUNK], dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor([start + CHUNK], dtype=torch.int32, device="cuda")
    q_index = index_queries(CHUNK, start, P, HKV, DI)

    def run(gate: bool) -> torch.Tensor:
        return prefill._launch(q_index, cache, None, tables, seq_lens, cu, TOP_K, N_INIT, N_LOCAL, gate=gate)

    same = torch.equal(run(True), run(False))
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(rounds):
        for gate in ((True, False) if r % 2 == 0 else (False, True)):
            times[gate].append(time_ms(lambda g=gate: run(g), reps=5, warmup=1))
    on, off = statistics.median(times[True]), statistics.median(times[False])
    return {"start": start, "gate_ms": on, "no_gate_ms": off, "speedup": off / on, "same_selection": same,
            "flops": indexer_flops(start, CHUNK), "gate_rounds_ms": times[True],
            "no_gate_rounds_ms": times[False]}


def prefill_cases(context: int, starts: list[int], rounds: int) -> list[dict]:
    num_pages = context // P
    tables = torch.randperm(num_pages, device="cuda").to(torch.int32)[None]
    cache = index_keys(num_pages, P, HKI, DI)
    rows = [chunk_case(cache, tables, s, rounds) | {"context": context} for s in starts]
    del cache
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--all-1m", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    gemm = gemm_tflops()
    one_m = 1 << 20
    starts_1m = list(range(0, one_m, CHUNK)) if args.all_1m else [0, one_m // 2 - CHUNK, one_m - CHUNK]
    rows = prefill_cases(131072, list(range(0, 131072, CHUNK)), args.rounds)
    rows += prefill_cases(one_m, starts_1m, args.rounds)
    for row in rows:
        row["gate_tflops"] = row["flops"] / row["gate_ms"] / 1e9
        row["no_gate_tflops"] = row["flops"] / row["no_gate_ms"] / 1e9
    whole = [r for r in rows if r["context"] == 131072]
    on, off = sum(r["gate_ms"] for r in whole), sum(r["no_gate_ms"] for r in whole)
    doc = {
        "command": "python benchmarks/kernels/ab_indexer_prefill_gate.py " + shlex.join(sys.argv[1:]),
        "hardware": torch.cuda.get_device_name(), "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "git_revision": args.git_revision, "gemm_tflops": gemm,
        "indexer_128k_gate_ms": on, "indexer_128k_no_gate_ms": off, "indexer_128k_speedup": off / on,
        "all_same_selection": all(r["same_selection"] for r in rows), "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "indexer_prefill_gate.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{doc['hardware']}, bf16 GEMM {gemm:.0f} TFLOP/s; median of {args.rounds} alternated rounds")
    print(f"{'context':>8} {'chunk at':>9} {'gate ms':>8} {'off ms':>8} {'speedup':>8} {'gate TF/s':>10} "
          f"{'off TF/s':>9} {'same':>5}")
    for r in rows:
        print(f"{r['context']:>8} {r['start']:>9} {r['gate_ms']:>8.3f} {r['no_gate_ms']:>8.3f} "
              f"{r['speedup']:>8.3f} {r['gate_tflops']:>10.1f} {r['no_gate_tflops']:>9.1f} "
              f"{r['same_selection']!s:>5}")
    print(f"128K, all 8 chunks: {on:.2f} ms with the gate, {off:.2f} without ({off / on:.3f}x)")


if __name__ == "__main__":
    main()
