"""Offline serving benchmark of the replica engine (issue 4): MSA against dense in the same run.

Parts (`--part`, default all):
  session   one long session: prefill `--session-len` tokens (1M on GPU), then decode 256; the dense
            backend at the same length or the longest that fits.
  agentic   sessions sharing a 60K-token prefix, turns appending 1–4K tokens, 100–500 output
            tokens, closed-loop at concurrency 1, 8, 32.
  mooncake  the Mooncake trace (token counts and prefix sharing from its hash_ids), same loop.
  cpu       SmolLM2-135M on the CPU: one stream and 8 concurrent streams against transformers.

GPU runs use the `m3-proxy` preset (random weights; `--layers` is reported with every figure).
`--device cpu` runs session/agentic/mooncake on the `tiny` preset at scaled-down sizes so the
script is checked end to end without a GPU; `--quick` shrinks everything further. Results go to
benchmarks/results/engine.json (engine-quick.json with --quick), merged with what is there.

  python benchmarks/serving/offline.py --device cuda --part session --layers 4
  python benchmarks/serving/offline.py --device cpu --part cpu
  python benchmarks/serving/offline.py --quick --device cpu
"""

import argparse
import gc
import sys
from dataclasses import dataclass

import torch
from report import Report
from workloads import agentic_sessions, mooncake_sessions, percentile, run_closed_loop

from msaserve.engine.config import EngineConfig
from msaserve.engine.llm_engine import LLMEngine
from msaserve.engine.types import GenerateRequest, SamplingParams

TRACE = "../shared/traces/mooncake_synthetic_trace.jsonl"
CONCURRENCY = (1, 8, 32)


@dataclass
class Sizes:
    """Workload sizes: the GPU ones from the issue, or scaled down for the CPU."""

    preset: str
    session_len: int
    session_decode: int
    session_chunk: int
    prefix_len: int
    append: tuple[int, int]
    output: tuple[int, int]
    turns: int
    mooncake_requests: int
    mooncake_scale: int
    max_model_len: int
    chunk: int


def sizes_for(args: argparse.Namespace) -> Sizes:
    if args.device == "cuda" and not args.quick:
        return Sizes("m3-proxy", args.session_len or 1 << 20, 256, 16384, 60_000, (1000, 4000),
                     (100, 500), 3, args.mooncake_requests or 64, 1, 200_000, 8192)
    if args.device == "cuda":  # quick GPU check
        return Sizes("m3-proxy", args.session_len or 65_536, 32, 8192, 8000, (500, 1000), (20, 50), 2,
                     args.mooncake_requests or 8, 4, 60_000, 4096)
    scale = 4 if args.quick else 1
    return Sizes("tiny", args.session_len or 2048 // scale, 16 // scale, 256, 600 // scale,
                 (10, 40), (2, 8 // scale), 2, args.mooncake_requests or 16 // scale, 64, 4096, 128)


def build_engine(args: argparse.Namespace, sizes: Sizes, backend: str, max_model_len: int,
                 max_num_seqs: int, chunk: int, exact_pages: bool = False) -> LLMEngine:
    """exact_pages: a pool of exactly what max_num_seqs × max_model_len needs (no planning from
    free HBM, hence no profiling forward pass, which at 1M dense tokens would take minutes)."""
    overrides = {"num_layers": args.layers} if sizes.preset == "m3-proxy" else {}
    page_size = 128 if sizes.preset == "m3-proxy" else 16
    needed = max_num_seqs * -(-max_model_len // page_size) + 2
    config = EngineConfig(
        model=sizes.preset, model_overrides=overrides, device=args.device,
        dtype="bfloat16" if args.device == "cuda" else "float32", attention_backend=backend,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=chunk, max_model_len=max_model_len,
        max_waiting=10_000, cuda_graphs=args.device == "cuda",
        num_pages=None if args.device == "cuda" and not exact_pages else needed,
    )
    return LLMEngine(config)


def free_memory() -> None:
    """Give back the memory of engines the caller has dropped every reference to."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_one_session(engine: LLMEngine, length: int, decode: int, device: str, seed: int = 0
                    ) -> dict[str, float]:
    """Prefill `length` random tokens, decode `decode` → prefill_s, tpot_ms, hbm_gib."""
    import time

    vocab = engine.model.config.vocab_size
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
        report.add("session_dense_len_tokens", dense_len, "tokens")
        report.add("session_dense_prefill_s", dense["prefill_s"], "s")
        report.add("session_dense_tpot_ms", dense["tpot_ms"], "ms")
        report.add("session_dense_hbm_gib", dense["hbm_gib"], "GiB")
        if dense_len == length:
            report.add("session_prefill_speedup", dense["prefill_s"] / msa["prefill_s"], "x")
            report.add("session_decode_speedup", dense["tpot_ms"] / msa["tpot_ms"], "x")


def part_traffic(args: argparse.Namespace, sizes: Sizes, report: Report, name: str) -> None:
    """agentic or mooncake, at each concurrency, MSA then dense on the same sessions."""
    levels = (1, 2) if args.quick else tuple(args.levels)
    throughput: dict[tuple[str, int], float] = {}
    for backend in ("msa", "dense"):
        engine = build_engine(args, sizes, backend, sizes.max_model_len, max(levels), sizes.chunk)
        vocab = engine.model.config.vocab_size
        run_closed_loop(engine, make_sessions(args, sizes, name, vocab, 1, seed=99), 1)  # warm-up
        for level in levels:
            engine.block_manager.reset_prefix_cache()  # each level starts cold
            try:
                result = run_closed_loop(engine, make_sessions(args, sizes, name, vocab, level, 0), level)
            except torch.cuda.OutOfMemoryError as error:  # reported, so the other figures still land
                print(f"{name} {backend} c{level}: out of memory ({error})", file=sys.stderr)
                report.add(f"{name}_{backend}_c{level}_output_tok_s", float("nan"), "tokens/s")
                throughput[(backend, level)] = float("nan")
                engine = None
                free_memory()  # a step that ran out of memory leaves sequences half-scheduled
                engine = build_engine(args, sizes, backend, sizes.max_model_len, max(levels), sizes.chunk)
                continue
            key = f"{name}_{backend}_c{level}"
            throughput[(backend, level)] = result.output_tok_s
            report.add(f"{key}_output_tok_s", result.output_tok_s, "tokens/s")
            for label, values in (("ttft", result.ttft_s), ("tpot", result.tpot_s)):
                for q in (50, 90):
                    report.add(f"{key}_{label}_p{q}_ms", 1000 * percentile(values, q), "ms")
            report.add(f"{key}_prefix_hit", result.cached_tokens / max(1, result.prompt_tokens), "ratio")
        engine = None
        free_memory()
    for level in levels:
        ratio = throughput[("msa", level)] / throughput[("dense", level)]
        report.add(f"{name}_throughput_ratio_c{level}", ratio, "x")


def make_sessions(args: argparse.Namespace, sizes: Sizes, name: str, vocab: int, level: int, seed: int):
    if name == "agentic":
        count = max(level, 2 if args.quick else 4)
        return agentic_sessions(count, vocab, seed, sizes.prefix_len, sizes.append, sizes.output, sizes.turns)
    count = min(sizes.mooncake_requests, 2) if seed else sizes.mooncake_requests
    max_len = sizes.max_model_len - 1100
    return mooncake_sessions(args.trace, count, vocab, sizes.mooncake_scale, max_len)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", choices=("cuda", "cpu"), default=default_device)
    parser.add_argument("--quick", action="store_true", help="small sizes: check the script end to end")
    parser.add_argument("--part", choices=("all", "session", "agentic", "mooncake", "cpu"), default="all")
    parser.add_argument("--layers", type=int, default=4, help="m3-proxy layers (reported with each figure)")
    parser.add_argument("--session-len", type=int, default=None, help="override the session length")
    parser.add_argument("--mooncake-requests", type=int, default=None)
    parser.add_argument("--levels", type=int, nargs="+", default=list(CONCURRENCY),
                        help="concurrency levels of the agentic and mooncake parts")
    parser.add_argument("--trace", default=TRACE)
    parser.add_argument("--cpu-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads, the same for both sides "
                        "(default 1: on a shared 2-core machine OpenMP spin-waits made 2 threads 30× slower)")
    parser.add_argument("--output", default=None, help="JSON path (default benchmarks/results/engine.json)")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    sizes = sizes_for(args)
    output = args.output or f"benchmarks/results/engine{'-quick' if args.quick else ''}.json"
    report = Report(args, sizes.preset if sizes.preset == "tiny" else f"m3-proxy, {args.layers} layers")
    parts = ("session", "agentic", "mooncake", "cpu") if args.part == "all" else (args.part,)
    with torch.inference_mode():
        for part in parts:
            if part == "session":
                part_session(args, sizes, report)
            elif part in ("agentic", "mooncake"):
                part_traffic(args, sizes, report, part)
            else:
                from cpu_smollm2 import run_cpu_smollm2

                new_tokens = 8 if args.quick else args.cpu_new_tokens
                results = run_cpu_smollm2(new_tokens, args.threads, repeats=1 if args.quick else 2)
                for key, value in results.items():
                    report.add(key, value, "x" if "_vs_" in key else "tokens/s", model="SmolLM2-135M")
    report.write(output)
    report.print_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
