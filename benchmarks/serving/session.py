"""The long-sequence parts of the offline benchmark, MSA then dense on the same model:

  session   one session: prefill `session_len` tokens (1M on the GPU), decode 256; TPOT, peak
            HBM; then the decode step's breakdown (step_breakdown.py) and its byte floor
            (byte_ceiling.py) per backend.
  prefill   one `prefill_len`-token prompt (128K on the GPU): prefill time, MSA against dense.
"""

import argparse
import sys
import time
import traceback

import torch
from bench_setup import SelectorWatch, Sizes, build_engine, free_memory, prompt_vocab, synchronize
from byte_ceiling import copy_bandwidth_tbps, step_floor
from report import Report
from step_breakdown import format_row, header, profile_steps

from msaserve.engine.llm_engine import LLMEngine
from msaserve.engine.types import GenerateRequest, SamplingParams

DENSE = ("dense backend: every layer full attention, prefill in the same chunks as MSA and decode, each "
         "by the fastest dense kernel measured for its shape (msaserve/kernels/dense/select.py), decode "
         "in a CUDA graph")


def tag(length: int) -> str:
    if length == 1 << 20:
        return "1m"
    return f"{length // 1024}k" if length % 1024 == 0 else str(length)


def _prompt(engine: LLMEngine, length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, prompt_vocab(engine), (length,), generator=generator).tolist()


def run_one_session(engine: LLMEngine, length: int, decode: int, device: str, seed: int = 0
                    ) -> dict[str, float]:
    """Prefill `length` random tokens, decode `decode` → prefill_s, tpot_ms, hbm_gib, session_kv_gib,
    tokens (the greedy tokens), max_tokens_per_step (the most tokens one `engine.step()` gave: 1
    where each token streams as its step ends)."""
    prompt = _prompt(engine, length, seed)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    engine.add_request(GenerateRequest("session", prompt, SamplingParams(
        max_tokens=decode, temperature=0.0, ignore_eos=True)))
    synchronize(device)
    start = time.perf_counter()
    first = last = None
    pages = 0
    tokens: list[int] = []
    burst = 0
    while engine.has_unfinished():
        step = engine.step()  # (one output per token: a round's burst is several outputs)
        burst = max(burst, sum(len(output.token_ids) for output in step))
        for output in step:
            now = time.perf_counter()  # the step synchronised when it read the sampled token
            first = first or now
            last = now
            tokens += output.token_ids
            if output.finished:
                pages = output.stats.num_pages
    hbm = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    per_page = engine.runner.kv_cache_bytes / (engine.runner.num_pages + 1)
    return {
        "prefill_s": first - start, "tpot_ms": 1000 * (last - first) / max(1, decode - 1),
        "hbm_gib": hbm, "session_kv_gib": pages * per_page / 2**30, "tokens": tokens,
        "max_tokens_per_step": burst,
    }


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The index of the first token where `a` and `b` differ (a length difference counts), or None."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def decode_breakdown(engine: LLMEngine, length: int, device: str, steps: int = 4) -> dict[str, float]:
    """The session's prompt again (its pages come from the prefix cache), one step to finish its
    prefill, then `steps` decode steps profiled eagerly."""
    engine.add_request(GenerateRequest("breakdown", _prompt(engine, length, 0), SamplingParams(
        max_tokens=steps + 2, temperature=0.0, ignore_eos=True)))
    while engine.has_unfinished() and not engine.step():
        pass
    row = profile_steps(engine, steps, device)
    while engine.has_unfinished():
        engine.step()
    return row


def _session(args: argparse.Namespace, sizes: Sizes, backend: str, length: int, decode: int,
             breakdown: bool) -> dict:
    engine = None
    try:
        engine = build_engine(args, sizes, backend, length + decode + 256, 1, sizes.session_chunk,
                              exact_pages=True)
        run_one_session(engine, min(2 * sizes.session_chunk + 5, length), 4, args.device, seed=1)  # warm-up
        with SelectorWatch(f"session {backend} {length}") as watch:
            result = run_one_session(engine, length, decode, args.device)
        result["selector_measurements"] = watch.count
        result["rounds"], result["round_bursts"] = {}, {}
        if args.session_rounds:
            # The rounds' runs take the prompt from the prefix cache and recompute its last token alone,
            # whose bf16 K/V need not be the bits the chunked prefill wrote: their reference is a
            # decode_steps=1 run through the cache too (an H100 run compared with the first run instead
            # and stopped at a difference in the 15th token, 6e421dd).
            engine.config.decode_steps = 1
            cached = run_one_session(engine, length, decode, args.device)
            result["cached_first_difference"] = first_difference(cached["tokens"], result["tokens"])
            print(f"session {backend} {length}: prompt from the prefix cache, decode_steps=1: TPOT "
                  f"{cached['tpot_ms']:.3f} ms, first token differing from the first run's (index): "
                  f"{result['cached_first_difference']}", flush=True)
        for steps in args.session_rounds:  # the same session decoded in rounds (its prompt cached)
            engine.config.decode_steps = steps
            again = run_one_session(engine, length, decode, args.device)
            result["rounds"][steps] = again["tpot_ms"]
            result["round_bursts"][steps] = again["max_tokens_per_step"]
            differs = first_difference(again["tokens"], cached["tokens"])
            print(f"session {backend} {length}: decode_steps={steps}: TPOT {again['tpot_ms']:.3f} ms "
                  f"(decode_steps=1: {result['tpot_ms']:.3f} ms, from the cache {cached['tpot_ms']:.3f} ms), "
                  f"tokens equal to decode_steps=1's from the cache {differs is None}, at most "
                  f"{again['max_tokens_per_step']} token(s) per engine step", flush=True)
            if differs is not None:
                raise AssertionError(f"session {backend}: decode_steps={steps} gave other greedy tokens than "
                                     f"decode_steps=1 (both from the prefix cache) from token {differs}: "
                                     f"{again['tokens'][:differs + 2]} vs {cached['tokens'][:differs + 2]}")
        engine.config.decode_steps = 1
        if breakdown:
            try:  # a diagnostic: its failure must not cost the session's figures
                result["breakdown"] = decode_breakdown(engine, length, args.device)
            except Exception:
                traceback.print_exc()
        return result
    finally:
        engine = None
        free_memory()


def part_session(args: argparse.Namespace, sizes: Sizes, report: Report) -> None:
    length, decode, t = sizes.session_len, sizes.session_decode, tag(sizes.session_len)
    results = {}
    for backend in ("msa", "dense"):
        try:
            results[backend] = _session(args, sizes, backend, length, decode, breakdown=True)
        except torch.cuda.OutOfMemoryError as error:
            print(f"{backend} session of {length} tokens: out of memory ({error})", file=sys.stderr)
            continue
        r = results[backend]
        note = DENSE if backend == "dense" else "MSA backend (Triton kernels), decode in a CUDA graph"
        report.add(f"session_{t}_{backend}_prefill_s", r["prefill_s"], "s", note=note)
        report.add(f"session_{t}_{backend}_tpot_ms", r["tpot_ms"], "ms", note=note)
        report.add(f"session_{t}_{backend}_hbm_gib", r["hbm_gib"], "GiB", note=note + "; peak allocated")
        report.add(f"session_{t}_{backend}_kv_gib", r["session_kv_gib"], "GiB", note=note)
        report.add(f"session_{t}_{backend}_selector_measurements", r["selector_measurements"], "keys",
                   note="dense keys the selector measured inside the timed run (0 for a valid figure)")
        report.write(args.output_path)
    if len(results) < 2:
        return
    msa, dense = results["msa"], results["dense"]
    report.add(f"session_{t}_prefill_speedup", dense["prefill_s"] / msa["prefill_s"], "x",
               note=f"dense / MSA prefill time of {length} tokens, chunks of {sizes.session_chunk}; {DENSE}")
    report.add(f"session_{t}_decode_speedup", dense["tpot_ms"] / msa["tpot_ms"], "x",
               note=f"dense / MSA TPOT at {length} tokens, batch 1, {decode} steps; {DENSE}")
    _byte_ceiling(args, report, length, msa, dense, t)
    for steps in sorted(set(msa["rounds"]) & set(dense["rounds"])):
        report.add(f"session_{t}_msa_tpot_ms_steps{steps}", msa["rounds"][steps], "ms",
                   note=f"the same session decoded again (its prompt from the prefix cache) with "
                        f"EngineConfig.decode_steps={steps}: {steps} greedy steps queued on the device per "
                        f"scheduling round, each token streamed as its step ends (at most "
                        f"{msa['round_bursts'][steps]} token(s) per engine step); MSA backend, decode in a "
                        f"CUDA graph; greedy tokens equal to "
                        f"decode_steps=1's through the cache (against the first run's: first difference at "
                        f"{msa['cached_first_difference']}, the last prompt token recomputed alone)")
        report.add(f"session_{t}_dense_tpot_ms_steps{steps}", dense["rounds"][steps], "ms",
                   note=f"as session_{t}_msa_tpot_ms_steps{steps}; {DENSE}")
        _byte_ceiling(args, report, length, {"tpot_ms": msa["rounds"][steps]},
                      {"tpot_ms": dense["rounds"][steps]}, t, steps)
    if "breakdown" not in msa or "breakdown" not in dense:
        return
    rows = [{"step": f"session {t} decode b1", "backend": b, **results[b]["breakdown"]} for b in results]
    report.add(f"session_{t}_step_breakdown", msa["breakdown"]["total"] / dense["breakdown"]["total"],
               "x (MSA / dense kernel ms per decode step)", table=rows,
               note="kernel time per decode step by part, eager steps under torch.profiler "
                    "(benchmarks/serving/step_breakdown.py)")
    print(f"\n{header()}")
    for row in rows:
        print(format_row(f"{row['backend']} {row['step']}", row))


def _byte_ceiling(args: argparse.Namespace, report: Report, length: int, msa: dict, dense: dict,
                  t: str, steps: int = 1) -> None:
    """The TPOTs against the bytes each step must read (byte_ceiling.py); steps: the engines'
    decode_steps (above 1 the keys end `_steps{steps}`)."""
    from bench_setup import shared_model

    model = shared_model(args).model
    tbps = copy_bandwidth_tbps(args.device)
    floors = {b: step_floor(model, length, b == "msa", tbps) for b in ("msa", "dense")}
    ceiling = floors["dense"]["bytes_gb"] / floors["msa"]["bytes_gb"]
    speedup = dense["tpot_ms"] / msa["tpot_ms"]
    detail = (f"batch-1 decode at {length} tokens; bytes per step MSA {floors['msa']['bytes_gb']:.2f} GB "
              f"(weights {floors['msa']['weights_gb']:.2f}), dense {floors['dense']['bytes_gb']:.2f} GB; "
              f"copy bandwidth {tbps:.2f} TB/s; floors MSA {floors['msa']['floor_ms']:.3f} ms / dense "
              f"{floors['dense']['floor_ms']:.3f} ms; TPOT MSA {msa['tpot_ms']:.3f} / dense "
              f"{dense['tpot_ms']:.3f} ms (whole engine step: forward, logits, sampling, host work)"
              + (f"; EngineConfig.decode_steps={steps} on both: {steps} greedy steps queued per "
                 f"scheduling round, each token streamed as its step ends" if steps > 1 else
                 "; decode_steps=1: one host sync per token, each token streamed as it is sampled"))
    suffix = f"_steps{steps}" if steps > 1 else ""
    report.add(f"session_decode_fraction_of_byte_ceiling{suffix}", speedup / ceiling, "fraction",
               area="engine",
               note=f"measured decode speedup {speedup:.3f}x / byte ceiling {ceiling:.3f}x; {detail}")
    for backend in ("msa", "dense"):
        tpot = (msa if backend == "msa" else dense)["tpot_ms"]
        report.add(f"session_{t}_{backend}_tpot_fraction_of_floor{suffix}",
                   floors[backend]["floor_ms"] / tpot, "fraction", note=detail)


def part_prefill(args: argparse.Namespace, sizes: Sizes, report: Report) -> None:
    """One long prompt's prefill, MSA against dense (in the session part's chunks)."""
    length, t = sizes.prefill_len, tag(sizes.prefill_len)
    times = {}
    for backend in ("msa", "dense"):
        times[backend] = _session(args, sizes, backend, length, 2, breakdown=False)["prefill_s"]
        report.add(f"prefill_{t}_{backend}_s", times[backend], "s",
                   note=f"time to first token of one {length}-token prompt, chunks of {sizes.session_chunk}")
    report.add(f"prefill_speedup_{t}", times["dense"] / times["msa"], "x",
               note=f"dense / MSA time to first token of one {length}-token prompt; {DENSE}")
