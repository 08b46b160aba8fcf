"""The agentic and Mooncake parts of the offline benchmark: closed-loop traffic at each concurrency,
MSA then dense on the same sessions, each (backend, level) bounded by the same measurement window
(rule: `workloads.py`'s docstring). One engine per backend serves every part and level."""

import argparse
import itertools
import sys
from collections.abc import Iterable

import torch
from bench_setup import SelectorWatch, Sizes, build_engine, free_memory, prompt_vocab
from report import Report
from workloads import (
    RunResult,
    Session,
    agentic_prefix,
    agentic_stream,
    mooncake_stream,
    percentile,
    run_closed_loop,
    run_to_end,
)

from msaserve.engine.llm_engine import LLMEngine

BACKENDS = ("msa", "dense")
SEED = 0  # of the measured agentic sessions (the warm-up uses others)


def traffic_sessions(args: argparse.Namespace, sizes: Sizes, name: str, vocab: int, level: int,
                     warmup: bool = False) -> Iterable[Session]:
    """The sessions of one (part, level) run; the same for both backends."""
    if name == "agentic":
        stream = agentic_stream(vocab, 99 if warmup else SEED, sizes.prefix_len, sizes.append, sizes.output,
                                sizes.turns)
        if sizes.window_s is None or (warmup and sizes.warmup_s is None):
            return itertools.islice(stream, 1 if warmup else max(level, 2 if args.quick else 4))
        return stream
    count = min(2, sizes.mooncake_requests or 2) if warmup else sizes.mooncake_requests
    return mooncake_stream(args.trace, count, vocab, sizes.mooncake_scale, sizes.max_model_len - 1100)


def rule(sizes: Sizes, name: str, level: int) -> str:
    """How a traffic figure was measured, stored with it."""
    start = ("prefix cache emptied, then the shared prefix alone prefilled (untimed) before the run"
             if name == "agentic" else "prefix cache emptied before the run")
    if sizes.window_s is None:
        return f"closed loop at concurrency {level}, a fixed set of sessions run to the end; {start}"
    return (f"closed loop at concurrency {level} for a {sizes.window_s:g} s window: turns start only "
            "inside it; throughput = output tokens streamed until the first step ending after it / "
            f"that time; turns in flight then are aborted and their partial TTFT/TPOT counted; {start}")


def record(report: Report, sizes: Sizes, name: str, key: str, level: int, result: RunResult) -> None:
    note = rule(sizes, name, level)
    report.add(f"{key}_output_tok_s", result.output_tok_s, "tokens/s", note=note)
    for label, values in (("ttft", result.ttft_s), ("tpot", result.tpot_s)):
        for q in (50, 90):
            report.add(f"{key}_{label}_p{q}_ms", 1000 * percentile(values, q), "ms", note=note)
    report.add(f"{key}_prefix_hit", result.cached_tokens / max(1, result.prompt_tokens), "ratio", note=note)
    report.add(f"{key}_elapsed_s", result.elapsed_s, "s", note=note)
    report.add(f"{key}_requests_finished", result.requests, "requests", note=note)
    report.add(f"{key}_requests_cut", result.requests_cut, "requests", note=note + "; of them "
               f"{result.requests_unserved} had no first token yet")
    report.add(f"{key}_selector_measurements", result.selector_measurements, "keys",
               note="dense keys the selector measured inside the timed window (0 for a valid figure)")


def _run_level(args: argparse.Namespace, sizes: Sizes, engine: LLMEngine, name: str, level: int
               ) -> RunResult | None:
    engine.block_manager.reset_prefix_cache()  # each level starts cold
    engine.drain_kv_events()  # nobody consumes them here; keep the list from growing
    vocab = prompt_vocab(engine)
    try:
        if name == "agentic":  # steady state: the system prompt every session shares stays cached
            run_to_end(engine, agentic_prefix(vocab, SEED, sizes.prefix_len))
        sessions = traffic_sessions(args, sizes, name, vocab, level)
        with SelectorWatch(f"{name} {engine.config.attention_backend} c{level}") as watch:
            result = run_closed_loop(engine, sessions, level, sizes.window_s)
        result.selector_measurements = watch.count
        return result
    except torch.cuda.OutOfMemoryError as error:  # reported, so the other figures still land
        print(f"{name} {engine.config.attention_backend} c{level}: out of memory ({error})", file=sys.stderr)
        return None


def _engine(args: argparse.Namespace, sizes: Sizes, backend: str, levels: tuple[int, ...]) -> LLMEngine:
    return build_engine(args, sizes, backend, sizes.max_model_len, max(levels), sizes.chunk,
                        decode_steps=args.decode_steps)


def part_traffic(args: argparse.Namespace, sizes: Sizes, report: Report, names: list[str]) -> None:
    """The named parts (agentic, mooncake) at each concurrency, MSA then dense."""
    level_sets = {"agentic": tuple(args.levels), "mooncake": tuple(args.mooncake_levels)}
    if args.quick:
        level_sets = {"agentic": (1, 2), "mooncake": (2,)}
    levels = tuple(sorted({level for name in names for level in level_sets[name]}))
    window = "to the end" if sizes.window_s is None else f"{sizes.window_s:g} s each"
    print(f"traffic: {len(BACKENDS)} backends × {len(names)} parts × {len(levels)} levels, {window}",
          file=sys.stderr, flush=True)
    throughput: dict[tuple[str, str, int], float] = {}
    for backend in BACKENDS:
        engine = _engine(args, sizes, backend, levels)
        vocab = prompt_vocab(engine)
        for name in names:  # compile, autotune, and measure the dense selector's keys (batch buckets
            top = max(level_sets[name])  # up to the top level) before any timed window
            run_closed_loop(engine, traffic_sessions(args, sizes, name, vocab, top, warmup=True), top,
                            sizes.warmup_s)
        for name in names:
            for level in level_sets[name]:
                result = _run_level(args, sizes, engine, name, level)
                key = f"{name}_{backend}_c{level}"
                if result is None:
                    report.add(f"{key}_output_tok_s", float("nan"), "tokens/s", note="out of memory")
                    throughput[(name, backend, level)] = float("nan")
                    engine = None
                    free_memory()  # a step that ran out of memory leaves sequences half-scheduled
                    engine = _engine(args, sizes, backend, levels)
                    continue
                throughput[(name, backend, level)] = result.output_tok_s
                record(report, sizes, name, key, level, result)
                if backend == "dense" and (name, "msa", level) in throughput:  # the ratio as soon as known
                    msa, dense = throughput[(name, "msa", level)], result.output_tok_s
                    ratio = msa / dense if dense > 0 else float("nan")
                    note = f"MSA / dense output tokens/s; {rule(sizes, name, level)}"
                    report.add(f"{name}_throughput_ratio_c{level}", ratio, "x", note=note)
                report.write(args.output_path)  # partial results survive a later failure
        engine = None
        free_memory()
