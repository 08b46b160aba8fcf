"""The decode ops' two small merges, old launch against new (issue 25, the 1M session decode): the
decode indexer's split merge (serial → packed / tree, msaserve/kernels/indexer_decode/merge.py) and
the sparse decode's LSE merge (serial → all parts at once, msaserve/kernels/triton_common.py).

    python benchmarks/kernels/bench_decode_merges.py [--out DIR] [--git-revision REV] [--fp8]
    TRITON_INTERPRET=1 python benchmarks/kernels/bench_decode_merges.py --device cpu --out /tmp/x

M3 shape, one layer: index HkI 1, DI 128, 4 query heads per key head, P 128, top-16; attention
Hq 64, Hkv 4, D 128, bf16; batch 1 / 8 / 32 × context 128K / 1M, one query per sequence. Per case,
each timed as a CUDA graph replayed (median): every split-merge launch on the candidates the score
kernel left, both LSE-merge launches on the partials the sparse decode left, and the whole
`indexer_decode` (bf16 index; fp8 too with --fp8) and `sparse_decode` ops with the old merge and the
new default; and the dense paged decode's LSE merge (same function, its split count) on random
partials of its shapes, since the new launch serves it too. The old and new outputs are compared
(selections exactly, attention within fp32 rounding). Writes DIR/decode_merges.json
(`kernels.decode_merge_latency`, value = both merges at batch 1, 1M tokens with the new launches,
µs; the table beside it) and prints the table last. On `--device cpu` (under TRITON_INTERPRET=1)
tiny shapes run end to end and are timed by the wall clock.
"""

import argparse
import datetime
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from msaserve.kernels.dense.paged_decode import default_num_splits
from msaserve.kernels.indexer_decode import triton as idec
from msaserve.kernels.sparse_decode import triton as sdec
from msaserve.kernels.triton_common import lse_merge

SPLIT_MERGES = ("serial", "packed", "tree", "auto")
GPU = {"batches": (1, 8, 32), "contexts": (131072, 1048576), "P": 128, "DI": 128, "D": 128, "pool": 8192}
CPU = {"batches": (1, 2), "contexts": (1024, 2048), "P": 16, "DI": 32, "D": 32, "pool": 256}
HKI, HKV, HPK, HQ, TOP_K, N_INIT = 1, 4, 4, 64, 16, 1


def timer(device: str) -> Callable[[Callable[[], object]], float]:
    """ms per call: CUDA-graph replays on the GPU (median), the wall clock of one call on the CPU."""
    if device == "cuda":
        from msa_baselines import time_graph_ms

        return time_graph_ms

    def wall_ms(fn: Callable[[], object]) -> float:  # one call: the interpreter is slow
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    return wall_ms


def inputs(batch: int, context: int, shape: dict, device: str, fp8: bool) -> dict:
    """Index keys (bf16, and fp8 with scales if `fp8`) over distinct pages per sequence; a KV pool of
    shape["pool"] pages that the sparse decode's block tables point into at random (it reads only the
    selected pages)."""
    p, pages = shape["P"], context // shape["P"]
    gen = torch.Generator(device).manual_seed(batch * 7 + pages)
    index = torch.randn(batch * pages, p, HKI, shape["DI"], device=device, generator=gen)
    index += torch.randn(batch * pages, 1, HKI, shape["DI"], device=device, generator=gen)  # page topics
    c = {}
    if fp8:
        c["scale"] = index.abs().amax(-1).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
        c["index8"] = (index / c["scale"][..., None]).to(torch.float8_e4m3fn)
    kv_shape = (shape["pool"], p, HKV, shape["D"])
    return c | {
        "index": index.to(torch.bfloat16),
        "seq_lens": torch.full((batch,), context, device=device, dtype=torch.int32),
        "index_tables": torch.randperm(batch * pages, device=device, generator=gen).view(batch, pages).int(),
        "kv_tables": torch.randint(shape["pool"], (batch, pages), device=device, generator=gen).int(),
        "q_index": torch.randn(batch, 1, HKV, shape["DI"], device=device, generator=gen).bfloat16(),
        "q": torch.randn(batch, 1, HQ, shape["D"], device=device, generator=gen).bfloat16(),
        "k_cache": torch.randn(kv_shape, device=device, generator=gen).bfloat16(),
        "v_cache": torch.randn(kv_shape, device=device, generator=gen).bfloat16(),
    }


def captured(module: object, name: str, call: Callable[[], object]) -> tuple:
    """The arguments `call` passes to module.<name> (its real function still runs)."""
    real, seen = getattr(module, name), []

    def spy(*args: object) -> object:
        seen.append(args)
        return real(*args)

    setattr(module, name, spy)
    try:
        call()
    finally:
        setattr(module, name, real)
    return seen[0]


def run_case(batch: int, context: int, shape: dict, device: str, fp8: bool, splits: int | None) -> dict:
    time_ms, c = timer(device), inputs(batch, context, shape, device, fp8)
    row: dict = {"batch": batch, "context": context}

    def indexer(merge: str, index: str = "index") -> torch.Tensor:
        scale = c["scale"] if index == "index8" else None
        return idec.indexer_decode(c["q_index"], c[index], c["index_tables"], c["seq_lens"], TOP_K, N_INIT,
                                   scale, split_merge=merge, num_splits=splits)

    cand_val, cand_id, out, hpk, _ = captured(idec, "merge_splits", lambda: indexer("auto"))
    row["splits"] = cand_val.shape[2]
    outs = {}
    for merge in SPLIT_MERGES:
        outs[merge] = torch.full_like(out, -2)
        row[f"split_{merge}_us"] = 1e3 * time_ms(lambda m=merge: idec.merge_splits(cand_val, cand_id,
                                                                                    outs[m], hpk, m))
    row["selection_equal"] = all(torch.equal(outs["serial"], o) for o in outs.values())
    selected = outs["auto"]

    def attention(merge: str) -> torch.Tensor:
        return sdec.sparse_decode(c["q"], c["k_cache"], c["v_cache"], c["kv_tables"], c["seq_lens"], selected,
                                  merge=merge)

    part_o, part_lse, _, lse_out, _ = captured(sdec, "lse_merge", lambda: attention("auto"))
    row["parts"] = part_o.shape[1]
    merged = {m: torch.empty_like(lse_out) for m in ("serial", "parts")}
    zeros = torch.zeros(part_o.shape[:2], device=device, dtype=torch.int32)  # as the old launch was given
    row["lse_serial_us"] = 1e3 * time_ms(lambda: lse_merge(part_o, part_lse, zeros, merged["serial"],
                                                           "serial"))
    row["lse_parts_us"] = 1e3 * time_ms(lambda: lse_merge(part_o, part_lse, None, merged["parts"],
                                                          "parts"))
    row["lse_max_diff"] = float((merged["serial"].float() - merged["parts"].float()).abs().max())
    row.update(dense_merge(batch, context // shape["P"], shape["D"], device, time_ms))
    for index in ("index", "index8") if fp8 else ("index",):
        tag = "indexer" if index == "index" else "indexer_fp8"
        row[f"{tag}_old_us"] = 1e3 * time_ms(lambda i=index: indexer("serial", i))
        row[f"{tag}_new_us"] = 1e3 * time_ms(lambda i=index: indexer("auto", i))
        row["selection_equal"] &= torch.equal(indexer("serial", index), indexer("auto", index))
    row["sparse_old_us"] = 1e3 * time_ms(lambda: attention("serial"))
    row["sparse_new_us"] = 1e3 * time_ms(lambda: attention("auto"))
    row["attention_max_diff"] = float((attention("serial").float() - attention("auto").float()).abs().max())
    return row


def dense_merge(batch: int, max_pages: int, dim: int, device: str, time_ms: Callable) -> dict:
    """The dense paged decode's merge (same `lse_merge`, its default split count), serial against all
    parts at once, on random partials of its shapes: the new launch serves it too."""
    rows = batch * HKV
    parts = default_num_splits(rows, max_pages, torch.device(device))
    if parts == 1:
        return {"dense_parts": 1}
    part_o = torch.randn(rows, parts, HQ // HKV, dim, device=device)
    part_lse = torch.randn(rows, parts, HQ // HKV, device=device)
    out = torch.empty(batch, HQ, dim, device=device, dtype=torch.bfloat16)
    zeros = torch.zeros(rows, parts, device=device, dtype=torch.int32)
    return {"dense_parts": parts,
            "dense_lse_serial_us": 1e3 * time_ms(lambda: lse_merge(part_o, part_lse, zeros, out, "serial")),
            "dense_lse_parts_us": 1e3 * time_ms(lambda: lse_merge(part_o, part_lse, None, out, "parts"))}


def print_table(rows: list[dict]) -> None:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    print("  ".join(f"{k:>16}" for k in keys))
    for r in rows:
        cells = [f"{r[k]:.2f}" if isinstance(r.get(k), float) and k.endswith("_us") else str(r.get(k, ""))
                 for k in keys]
        print("  ".join(f"{x:>16}" for x in cells))


def git_revision() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write(args: argparse.Namespace, rows: list[dict], hardware: str) -> None:
    head = next((r for r in rows if r["batch"] == rows[0]["batch"] and r["context"] == max(
        x["context"] for x in rows)), rows[-1])
    entry = {"value": round(head["split_auto_us"] + head["lse_parts_us"], 2),
             "old_value": round(head["split_serial_us"] + head["lse_serial_us"], 2),
             "unit": f"us (split merge + LSE merge, batch {head['batch']}, context {head['context']}, "
                     "new launches; old_value: the serial ones), CUDA graph replays",
             "target": "a few us (eager profile at 7e40e27: 23.4 + 16.6 us per layer)",
             "command": "python " + " ".join(sys.argv), "hardware": hardware,
             "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
             "git_revision": args.git_revision or git_revision(), "table": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "decode_merges.json"
    path.write_text(json.dumps({"kernels.decode_merge_latency": entry}, indent=1) + "\n")
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", type=Path, default=None, help="default benchmarks/results on cuda; "
                        "on cpu nothing is written unless given")
    parser.add_argument("--git-revision", default=None)
    parser.add_argument("--fp8", action="store_true", help="also time the whole indexer over fp8 keys")
    parser.add_argument("--batches", default=None, help="comma-separated; default 1,8,32 (cpu: 1,2)")
    parser.add_argument("--contexts", default=None, help="comma-separated; default 131072,1048576 "
                        "(cpu: 1024,2048)")
    args = parser.parse_args()
    shape = GPU if args.device == "cuda" else CPU
    batches = [int(b) for b in args.batches.split(",")] if args.batches else shape["batches"]
    contexts = [int(n) for n in args.contexts.split(",")] if args.contexts else shape["contexts"]
    # On the CPU (8 "SMs") the default gives ≤ 16 splits: force 40 so the tree runs too.
    splits = None if args.device == "cuda" else 40
    started, rows = time.time(), []
    for context in contexts:
        for batch in batches:
            rows.append(run_case(batch, context, shape, args.device, args.fp8, splits))
            print(json.dumps(rows[-1]), flush=True)
            if args.device == "cuda":
                torch.cuda.empty_cache()
    ok = all(r["selection_equal"] for r in rows)
    print(f"\n{time.time() - started:.0f} s; old and new selections {'identical' if ok else 'DIFFER'}; "
          f"largest |old - new| attention difference {max(r['attention_max_diff'] for r in rows):.3g}")
    hardware = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (TRITON_INTERPRET=1)"
    out = args.out or (Path("benchmarks/results") if args.device == "cuda" else None)
    if out is not None:
        args.out = out
        write(args, rows, hardware)
    print_table(rows)
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
