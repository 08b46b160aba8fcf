"""Where an engine step's time goes under agentic traffic: a diagnostic for docs/performance-engine.md.

For each backend, runs the agentic workload closed-loop at one concurrency for a window and times
every `LLMEngine.step` in phases (schedule, step inputs, forward, logits, sampling, the rest), with a
device sync at each phase's end so the forward's GPU time lands in its own phase. Steps are split
into decode-only steps (CUDA-graph replay) and mixed steps (some sequence prefills). Prints a
table and writes JSON (not a results file: the syncs add a little to every step).

    python benchmarks/serving/profile_steps.py --layers 2 --level 8 --window-s 10 --output /tmp/steps.json
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from bench_setup import build_engine, prompt_vocab, sizes_for
from workloads import agentic_prefix, agentic_stream, run_closed_loop, run_to_end

from msaserve.engine import model_runner as runner_module
from msaserve.engine.llm_engine import LLMEngine

PHASES = ("schedule", "inputs", "forward", "logits", "sample", "rest")


class StepClock:
    """Wraps one engine's parts so every step records its phase times."""

    def __init__(self, engine: LLMEngine, device: str) -> None:
        self.engine, self.device = engine, device
        self.steps: list[dict] = []
        self._current: dict | None = None
        self._mark = 0.0
        self._wrap(engine.scheduler, "schedule", "schedule", first=True)
        self._wrap(engine.runner, "forward", "forward")
        self._wrap(engine.runner.model, "compute_logits", "logits")
        self._wrap(engine, "sampler", "sample")
        original = self._original_inputs = runner_module.build_step_inputs

        def inputs(*args, **kwargs):
            out = original(*args, **kwargs)
            self._lap("inputs")
            return out

        runner_module.build_step_inputs = inputs
        step = engine.step

        def timed_step():
            out = step()
            if self._current is not None:
                self._lap("rest")
                self._current["total"] = sum(self._current[p] for p in PHASES)
                self.steps.append(self._current)
                self._current = None
            return out

        engine.step = timed_step

    def close(self) -> None:
        """Give the runner module its own build_step_inputs back (the next clock wraps that, not
        this one's wrapper, whose extra sync would land in the next backend's step times)."""
        runner_module.build_step_inputs = self._original_inputs

    def _sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def _lap(self, phase: str) -> None:
        self._sync()
        now = time.perf_counter()
        if self._current is not None:
            self._current[phase] += now - self._mark
        self._mark = now

    def _wrap(self, owner, attr: str, phase: str, first: bool = False) -> None:
        fn = getattr(owner, attr)

        def wrapped(*args, **kwargs):
            if first:
                self._sync()
                self._mark = time.perf_counter()
                self._current = dict.fromkeys(PHASES, 0.0)
            else:
                self._lap("rest")
            out = fn(*args, **kwargs)
            if first and out is not None and self._current is not None:
                self._current["seqs"] = len(out.seqs)
                self._current["new_tokens"] = int(sum(out.num_new_tokens))
                self._current["mixed"] = any(n > 1 for n in out.num_new_tokens)
            self._lap(phase)
            return out

        setattr(owner, attr, wrapped)


def summarize(steps: list[dict]) -> dict:
    out: dict[str, dict] = {}
    for kind in ("decode", "mixed"):
        chosen = [s for s in steps if s.get("seqs") and s["mixed"] == (kind == "mixed")]
        if not chosen:
            continue
        all_time = sum(s["total"] for s in steps if s.get("seqs"))
        row = {"steps": len(chosen), "time_share": sum(s["total"] for s in chosen) / all_time}
        for phase in (*PHASES, "total"):
            row[f"{phase}_ms_p50"] = 1000 * statistics.median(s[phase] for s in chosen)
            row[f"{phase}_ms_mean"] = 1000 * statistics.fmean(s[phase] for s in chosen)
        row["seqs_mean"] = statistics.fmean(s["seqs"] for s in chosen)
        row["new_tokens_mean"] = statistics.fmean(s["new_tokens"] for s in chosen)
        out[kind] = row
    return out


def profile_kernels(engine: LLMEngine, vocab: int, sizes, args: argparse.Namespace, backend: str) -> None:
    """Run the same traffic for a short window under torch.profiler; print the top kernels by GPU
    time and the step kinds' share (the step clock keeps timing: its syncs stay in)."""
    from torch.profiler import ProfilerActivity, profile

    stream = agentic_stream(vocab, 7, sizes.prefix_len, sizes.append, sizes.output, sizes.turns)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        run_closed_loop(engine, stream, args.level, args.torch_profile_s)
        wall = time.perf_counter() - start
    events = prof.key_averages()
    kernels = sorted((e for e in events if e.device_time_total > 0 and e.device_type.name == "CUDA"),
                     key=lambda e: e.self_device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in kernels) / 1e6
    print(f"\n{backend}: {wall:.1f} s under the profiler, GPU busy {total:.2f} s; top kernels by GPU time")
    for e in kernels[:28]:
        print(f"  {e.self_device_time_total / 1e3:9.1f} ms  {e.count:7d}×  {e.key[:90]}")
    cpu = sorted((e for e in events if e.device_type.name == "CPU"), key=lambda e: e.self_cpu_time_total,
                 reverse=True)
    print(f"{backend}: top host ops by self CPU time")
    for e in cpu[:15]:
        print(f"  {e.self_cpu_time_total / 1e3:9.1f} ms  {e.count:7d}×  {e.key[:90]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--level", type=int, default=8)
    parser.add_argument("--window-s", type=float, default=10.0)
    parser.add_argument("--backends", nargs="+", default=["msa", "dense"])
    parser.add_argument("--output", default=None)
    parser.add_argument("--decode-steps", type=int, default=1, help="EngineConfig.decode_steps")
    parser.add_argument("--torch-profile-s", type=float, default=0.0,
                        help="then run this long under torch.profiler and print the top GPU kernels")
    args = parser.parse_args()
    ns = argparse.Namespace(device="cuda" if torch.cuda.is_available() else "cpu", quick=False,
                            layers=args.layers, session_len=None, mooncake_requests=None,
                            window_s=args.window_s, decode_steps=args.decode_steps)
    sizes = sizes_for(ns)
    report: dict[str, dict] = {}
    for backend in args.backends:
        engine = build_engine(ns, sizes, backend, sizes.max_model_len, max(args.level, 2), sizes.chunk,
                              decode_steps=args.decode_steps)
        vocab = prompt_vocab(engine)
        run_closed_loop(engine, agentic_stream(vocab, 99, sizes.prefix_len, sizes.append, sizes.output,
                                               sizes.turns), 2, sizes.warmup_s or 3.0)
        engine.block_manager.reset_prefix_cache()
        run_to_end(engine, agentic_prefix(vocab, 0, sizes.prefix_len))
        clock = StepClock(engine, ns.device)
        stream = agentic_stream(vocab, 0, sizes.prefix_len, sizes.append, sizes.output, sizes.turns)
        result = run_closed_loop(engine, stream, args.level, args.window_s)
        summary = summarize(clock.steps)
        summary["output_tok_s"] = result.output_tok_s
        if args.torch_profile_s > 0:
            profile_kernels(engine, vocab, sizes, args, backend)
        report[backend] = summary
        clock.close()
        del engine, clock
        torch.cuda.empty_cache() if ns.device == "cuda" else None
    print(f"\nagentic c{args.level}, {sizes.preset} {args.layers} layers, {args.window_s:g} s window, "
          "phase times per step (ms, p50 / mean)")
    columns = (*PHASES, "total")
    header = f"{'backend':<7} {'kind':<7} {'steps':>6} {'share':>6} " + " ".join(f"{p:>13}" for p in columns)
    print(header)
    for backend, summary in report.items():
        for kind in ("decode", "mixed"):
            row = summary.get(kind)
            if row is None:
                continue
            cells = " ".join(f"{row[f'{p}_ms_p50']:6.2f}/{row[f'{p}_ms_mean']:6.2f}" for p in columns)
            print(f"{backend:<7} {kind:<7} {row['steps']:>6} {row['time_share']:>6.2f} {cells}")
        print(f"{backend:<7} output tok/s (with syncs): {summary['output_tok_s']:.0f}")
    if args.output:
        Path(args.output).write_text(json.dumps({"layers": args.layers, "level": args.level,
                                                 "window_s": args.window_s, "backends": report}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
