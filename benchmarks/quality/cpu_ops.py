"""One SmolLM2-135M layer's MSA ops on the CPU, on real inputs: naive (the spec) vs the `msa`
backend's CPU ops vs dense SDPA, process CPU seconds (median of 3).

The inputs are captured from a forward pass over the first L tokens of the text (the ops of layer
`--layer` record their arguments; every layer attends densely so the capture is cheap); the
indexer is timed on the full window, the attention with the selection the indexer made.

Run: .venv/bin/python benchmarks/quality/cpu_ops.py [--length 8192] [--layer 14]
Writes benchmarks/results/quality_cpu_ops.json (`quality.cpu_op_*` entries); prints a table last.
"""

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from quality import git_revision, hardware  # noqa: E402
from reference_decode import SequenceState, step_metadata  # noqa: E402

from msaserve.kernels.dispatch import get_ops, load_op  # noqa: E402
from msaserve.models.loader import load_model  # noqa: E402


def capture(ids: list[int], layer: int) -> dict[str, tuple]:
    """The indexer's and the sparse attention's arguments at `layer` during one forward."""
    loaded = load_model("smollm2", attention_backend="msa", progress=False)
    ops, dense = get_ops("msa"), get_ops("dense")
    seen: dict[str, tuple] = {}
    count = {"layer": 0}

    def indexer(*args, **kwargs):
        if count["layer"] == layer:
            seen["indexer"] = (args, kwargs)
            return ops.indexer_prefill(*args, **kwargs)
        return torch.zeros(args[0].shape[0], args[0].shape[1], args[5], dtype=torch.int32)

    def sparse(q, k_cache, v_cache, tables, lens, cu, selected):
        if count["layer"] == layer:
            seen["sparse"] = ((q, k_cache, v_cache, tables, lens, cu, selected), {})
        count["layer"] += 1
        return dense.dense_prefill(q, k_cache, v_cache, tables, lens, cu)

    state = SequenceState(loaded.model, len(ids))
    meta = step_metadata(0, len(ids), state.max_pages, loaded.config.page_size, False, torch.device("cpu"))
    loaded.model(torch.tensor(ids), meta, state.caches, ops=replace(ops, indexer_prefill=indexer,
                                                                     sparse_prefill=sparse))
    return seen


def cpu_seconds(fn, args, kwargs, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn(*args, **kwargs)
        times.append(time.process_time() - start)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--text", default=str(ROOT / "benchmarks/data/quality_eval_text.txt"))
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--layer", type=int, default=14)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch / OpenMP threads (1: CPU seconds without OpenMP spin-waits)")
    parser.add_argument("--no-naive", action="store_true", help="skip the (slow) naive spec ops")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/quality_cpu_ops.json"))
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    torch.set_num_threads(args.threads)
    host = hardware()
    tokenizer = load_model("smollm2", attention_backend="dense", progress=False).tokenizer
    ids = tokenizer.encode(Path(args.text).read_text())[: args.length]
    seen = capture(ids, args.layer)
    rows = {}
    for op in ("indexer", "sparse"):
        call_args, kwargs = seen[op]
        name = "indexer_prefill" if op == "indexer" else "sparse_prefill"
        impls = {"cpu": load_op("cpu", name)}
        if not args.no_naive:
            impls = {"naive": load_op("naive", name), **impls}
        if op == "sparse":
            impls["dense_sdpa"] = lambda *a: load_op("sdpa", "dense", "dense_prefill")(*a[:6])
        rows[op] = {impl: cpu_seconds(fn, call_args, kwargs, args.repeats) for impl, fn in impls.items()}
        print(f"{op}: {rows[op]}", file=sys.stderr)
    meta = {"command": "python " + " ".join(sys.argv), "hardware": host,
            "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), "git_revision": git_revision()}
    tag = f"{args.length // 1024}k"
    entries = {f"quality.cpu_op_{op}_{impl}_{tag}_s": {
        "value": round(seconds, 4), "unit": "s", "note": f"process CPU seconds, {args.threads} thread(s), "
        f"layer {args.layer}, median of {args.repeats}", **meta}
        for op, row in rows.items() for impl, seconds in row.items()}
    out = Path(args.out)
    old = json.loads(out.read_text()) if out.is_file() else {}
    out.write_text(json.dumps({**old, **entries}, indent=2) + "\n")
    print(f"\nSmolLM2-135M layer {args.layer}, L={args.length}, process CPU seconds; {host}")
    print(f"{'op':<10} {'naive':>8} {'cpu':>8} {'dense SDPA':>11}")
    for op, row in rows.items():
        dense = f"{row['dense_sdpa']:>11.3f}" if "dense_sdpa" in row else f"{'':>11}"
        naive = f"{row['naive']:>8.3f}" if "naive" in row else f"{'-':>8}"
        print(f"{op:<10} {naive} {row['cpu']:>8.3f} {dense}")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
