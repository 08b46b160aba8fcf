"""Offline serving benchmark of the replica engine (issue 4): MSA against dense in the same run.

Parts (`--part`, one or more; default all):
  session   one long session: prefill `--session-len` tokens (1M on GPU), then decode 256; the dense
            backend at the same length or the longest that fits.
  agentic   sessions sharing a 60K-token prefix, turns appending 1–4K tokens, 100–500 output
            tokens, closed-loop at concurrency 1, 8, 32.
  mooncake  the Mooncake trace (token counts and prefix sharing from its hash_ids), same loop.
  cpu       SmolLM2-135M on the CPU: one stream and 8 concurrent streams against transformers.

The traffic parts (agentic, mooncake) run each (backend, level) for a fixed measurement window
(`--window-s`, 25 s on the GPU) under one rule for MSA and dense (`workloads.py`); given together
they share one engine per backend. The dense backend is the strongest we have: SDPA (flash)
prefill, and decode by a paged flash-decoding kernel in CUDA graphs (`msaserve/kernels/dense/`).

GPU runs use the `m3-proxy` preset (random weights; `--layers` is reported with every figure).
`--device cpu` runs session/agentic/mooncake on the `tiny` preset at scaled-down sizes, and
`--quick` shrinks everything further: those runs only check the script end to end and write
benchmarks/results/engine-quick.json. GPU runs and the `cpu` part write benchmarks/results/engine.json,
merged with what is there.

  python benchmarks/serving/offline.py --device cuda --part agentic mooncake --layers 2
  python benchmarks/serving/offline.py --device cuda --part session --layers 2
  python benchmarks/serving/offline.py --device cpu --part cpu
  python benchmarks/serving/offline.py --quick --device cpu
"""

import argparse
import sys
import time
from pathlib import Path

import torch
from bench_setup import Sizes, build_engine, free_memory, prompt_vocab, sizes_for, synchronize
from report import Report
from traffic import part_traffic

from msaserve.engine.llm_engine import LLMEngine
from msaserve.engine.types import GenerateRequest, SamplingParams

TRACE = str(Path(__file__).resolve().parents[1] / "data" / "mooncake_synthetic_trace.jsonl")
CONCURRENCY = (1, 8, 32)
DENSE_SESSION = ("dense backend: SDPA (flash) prefill in the same chunks as MSA; decode by the paged "
                 "flash-decoding kernel (msaserve/kernels/dense/paged_decode.py) in a CUDA graph")


def run_one_session(engine: LLMEngine, length: int, decode: int, device: str, seed: int = 0
                    ) -> dict[str, float]:
    """Prefill `length` random tokens, decode `decode` → prefill_s, tpot_ms, hbm_gib."""
    vocab = prompt_vocab(engine)
    prompt = torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    engine.add_request(GenerateRequest("session", prompt, SamplingParams(
        max_tokens=decode, temperature=0.0, ignore_eos=True)))
    synchronize(device)
    start = time.perf_counter()
    first = last = None
    pages = 0
    while engine.has_unfinished():
        for output in engine.step():
            now = time.perf_counter()  # the step synchronised when it read the sampled token
            first = first or now
            last = now
            if output.finished:
                pages = output.stats.num_pages
    hbm = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    per_page = engine.runner.kv_cache_bytes / (engine.runner.num_pages + 1)
    return {
        "prefill_s": first - start, "tpot_ms": 1000 * (last - first) / max(1, decode - 1),
        "hbm_gib": hbm, "session_kv_gib": pages * per_page / 2**30,
    }


def part_session(args: argparse.Namespace, sizes: Sizes, report: Report) -> None:
    length, decode = sizes.session_len, sizes.session_decode
    max_len = length + decode + 256
    engine = build_engine(args, sizes, "msa", max_len, 1, sizes.session_chunk, exact_pages=True)
    run_one_session(engine, 2 * sizes.session_chunk + 5, 4, args.device, seed=1)  # warm-up: compile, tune
    msa = run_one_session(engine, length, decode, args.device)
    engine = None
    free_memory()
    report.add("session_len_tokens", length, "tokens")
    report.add("session_msa_prefill_s", msa["prefill_s"], "s")
    report.add("session_msa_tpot_ms", msa["tpot_ms"], "ms")
    report.add("session_msa_hbm_gib", msa["hbm_gib"], "GiB")
    report.add("session_msa_kv_gib", msa["session_kv_gib"], "GiB")
    dense, dense_len = None, length
    while dense is None and dense_len >= min(1024, length):
        engine = None
        try:  # dense prefills in the same chunks as MSA (SDPA with a lower-right causal bias)
            engine = build_engine(args, sizes, "dense", dense_len + decode + 256, 1, sizes.session_chunk,
                                  exact_pages=True)
            run_one_session(engine, min(1024, dense_len), 4, args.device, seed=1)
            dense = run_one_session(engine, dense_len, decode, args.device)
        except torch.cuda.OutOfMemoryError:
            print(f"dense session of {dense_len} tokens does not fit; halving", file=sys.stderr)
            dense_len //= 2
        finally:
            engine = None
            free_memory()
    if dense is not None:
        how = DENSE_SESSION if args.device == "cuda" else None
        report.add("session_dense_len_tokens", dense_len, "tokens", note=how)
        report.add("session_dense_prefill_s", dense["prefill_s"], "s", note=how)
        report.add("session_dense_tpot_ms", dense["tpot_ms"], "ms", note=how)
        report.add("session_dense_hbm_gib", dense["hbm_gib"], "GiB", note=how)
        if dense_len == length:
            report.add("session_prefill_speedup", dense["prefill_s"] / msa["prefill_s"], "x")
            report.add("session_decode_speedup", dense["tpot_ms"] / msa["tpot_ms"], "x")


PARTS = ("session", "agentic", "mooncake", "cpu")
TRAFFIC = ("agentic", "mooncake")


def output_path(args: argparse.Namespace, part: str) -> str:
    """Scaled-down runs (--quick, or the GPU parts on the CPU) only check the script: they never
    write over the measured figures in engine.json."""
    if args.output:
        return args.output
    scaled_down = args.quick or (args.device == "cpu" and part != "cpu")
    return f"benchmarks/results/engine{'-quick' if scaled_down else ''}.json"


def run_part(args: argparse.Namespace, sizes: Sizes, report: Report, part: str | list[str]) -> None:
    if isinstance(part, list):
        part_traffic(args, sizes, report, part)
    elif part == "session":
        part_session(args, sizes, report)
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
                        help="parts to run; agentic and mooncake given together share their engines")
    parser.add_argument("--layers", type=int, default=4, help="m3-proxy layers (reported with each figure)")
    parser.add_argument("--session-len", type=int, default=None, help="override the session length")
    parser.add_argument("--mooncake-requests", type=int, default=None,
                        help="trace requests per level (default: GPU as many as the window takes, CPU 16)")
    parser.add_argument("--levels", type=int, nargs="+", default=list(CONCURRENCY),
                        help="concurrency levels of the agentic and mooncake parts")
    parser.add_argument("--window-s", type=float, default=None,
                        help="measurement window per (backend, level) of the traffic parts (default: GPU "
                        "25 s, 8 s with --quick; CPU none: a fixed set of sessions run to the end; 0: none)")
    parser.add_argument("--trace", default=TRACE)
    parser.add_argument("--decode-steps", type=int, default=1,
                        help="EngineConfig.decode_steps of the traffic engines, both backends alike")
    parser.add_argument("--cpu-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads, the same for both sides "
                        "(default 1: on a shared 2-core machine OpenMP spin-waits made 2 threads 30× slower)")
    parser.add_argument("--output", default=None,
                        help="JSON path (default benchmarks/results/engine.json, engine-quick.json for "
                        "scaled-down runs)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    sizes = sizes_for(args)
    chosen = PARTS if "all" in args.part else tuple(p for p in PARTS if p in args.part)
    runs: list[str | list[str]] = [p for p in chosen if p not in TRAFFIC]
    traffic = [p for p in chosen if p in TRAFFIC]
    if traffic:
        runs.insert(1 if "session" in chosen else 0, traffic)
    reports: dict[str, Report] = {}
    model = sizes.preset if sizes.preset == "tiny" else f"m3-proxy, {args.layers} layers"
    with torch.inference_mode():
        for part in runs:
            path = output_path(args, part if isinstance(part, str) else part[0])
            report = reports.setdefault(path, Report(args, model))
            run_part(args, sizes, report, part)
            report.write(path)  # after every part, so a later failure loses nothing
    for path, report in reports.items():
        print(f"\n{path}")
        report.print_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
