"""The prefill indexer's tile kernel in three forms on the same inputs (GPU): the top-K insertion gate
off and on, and tiles of 256 rows instead of 128.

    python benchmarks/kernels/ab_indexer_prefill_tiles.py --out benchmarks/results --git-revision REV

The tile kernel (`indexer_prefill/triton.py`) folds every page's block maxima into a running top-K
per row. With the gate, a page whose scores beat no row's worst entry skips the insertion (one
comparison and a tile-wide any() instead of the insertion's six passes over [rows, K]). A tile of
128 rows (32 queries × 4 heads) does 128 FLOPs per byte of bf16 key page it reads, half of what the
GEMM rate needs from HBM (≈ 260 on an H100, ≈ 190 on an H200) when L2 does not serve the re-reads;
256 rows double it. Selections must be identical in all three. Inputs are bench_msa.py's (M3 index
shape: Hkv=4 query heads, HkI=1, DI=128, P=128, K=16, n_init=1, bf16; 16K-token chunks, queries
drawn per 128-token tile plus noise). Cases: every chunk of a 128K prefill, and the first, middle
and last chunk of a 1M prefill (`--all-1m`: all 64). The forms alternate over `--rounds` rounds;
each time is the median of its rounds. Prints a table last and writes indexer_prefill_ab.json.
"""

import datetime
import json
import shlex
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from msa_baselines import bench_parser, gemm_tflops, index_keys, index_queries, indexer_causal_flops, time_ms

from msaserve.kernels.indexer_prefill import triton as prefill

P, HKV, HKI, DI, TOP_K, N_INIT, N_LOCAL, CHUNK = 128, 4, 1, 128, 16, 1, 1, 16384


# name → _launch options; the first is the baseline (the kernel before the gate).
FORMS = {"base": dict(gate=False, block_rows=128), "gate": dict(gate=True, block_rows=128),
         "gate_256": dict(gate=True, block_rows=256)}


def chunk_case(cache: torch.Tensor, tables: torch.Tensor, start: int, rounds: int) -> dict:
    cu = torch.tensor([0, CHUNK], dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor([start + CHUNK], dtype=torch.int32, device="cuda")
    q_index = index_queries(CHUNK, start, P, HKV, DI)

    def run(form: str) -> torch.Tensor:
        return prefill._launch(q_index, cache, None, tables, seq_lens, cu, TOP_K, N_INIT, N_LOCAL,
                               **FORMS[form])

    row: dict = {"start": start, "flops": indexer_causal_flops(start, CHUNK, P, HKV, DI)}
    reference = run("base")
    forms = []
    for form in FORMS:
        try:
            row[f"{form}_same_selection"] = torch.equal(run(form), reference)
            forms.append(form)
        except Exception as exc:  # e.g. out of shared memory or registers at 256 rows
            row[f"{form}_error"] = repr(exc)[:300]
    times: dict[str, list[float]] = {form: [] for form in forms}
    for r in range(rounds):
        for form in (forms if r % 2 == 0 else forms[::-1]):
            times[form].append(time_ms(lambda f=form: run(f), reps=5, warmup=1))
    for form in forms:
        row[f"{form}_ms"] = statistics.median(times[form])
        row[f"{form}_rounds_ms"] = times[form]
        row[f"{form}_tflops"] = row["flops"] / row[f"{form}_ms"] / 1e9
    return row


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
    totals = {}
    for context in (131072, one_m):
        part = [r for r in rows if r["context"] == context]
        for form in FORMS:
            if all(f"{form}_ms" in r for r in part):
                totals[f"{context}_{form}_ms"] = sum(r[f"{form}_ms"] for r in part)
    doc = {
        "command": "python benchmarks/kernels/ab_indexer_prefill_tiles.py " + shlex.join(sys.argv[1:]),
        "hardware": torch.cuda.get_device_name(), "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "git_revision": args.git_revision, "gemm_tflops": gemm, "forms": FORMS, "totals_ms": totals,
        "all_same_selection": all(v for r in rows for k, v in r.items() if k.endswith("_same_selection")),
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "indexer_prefill_ab.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{doc['hardware']}, bf16 GEMM {gemm:.0f} TFLOP/s; median of {args.rounds} alternated rounds; "
          f"selections identical: {doc['all_same_selection']}")
    print(f"{'context':>8} {'chunk at':>9} " + " ".join(f"{form + ' ms':>12} {'TF/s':>6}" for form in FORMS))
    for r in rows:
        nan = float("nan")
        cells = " ".join(f"{r.get(f'{form}_ms', nan):>12.3f} {r.get(f'{form}_tflops', nan):>6.0f}"
                         for form in FORMS)
        print(f"{r['context']:>8} {r['start']:>9} {cells}")
        for form in FORMS:
            if f"{form}_error" in r:
                print(f"  {form}: {r[f'{form}_error']}")
    for key, ms in totals.items():
        print(f"total {key}: {ms:.2f}")


if __name__ == "__main__":
    main()
