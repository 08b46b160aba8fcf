"""Where the grouped MoE's time goes (issue #27's `m3.moe_fraction_of_dense_gemm`): each stage of
msaserve/kernels/moe/grouped.py timed inside one pass, and beside each grouped GEMM its floors.

Same setup as bench_moe.py (M3's widths, random bf16 weights, random router logits: every expert
equally likely, router GEMM / shared expert / routed scaling left out). One pass runs the grouped path
stage by stage with a device event between stages (so the stages sum to the pass and each small
stage's launch hides behind the GEMM before it, as in the model); the median of each stage over the
passes after warm-up. The pass's output is checked against `grouped.experts`. Beside each GEMM:
  dense floor:   one `torch.mm` of the same FLOPs and operand layout ([T·k, K] @ one expert's K-major
                 weight), timed in the same run: the GEMM rate of this GPU at this shape (at decode
                 sizes it reads one expert's weights, so there the weight floor is the one that binds);
  weight floor:  the weights of the experts hit at the copy bandwidth (a device-to-device copy timed in
                 the same run, read + write counted, as bench_moe.py's floor);
  balanced:      the same grouped GEMM with the T·k rows spread evenly over the experts instead of
                 the random routing's counts (what load imbalance costs).

  python benchmarks/models/bench_moe_stages.py --git-revision $(git rev-parse --short HEAD) \
      --output benchmarks/results/moe_stages.json   # JSON only with --output; the table always
  python benchmarks/models/bench_moe_stages.py --device cpu   # smoke: tiny widths, seconds
"""

import argparse
import datetime
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_moe import ALPHA, EXPERTS, HIDDEN, INTER, LIMIT, TOP_K

from msaserve.kernels.moe import grouped

STAGES = ("route", "sort_offsets", "gather", "gate_up_gemm", "swiglu", "down_gemm", "combine")
GEMMS = ("gate_up_gemm", "down_gemm")


@dataclass(frozen=True)
class Setup:
    """Widths, token counts and repetitions of one run; `M3` on CUDA, `SMOKE` for the CPU check."""

    hidden: int
    experts: int
    top_k: int
    inter: int
    tokens: tuple[int, ...]
    headline_tokens: int  # the size whose GEMM share is the entry's value
    copy_mib: int
    warmup: int
    reps: int


M3 = Setup(HIDDEN, EXPERTS, TOP_K, INTER, (64, 4096, 8192, 16384), 4096, 1024, 3, 20)
SMOKE = Setup(64, 8, 2, 32, (4, 32, 64), 32, 1, 1, 3)


class Clock:
    """Marks on the device's timeline: CUDA events, or host time on the CPU (where ops are synchronous)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> object:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def elapsed_ms(self, start: object, end: object) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def median_ms(clock: Clock, fn: Callable[[], object], setup: Setup) -> float:
    """Median over `setup.reps` back-to-back calls after `setup.warmup`, each bracketed by marks."""
    for _ in range(setup.warmup):
        fn()
    marks = []
    for _ in range(setup.reps):
        start = clock.mark()
        fn()
        marks.append((start, clock.mark()))
    clock.sync()
    return statistics.median(clock.elapsed_ms(a, b) for a, b in marks)


def staged_pass(clock: Clock, x: torch.Tensor, logits: torch.Tensor, weights: tuple[torch.Tensor, ...],
                top_k: int) -> tuple[list[object], torch.Tensor]:
    """grouped.experts(route(...)) split at its stages, a mark before and after each (keep in step
    with grouped.experts: measure() checks the output equal)."""
    gate_up, down, bias = weights
    marks = [clock.mark()]
    route_weights, ids = grouped.route(logits, bias, top_k)
    marks.append(clock.mark())
    layout = grouped.expert_rows(ids, gate_up.shape[0])
    marks.append(clock.mark())
    rows = x.index_select(0, layout.token_of_row)  # [T·k, H]
    marks.append(clock.mark())
    gate_up_rows = grouped.grouped_matmul(rows, gate_up.transpose(1, 2), layout.expert_ends)  # [T·k, 2I]
    marks.append(clock.mark())
    hidden = grouped.clamped_swiglu(gate_up_rows, ALPHA, LIMIT)  # [T·k, I]
    marks.append(clock.mark())
    out_rows = grouped.grouped_matmul(hidden, down.transpose(1, 2), layout.expert_ends)  # [T·k, H]
    marks.append(clock.mark())
    out = grouped.combine(out_rows, layout.row_of_slot, route_weights, x.dtype)
    marks.append(clock.mark())
    return marks, out


def stage_medians(clock: Clock, run: Callable[[], tuple[list[object], torch.Tensor]],
                  setup: Setup) -> dict[str, float]:
    for _ in range(setup.warmup):
        run()
    passes = [run()[0] for _ in range(setup.reps)]
    clock.sync()
    stages = {name: statistics.median(clock.elapsed_ms(m[i], m[i + 1]) for m in passes)
              for i, name in enumerate(STAGES)}
    stages["total"] = statistics.median(clock.elapsed_ms(m[0], m[-1]) for m in passes)
    return stages


def balanced_ends(rows: int, experts: int, device: torch.device) -> torch.Tensor:
    """expert_ends [E] int32 with `rows` spread evenly (counts differ by at most one)."""
    return ((torch.arange(1, experts + 1, device=device) * rows) // experts).to(torch.int32)


def measure(clock: Clock, setup: Setup, tokens: int, weights: tuple[torch.Tensor, ...],
            copy_tbps: float) -> dict:
    gate_up, down, bias = weights
    device, dtype = gate_up.device, gate_up.dtype
    logits = torch.randn(tokens, setup.experts, device=device)
    x = torch.randn(tokens, setup.hidden, device=device, dtype=dtype)
    torch.testing.assert_close(staged_pass(clock, x, logits, weights, setup.top_k)[1],
                               grouped_path(x, logits, weights, setup.top_k),
                               msg="the staged pass no longer computes grouped.experts: update staged_pass")
    stages = stage_medians(clock, lambda: staged_pass(clock, x, logits, weights, setup.top_k), setup)

    layout = grouped.expert_rows(grouped.route(logits, bias, setup.top_k)[1], setup.experts)
    counts = torch.diff(layout.expert_ends, prepend=layout.expert_ends.new_zeros(1))
    hit = int((counts > 0).sum())
    rows = x.index_select(0, layout.token_of_row)  # [T·k, H]
    gate_up_rows = grouped.grouped_matmul(rows, gate_up.transpose(1, 2), layout.expert_ends)
    hidden = grouped.clamped_swiglu(gate_up_rows, ALPHA, LIMIT)  # [T·k, I]
    floors = GemmFloors(clock, setup, hit, copy_tbps)
    gemms = {"gate_up_gemm": floors.of(rows, gate_up, stages["gate_up_gemm"]),
             "down_gemm": floors.of(hidden, down, stages["down_gemm"])}
    return {"tokens": tokens, "experts_hit": hit, "rows_per_expert_mean": rows.shape[0] / setup.experts,
            "rows_per_expert_max": int(counts.max()), "stages_ms": stages, "gemms": gemms,
            "gemm_fraction": sum(stages[g] for g in GEMMS) / stages["total"],
            "fraction_of_dense_floor": sum(gemms[g]["dense_floor_ms"] for g in GEMMS) / stages["total"],
            "grouped_alone_ms": median_ms(clock, lambda: grouped_path(x, logits, weights, setup.top_k),
                                          setup)}


@dataclass(frozen=True)
class GemmFloors:
    """One grouped GEMM's comparisons at one size (see the module docstring)."""

    clock: Clock
    setup: Setup
    experts_hit: int
    copy_tbps: float

    def of(self, lhs: torch.Tensor, weight: torch.Tensor, random_ms: float) -> dict[str, float]:
        """lhs [T·k, K] in expert order, weight [E, M, K] as stored, random_ms: its time in the pass."""
        weight_t = weight.transpose(1, 2)  # [E, K, M], K-major: what grouped.experts passes
        even = balanced_ends(lhs.shape[0], weight.shape[0], lhs.device)
        weight_bytes = self.experts_hit * weight[0].numel() * weight.element_size()
        return {
            "random_ms": random_ms,
            "balanced_ms": median_ms(self.clock, lambda: grouped.grouped_matmul(lhs, weight_t, even),
                                     self.setup),
            "dense_floor_ms": median_ms(self.clock, lambda: torch.mm(lhs, weight_t[0]), self.setup),
            "weight_floor_ms": weight_bytes / self.copy_tbps / 1e9,
            "tflops": 2 * lhs.shape[0] * weight[0].numel() / random_ms / 1e9,
        }


def grouped_path(x: torch.Tensor, logits: torch.Tensor, weights: tuple[torch.Tensor, ...],
                 top_k: int) -> torch.Tensor:
    """route + experts as the model calls them (bench_moe.py's `fast`)."""
    gate_up, down, bias = weights
    route_weights, ids = grouped.route(logits, bias, top_k)
    return grouped.experts(x, gate_up, down, ids, route_weights, ALPHA, LIMIT)


def copy_bandwidth_tbps(clock: Clock, setup: Setup, device: torch.device) -> float:
    """Device-to-device copy, read + write counted (as bench_moe.py's floor)."""
    src = torch.randn(setup.copy_mib * 2**20 // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / median_ms(clock, lambda: dst.copy_(src), setup) / 1e9


def hardware_name(device: torch.device) -> str:
    if device.type != "cuda":
        return f"cpu smoke (tiny widths), torch {torch.__version__}"
    gib = torch.cuda.get_device_properties(device).total_memory / 2**30
    return f"{torch.cuda.get_device_name(device)} ({gib:.0f} GiB), torch {torch.__version__}"


def entry(rows: list[dict], setup: Setup, common: dict) -> dict:
    head = next(r for r in rows if r["tokens"] == setup.headline_tokens)
    keys = ("stages_ms", "gemms", "experts_hit", "rows_per_expert_max", "rows_per_expert_mean")
    table = {str(r["tokens"]): {key: r[key] for key in keys} for r in rows}
    gemm_notes = "; ".join(
        f"{name} {g['random_ms']:.3f} ms (balanced loads {g['balanced_ms']:.3f}, dense-rate floor "
        f"{g['dense_floor_ms']:.3f}, weight-read floor {g['weight_floor_ms']:.3f})"
        for name, g in head["gemms"].items())
    note = (f"{setup.headline_tokens} tokens: the two grouped GEMMs take {head['gemm_fraction']:.3f} of the "
            f"grouped pass ({head['stages_ms']['total']:.3f} ms); {gemm_notes}; busiest expert "
            f"{head['rows_per_expert_max']} rows vs mean {head['rows_per_expert_mean']:.0f}")
    return {**common, "value": round(head["gemm_fraction"], 3), "unit": "fraction", "note": note,
            "table": table}


def print_tables(rows: list[dict], copy_tbps: float, hardware: str) -> None:
    print(f"\n{hardware}; copy {copy_tbps:.2f} TB/s (read + write)")
    print("GEMMs, ms: random routing / balanced loads / dense-rate floor / weight-read floor")
    for r in rows:
        cells = "  ".join(f"{g} {v['random_ms']:.3f} / {v['balanced_ms']:.3f} / {v['dense_floor_ms']:.3f} / "
                          f"{v['weight_floor_ms']:.3f}" for g, v in r["gemms"].items())
        print(f"{r['tokens']:>6}  {cells}  (rows/expert max {r['rows_per_expert_max']}, "
              f"mean {r['rows_per_expert_mean']:.0f})")
    print("\nstages of one grouped pass, median ms")
    names = (*STAGES, "total")
    print(f"{'tokens':>6} " + " ".join(f"{n:>12}" for n in names) + f" {'GEMM share':>10}")
    for r in rows:
        print(f"{r['tokens']:>6} " + " ".join(f"{r['stages_ms'][n]:>12.4f}" for n in names)
              + f" {r['gemm_fraction']:>10.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--git-revision", default="unknown")
    parser.add_argument("--device", default="cuda", help="cuda: M3 widths; cpu: tiny widths (smoke)")
    parser.add_argument("--output", type=Path, help="write the JSON here (the table is always printed)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    setup = M3 if device.type == "cuda" else SMOKE
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    clock = Clock(device)
    gate_up = torch.randn(setup.experts, 2 * setup.inter, setup.hidden, device=device, dtype=dtype)
    down = torch.randn(setup.experts, setup.hidden, setup.inter, device=device, dtype=dtype)
    weights = (gate_up.mul_(setup.hidden**-0.5), down.mul_(setup.inter**-0.5),
               torch.randn(setup.experts, device=device) * 0.01)
    with torch.inference_mode():
        copy_tbps = copy_bandwidth_tbps(clock, setup, device)
        rows = []
        for tokens in setup.tokens:
            rows.append(measure(clock, setup, tokens, weights, copy_tbps))
            print(json.dumps(rows[-1]), flush=True)
    hardware = hardware_name(device)
    if args.output:
        command = f"python benchmarks/models/bench_moe_stages.py --git-revision {args.git_revision}"
        if device.type != "cuda":
            command += f" --device {args.device}"
        common = {"command": command, "hardware": hardware, "git_revision": args.git_revision,
                  "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}
        doc = {"m3.moe_stage_breakdown": entry(rows, setup, common), **common, "copy_tbps": copy_tbps,
               "setup": asdict(setup), "rows": rows}
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(doc, indent=1) + "\n")
    print_tables(rows, copy_tbps, hardware)
    return 0


if __name__ == "__main__":
    sys.exit(main())
