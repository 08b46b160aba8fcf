"""Offline serving benchmark of the replica engine on `m3-mini` (issues 4, 27): MSA against the same
model with every layer full attention served by the fastest dense kernel, in the same run.

Parts (`--part`, one or more; default all but cpu):
  agentic    sessions sharing a 60K-token prefix, turns appending 1–4K tokens, 100–500 output
             tokens, closed-loop at concurrency 1, 8, 32 (`--levels`).
  mooncake   the Mooncake trace (token counts and prefix sharing from its hash_ids), same loop, c = 8.
  prefill    one 128K-token prompt's prefill.
  breakdown  where an agentic decode step and a prefill chunk spend their kernel time (attention,
             indexer, MoE, dense MLP, rest), per backend (`step_breakdown.py`).
  session    one 1M-token session: prefill, 256 decode steps (TPOT), peak HBM; the decode step's
             breakdown and its byte floor (`session.py`, `byte_ceiling.py`).
  cpu        SmolLM2-135M on the CPU: one stream and 8 concurrent streams against transformers.

The traffic parts run each (backend, level) for a fixed measurement window (`--window-s`, 15 s on
the GPU) under one rule for MSA and dense (`workloads.py`); given together they share one engine
per backend. Every engine runs the same m3-mini weights (`bench_setup.py`).

GPU runs write `m3.*` entries to benchmarks/results/m3.json (and the byte-ceiling fraction as
`engine.*`), merged with what is there, after every part. `--device cpu` runs the m3-mini parts at
small widths and `--quick` shrinks the sizes: those runs only check the script end to end and write
benchmarks/results/m3-quick.json. The `cpu` part writes benchmarks/results/engine.json.

  python benchmarks/serving/offline.py --device cuda --part agentic mooncake prefill breakdown
  python benchmarks/serving/offline.py --device cuda --part session
  python benchmarks/serving/offline.py --device cpu --part cpu
  python benchmarks/serving/offline.py --quick --device cpu
"""

import argparse
import sys
import traceback
from pathlib import Path

import torch
from bench_setup import model_label, sizes_for
from report import Report
from session import part_prefill, part_session
from step_breakdown import part_breakdown
from traffic import part_traffic

from msaserve.models.presets import M3_MINI_LAYERS

TRACE = str(Path(__file__).resolve().parents[1] / "data" / "mooncake_synthetic_trace.jsonl")
CONCURRENCY = (1, 8, 32)
PARTS = ("agentic", "mooncake", "prefill", "breakdown", "session", "cpu")
TRAFFIC = ("agentic", "mooncake")


def output_path(args: argparse.Namespace, part: str) -> str:
    """Scaled-down runs (--quick, or the GPU parts on the CPU) only check the script: they never
    write over the measured figures."""
    if args.output:
        return args.output
    if part == "cpu":
        return "benchmarks/results/engine.json"
    scaled_down = args.quick or args.device == "cpu"
    return f"benchmarks/results/m3{'-quick' if scaled_down else ''}.json"


def run_part(args: argparse.Namespace, report: Report, part: str | list[str]) -> None:
    sizes = sizes_for(args)
    if isinstance(part, list):
        part_traffic(args, sizes, report, part)
    elif part == "session":
        part_session(args, sizes, report)
    elif part == "prefill":
        part_prefill(args, sizes, report)
    elif part == "breakdown":
        part_breakdown(args, sizes, report)
    else:
        from cpu_smollm2 import run_cpu_smollm2

        new_tokens = 8 if args.quick else args.cpu_new_tokens
        results = run_cpu_smollm2(new_tokens, args.threads, repeats=1 if args.quick else 2)
        for key, value in results.items():
            report.add(key, value, "x" if "_vs_" in key else "tokens/s", model="SmolLM2-135M")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", choices=("cuda", "cpu"), default=default_device)
    parser.add_argument("--quick", action="store_true", help="small sizes: check the script end to end")
    parser.add_argument("--part", choices=("all", *PARTS), nargs="+", default=["all"],
                        help="parts to run (all: every part but cpu); agentic and mooncake given together "
                        "share their engines")
    parser.add_argument("--layers", type=int, default=M3_MINI_LAYERS,
                        help="m3-mini layers (1 dense MLP + the rest MoE; reported with each figure)")
    parser.add_argument("--session-len", type=int, default=None, help="override the session length")
    parser.add_argument("--mooncake-requests", type=int, default=None,
                        help="trace requests per level (default: GPU as many as the window takes, CPU 16)")
    parser.add_argument("--levels", type=int, nargs="+", default=list(CONCURRENCY),
                        help="concurrency levels of the agentic part")
    parser.add_argument("--mooncake-levels", type=int, nargs="+", default=[8],
                        help="concurrency levels of the mooncake part")
    parser.add_argument("--window-s", type=float, default=None,
                        help="measurement window per (backend, level) of the traffic parts (default: GPU "
                        "15 s, 6 s with --quick; CPU none: a fixed set of sessions run to the end; 0: none)")
    parser.add_argument("--trace", default=TRACE)
    parser.add_argument("--decode-steps", type=int, default=1,
                        help="EngineConfig.decode_steps of the traffic engines, both backends alike")
    parser.add_argument("--session-rounds", type=int, nargs="*", default=[8],
                        help="the session part's decode again (its prompt from the prefix cache) with "
                        "EngineConfig.decode_steps of each value, both backends alike (none: skip)")
    parser.add_argument("--cpu-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads, the same for both sides "
                        "(default 1: on a shared 2-core machine OpenMP spin-waits made 2 threads 30× slower)")
    parser.add_argument("--output", default=None,
                        help="JSON path (default benchmarks/results/m3.json, m3-quick.json for scaled-down "
                        "runs, engine.json for the cpu part)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    chosen = tuple(p for p in PARTS if p != "cpu") if "all" in args.part else tuple(
        p for p in PARTS if p in args.part)
    runs: list[str | list[str]] = [p for p in chosen if p not in TRAFFIC]
    traffic = [p for p in chosen if p in TRAFFIC]
    if traffic:
        runs.append(traffic)  # last: the single-shot parts finish even when the traffic runs out of time
    reports: dict[str, Report] = {}
    failed: list[str] = []
    with torch.inference_mode():
        for part in runs:
            name = part if isinstance(part, str) else part[0]
            args.output_path = output_path(args, name)
            model = "SmolLM2-135M" if name == "cpu" else model_label(args)
            area = "engine" if name == "cpu" else "m3"
            report = reports.setdefault(args.output_path, Report(args, model, area))
            try:
                run_part(args, report, part)
            except Exception:  # reported; the other parts still run (one device call holds several)
                traceback.print_exc()
                print(f"part {part} failed", file=sys.stderr, flush=True)
                failed.append(name)
            report.write(args.output_path)  # after every part, so a later failure loses nothing
    for path, report in reports.items():
        print(f"\n{path}")
        report.print_table()
    if failed:
        print(f"failed parts: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
