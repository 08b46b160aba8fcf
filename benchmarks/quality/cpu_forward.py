"""CPU forward-pass time of SmolLM2-135M-Instruct, dense (SDPA) vs MSA (the `msa` backend's CPU
ops: C-kernel indexer scores + sparse attention), at several context lengths, on real text.

Dense is the source model (GGUF) under the dense backend; MSA is `--checkpoint` (what `msaserve
convert` wrote: calibrated index, its dense layers) under the msa backend, or the training-free
conversion. Both run with the same torch / OpenMP thread count (--threads) and with their
projections fused as the engine runs them. The headline ratio is wall seconds — what a user feels
on an idle machine at that thread count; the machine is shared, so dense and MSA are timed
interleaved (dense, MSA, dense, MSA, ...) and each side's fastest run is taken (other users' load
only ever adds time). Process CPU seconds are recorded beside. Each forward is one prefill of the
whole window into a fresh cache, last-token logits.

Run: .venv/bin/python benchmarks/quality/cpu_forward.py [--checkpoint OUT] [--lengths 4096 8192]
     [--repeats 3] [--threads 2]
Writes benchmarks/results/quality_cpu_forward.json (`quality.cpu_*` entries); prints a table last.
"""

import argparse
import json
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from quality import git_revision, hardware  # noqa: E402
from reference_decode import SequenceState  # noqa: E402

from msaserve.models.loader import load_model  # noqa: E402
from msaserve.models.transformer import MSATransformer  # noqa: E402

BACKENDS = ("dense", "msa")


def time_forward(model: MSATransformer, ids: list[int]) -> tuple[float, float]:
    """(wall s, process CPU s) of one forward over `ids` into a fresh cache, last-token logits."""
    state = SequenceState(model, len(ids))
    wall, cpu = time.perf_counter(), time.process_time()
    hidden = state.forward(ids, 0)
    model.compute_logits(hidden[-1:])
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--text", default=str(ROOT / "benchmarks/data/quality_eval_text.txt"))
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch / OpenMP threads, both sides (default: torch's)")
    parser.add_argument("--checkpoint", default="smollm2",
                        help="the MSA side: a directory `msaserve convert` wrote, or smollm2 (training-free)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/quality_cpu_forward.json"))
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    torch.set_num_threads(args.threads)
    host = hardware()
    models = {"dense": load_model("smollm2", attention_backend="dense", progress=False),
              "msa": load_model(args.checkpoint, attention_backend="msa", progress=False)}
    for loaded in models.values():
        loaded.model.fuse_projections()  # as the engine's ModelRunner does
    ids = models["dense"].tokenizer.encode(Path(args.text).read_text())
    meta = {"command": "python " + " ".join(sys.argv), "hardware": host,
            "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), "git_revision": git_revision(),
            "msa_model": _describe(args.checkpoint, models["msa"].config)}
    rows: dict[int, dict[str, tuple[float, float]]] = {}
    with torch.inference_mode():
        for backend in BACKENDS:  # warm-up: first calls allocate, build the C kernels
            time_forward(models[backend].model, ids[:2048])
        for length in args.lengths:
            window = ids[:length]
            runs: dict[str, list[tuple[float, float]]] = {b: [] for b in BACKENDS}
            for _ in range(args.repeats):
                for backend in BACKENDS:
                    runs[backend].append(time_forward(models[backend].model, window))
                    print(f"L={length} {backend}: {runs[backend][-1]}", file=sys.stderr, flush=True)
            rows[length] = {b: (min(w for w, _ in r), statistics.median(c for _, c in r))
                            for b, r in runs.items()}
            write_results(Path(args.out), rows, args.repeats, meta)
    print_table(rows, args.repeats, host)
    print(f"\nwrote {args.out}")
    return 0


def _describe(checkpoint: str, config) -> str:
    dense = f", dense layers {list(config.dense_layers)}" if config.dense_layers else ""
    return (f"{checkpoint}: index {config.index_source}, P={config.page_size} K={config.top_k} "
            f"n_init={config.n_init} n_local={config.n_local}{dense}")


def write_results(out: Path, rows: dict, repeats: int, meta: dict) -> None:
    entries = {}
    for length, row in rows.items():
        tag = f"{length // 1024}k"
        note = f"{repeats} interleaved runs per side"
        for backend in BACKENDS:
            entries[f"quality.cpu_forward_{backend}_{tag}_s"] = {
                "value": round(row[backend][0], 3), "unit": "s", "note": f"wall, fastest of {note}", **meta}
        entries[f"quality.cpu_msa_over_dense_forward_{tag}"] = {
            "value": round(row["msa"][0] / row["dense"][0], 4), "unit": "ratio",
            "note": f"wall seconds at the same thread count, fastest of {note}", **meta}
        entries[f"quality.cpu_msa_over_dense_forward_cpu_time_{tag}"] = {
            "value": round(row["msa"][1] / row["dense"][1], 4), "unit": "ratio",
            "note": f"process CPU seconds (includes OpenMP spin-waits), median of {note}", **meta}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(entries, indent=2) + "\n")


def print_table(rows: dict, repeats: int, host: str) -> None:
    print(f"\nSmolLM2-135M forward pass on the CPU, wall: fastest of {repeats} interleaved runs, "
          f"CPU: median; {host}")
    head = f"{'L':>6} {'dense s':>9} {'MSA s':>9} {'MSA/dense':>10} {'dense cpu-s':>12} {'MSA cpu-s':>10} " \
        f"{'MSA/dense cpu':>14}"
    print(head)
    print("-" * len(head))
    for length, row in rows.items():
        (dw, dc), (mw, mc) = row["dense"], row["msa"]
        print(f"{length:>6} {dw:>9.2f} {mw:>9.2f} {mw / dw:>10.3f} {dc:>12.2f} {mc:>10.2f} {mc / dc:>14.3f}")


if __name__ == "__main__":
    sys.exit(main())
