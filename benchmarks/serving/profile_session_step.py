"""Where a long session's batch-1 decode step goes: a diagnostic for docs/performance-m3.md (issue 25's
`engine.session_decode_fraction_of_byte_ceiling`). One backend at a time, one session of `--length`
tokens prefilled, then:

1. `--steps` graph-replayed decode steps timed whole (the TPOT the session benchmark reports);
2. the same number timed in phases (schedule, step inputs, forward, logits, sampling, the rest) with a
   device sync at each phase's end (profile_steps.StepClock);
3. two eager steps under torch.profiler: every kernel's GPU time per step, largest first, and the
   host ops by self CPU time;
4. `--graph-steps` graph-replayed steps under torch.profiler (CUPTI records each kernel of a replay):
   per kernel the GPU time per replayed step, and the step's wall time split into kernel time, gaps
   between kernels inside the graph (< 20 µs) and the longer idle spans (host work between replays).

Prints tables, writes JSON (not a results file: a diagnostic).

    python benchmarks/serving/profile_session_step.py --length 1048576 --backends msa --output /tmp/s.json
"""

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from bench_setup import build_engine, free_memory, sizes_for, synchronize
from profile_steps import PHASES, StepClock
from session import _prompt

from msaserve.engine.llm_engine import LLMEngine
from msaserve.engine.types import GenerateRequest, SamplingParams


def timed_steps(engine: LLMEngine, steps: int, device: str) -> list[float]:
    times = []
    for _ in range(steps):
        synchronize(device)
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def kernel_table(engine: LLMEngine, steps: int, device: str) -> tuple[list[dict], list[dict]]:
    from torch.profiler import ProfilerActivity, profile

    graphs, engine.runner.graphs = engine.runner.graphs, None
    try:
        engine.step()  # eager shapes compiled outside the profile
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(steps):
                engine.step()
            synchronize(device)
    finally:
        engine.runner.graphs = graphs
    device_us: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type.name == "CUDA":
            entry = device_us[event.name]
            entry[0] += event.time_range.end - event.time_range.start
            entry[1] += 1
    kernels = sorted(({"kernel": k, "ms_per_step": v[0] / 1e3 / steps, "launches_per_step": v[1] / steps}
                      for k, v in device_us.items()), key=lambda r: -r["ms_per_step"])
    host = sorted(({"op": e.key, "self_cpu_ms_per_step": e.self_cpu_time_total / 1e3 / steps,
                    "calls_per_step": e.count / steps}
                   for e in prof.key_averages() if e.device_type.name == "CPU"),
                  key=lambda r: -r["self_cpu_ms_per_step"])
    return kernels, host[:25]


GAP_US = 20.0
"""Idle spans on the device shorter than this count as launch gaps inside a replay, longer ones as
the host's work between steps."""


def graph_timeline(engine: LLMEngine, steps: int, device: str) -> dict:
    """`steps` graph-replayed steps under torch.profiler → kernels (GPU ms per step, largest first)
    and the device timeline per step: busy, short gaps (inside replays), long idle spans."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    synchronize(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        synchronize(device)
        wall_ms = 1000 * (time.perf_counter() - start)
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type.name == "CUDA")
    per_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    busy = short = long_idle = 0.0
    last_end = None
    for begin, end, name in spans:
        per_name[name][0] += end - begin
        per_name[name][1] += 1
        if last_end is not None and begin > last_end:
            gap = begin - last_end
            short, long_idle = (short + gap, long_idle) if gap < GAP_US else (short, long_idle + gap)
        busy += max(0.0, end - max(begin, last_end or begin))
        last_end = end if last_end is None else max(last_end, end)
    kernels = sorted(({"kernel": k, "ms_per_step": v[0] / 1e3 / steps, "launches_per_step": v[1] / steps}
                      for k, v in per_name.items()), key=lambda r: -r["ms_per_step"])
    return {"wall_ms_per_step": wall_ms / steps, "busy_ms_per_step": busy / 1e3 / steps,
            "short_gaps_ms_per_step": short / 1e3 / steps, "long_idle_ms_per_step": long_idle / 1e3 / steps,
            "kernels": kernels[:80], "launches_per_step": sum(k["launches_per_step"] for k in kernels)}


def one_backend(args: argparse.Namespace, backend: str) -> dict:
    ns = argparse.Namespace(device=args.device, quick=False, layers=args.layers, session_len=args.length,
                            mooncake_requests=None, window_s=None, decode_steps=1)
    sizes = sizes_for(ns)
    total = args.length + 3 * args.steps + 64
    engine = build_engine(ns, sizes, backend, total + 256, 1, sizes.session_chunk, exact_pages=True)
    engine.add_request(GenerateRequest("s", _prompt(engine, args.length, 0), SamplingParams(
        max_tokens=3 * args.steps + 32, temperature=0.0, ignore_eos=True)))
    start = time.perf_counter()
    while not engine.step():
        pass
    prefill_s = time.perf_counter() - start
    timed_steps(engine, 8, args.device)  # warm-up: graphs captured
    whole = timed_steps(engine, args.steps, args.device)
    clock = StepClock(engine, args.device)
    for _ in range(args.steps):
        engine.step()
    clock.close()
    phases = {p: 1000 * statistics.median(s[p] for s in clock.steps) for p in (*PHASES, "total")}
    timeline = graph_timeline(engine, args.graph_steps, args.device) if args.graph_steps else None
    kernels, host = kernel_table(engine, 2, args.device)
    result = {"prefill_s": prefill_s, "tpot_ms_median": 1000 * statistics.median(whole),
              "tpot_ms_mean": 1000 * statistics.fmean(whole), "phases_ms_median": phases,
              "kernels": kernels[:60], "kernel_ms_per_step": sum(k["ms_per_step"] for k in kernels),
              "host_ops": host, "graph_timeline": timeline}
    del engine, clock
    free_memory()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=1 << 20)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--backends", nargs="+", default=["msa"])
    parser.add_argument("--graph-steps", type=int, default=0,
                        help="graph-replayed steps to profile kernel by kernel (0: none)")
    parser.add_argument("--output", default=None)
    parser.add_argument("--device", choices=("cuda", "cpu"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    report = {b: one_backend(args, b) for b in args.backends}
    if args.output:
        Path(args.output).write_text(json.dumps({"length": args.length, "layers": args.layers,
                                                 "backends": report}, indent=2))
    for backend, r in report.items():
        print(f"\n{backend}: {args.length} tokens, prefill {r['prefill_s']:.1f} s; TPOT median "
              f"{r['tpot_ms_median']:.3f} ms (mean {r['tpot_ms_mean']:.3f}); eager kernels "
              f"{r['kernel_ms_per_step']:.3f} ms/step")
        print("  host ops (self CPU ms per eager step):")
        for h in r["host_ops"][:12]:
            print(f"    {h['self_cpu_ms_per_step']:8.3f}  {h['calls_per_step']:6.1f}x  {h['op'][:80]}")
        print("  kernels (GPU ms per eager step):")
        for k in r["kernels"][:30]:
            print(f"    {k['ms_per_step']:8.4f}  {k['launches_per_step']:6.1f}x  {k['kernel'][:100]}")
        print("  phases with syncs (ms, median): " + "  ".join(f"{p} {v:.3f}" for p, v in
                                                               r["phases_ms_median"].items()))
        timeline = r["graph_timeline"]
        if timeline:
            print(f"  graph-replayed steps under the profiler (ms per step): "
                  f"wall {timeline['wall_ms_per_step']:.3f}"
                  f"  busy {timeline['busy_ms_per_step']:.3f}  gaps<{GAP_US:g}us "
                  f"{timeline['short_gaps_ms_per_step']:.3f}  idle {timeline['long_idle_ms_per_step']:.3f}"
                  f"  launches {timeline['launches_per_step']:.0f}")
            for k in timeline["kernels"][:45]:
                print(f"    {k['ms_per_step']:8.4f}  {k['launches_per_step']:6.1f}x  {k['kernel'][:100]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
