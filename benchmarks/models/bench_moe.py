"""MiniMax-M3's routed MoE (hidden 6144, 128 experts, top-4, intermediate 3072, bf16): the grouped
path (msaserve/kernels/moe/grouped.py) against the per-expert loop (the spec, moe/naive.py; a copy
of transformers' MiniMaxM3VLExperts loop where the spec is absent) and against one bf16 GEMM of the
same FLOP count ([T·k, 6144] @ [6144, 3·3072]).

Each size times route + experts (router logits given; the router GEMM, the shared expert and the
routed scaling are the model's). Decode sizes are also timed as a replayed CUDA graph (the loop
cannot be captured: its shapes depend on the routing). Random routing: every expert equally likely.
The floor is the bytes that must be read (the weights of every expert hit, activations in and out)
over the copy bandwidth measured in the same run.

  python benchmarks/models/bench_moe.py --git-revision $(git rev-parse --short HEAD)
"""

import argparse
import datetime
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from msaserve.kernels.moe import grouped

HIDDEN, EXPERTS, TOP_K, INTER = 6144, 128, 4, 3072
ALPHA, LIMIT = 1.702, 7.0
DECODE, PREFILL = (8, 16, 32, 64, 128, 256), (4096, 8192, 16384)
DEVICE = "cuda"
STEPS = ("route", "sort_and_gather", "gate_up_gemm", "swiglu", "down_gemm", "combine")


def loop_ops() -> tuple[str, Callable, Callable]:
    """The spec's route and experts if m3-text's moe/naive.py is on this branch, else HF's loop."""
    try:
        from msaserve.kernels.moe import naive

        return "msaserve.kernels.moe.naive", naive.route, naive.experts
    except ImportError:
        return "transformers MiniMaxM3VLExperts loop (copied)", hf_route, hf_experts


def hf_route(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int) -> tuple[torch.Tensor, ...]:
    scores = torch.sigmoid(logits.float())
    ids = torch.topk(scores if bias is None else scores + bias, top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    return weights / weights.sum(dim=-1, keepdim=True), ids


def hf_experts(x, gate_up, down, ids, weights, swiglu_alpha, swiglu_limit) -> torch.Tensor:
    final = torch.zeros_like(x)
    mask = F.one_hot(ids, num_classes=gate_up.shape[0]).permute(2, 1, 0)  # [E, k, T]
    for expert in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
        slot, token = torch.where(mask[expert[0]])
        gate, up = F.linear(x[token], gate_up[expert[0]]).chunk(2, dim=-1)
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
        hidden = (up + 1.0) * gate * torch.sigmoid(gate * swiglu_alpha)
        current = F.linear(hidden, down[expert[0]]) * weights[token, slot, None]
        final.index_add_(0, token, current.to(final.dtype))
    return final


def median_ms(fn: Callable[[], object]) -> float:
    return float(do_bench(fn, warmup=25, rep=300, return_mode="median"))


def graph_ms(fn: Callable[[], object]) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_ms(graph.replay)


def ceilings() -> tuple[float, float]:
    """(copy TB/s counting read + write, bf16 8192³ GEMM TFLOP/s) on random data."""
    src = torch.randn(2 * 1024**3 // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_tbps = 2 * src.numel() * 2 / median_ms(lambda: dst.copy_(src)) / 1e9
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    gemm_tflops = 2 * 8192**3 / median_ms(lambda: a @ b) / 1e9
    return copy_tbps, gemm_tflops


def measure(tokens: int, weights: tuple[torch.Tensor, ...], loop: tuple, copy_tbps: float) -> dict:
    gate_up, down, bias = weights
    _, loop_route, loop_experts = loop
    logits = torch.randn(tokens, EXPERTS, device=DEVICE)
    x = torch.randn(tokens, HIDDEN, device=DEVICE, dtype=torch.bfloat16)

    def fast() -> torch.Tensor:
        w, ids = grouped.route(logits, bias, TOP_K)
        return grouped.experts(x, gate_up, down, ids, w, ALPHA, LIMIT)

    def slow() -> torch.Tensor:
        w, ids = loop_route(logits, bias, TOP_K)
        return loop_experts(x, gate_up, down, ids, w, ALPHA, LIMIT)

    out_fast, out_slow = fast().float(), slow().float()
    agreement = float((out_fast - out_slow).norm() / out_slow.norm())
    a = torch.randn(tokens * TOP_K, HIDDEN, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(HIDDEN, 3 * INTER, device=DEVICE, dtype=torch.bfloat16)
    flops = 2 * tokens * TOP_K * HIDDEN * 3 * INTER
    hit = int(torch.unique(grouped.route(logits, bias, TOP_K)[1]).numel())
    floor_bytes = hit * 3 * HIDDEN * INTER * 2 + tokens * HIDDEN * 2 * 2
    row = {"tokens": tokens, "phase": "decode" if tokens <= max(DECODE) else "prefill", "experts_hit": hit,
           "grouped_ms": median_ms(fast), "loop_ms": median_ms(slow),
           "dense_gemm_ms": median_ms(lambda: a @ b),
           "floor_ms": floor_bytes / copy_tbps / 1e9, "relative_difference_vs_loop": agreement}
    if row["phase"] == "decode":
        row["grouped_graph_ms"] = graph_ms(fast)
    row["stages_ms"] = stage_ms(x, logits, gate_up, down, bias)
    best = row.get("grouped_graph_ms", row["grouped_ms"])
    row.update(
        speedup_vs_loop=row["loop_ms"] / row["grouped_ms"],
        speedup_vs_loop_graph=row["loop_ms"] / best,
        fraction_of_dense_gemm=row["dense_gemm_ms"] / row["grouped_ms"],
        fraction_of_floor=row["floor_ms"] / best,
        grouped_tflops=flops / row["grouped_ms"] / 1e9,
        dense_gemm_tflops=flops / row["dense_gemm_ms"] / 1e9,
    )
    return row


def stage_ms(x: torch.Tensor, logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
             bias: torch.Tensor) -> dict[str, float]:
    """Each step of the grouped path timed alone (eager, so small steps include a launch)."""
    weights, ids = grouped.route(logits, bias, TOP_K)
    layout = grouped.expert_rows(ids, EXPERTS)
    rows = x.index_select(0, layout.token_of_row)
    gate_up_rows = grouped.grouped_matmul(rows, gate_up.transpose(1, 2), layout.expert_ends)
    hidden = grouped.clamped_swiglu(gate_up_rows, ALPHA, LIMIT)
    out_rows = grouped.grouped_matmul(hidden, down.transpose(1, 2), layout.expert_ends)
    up_t, down_t, ends = gate_up.transpose(1, 2), down.transpose(1, 2), layout.expert_ends
    steps = {
        "route": lambda: grouped.route(logits, bias, TOP_K),
        "sort_and_gather": lambda: x.index_select(0, grouped.expert_rows(ids, EXPERTS).token_of_row),
        "gate_up_gemm": lambda: grouped.grouped_matmul(rows, up_t, ends),
        "swiglu": lambda: grouped.clamped_swiglu(gate_up_rows, ALPHA, LIMIT),
        "down_gemm": lambda: grouped.grouped_matmul(hidden, down_t, ends),
        "combine": lambda: grouped.combine(out_rows, layout.row_of_slot, weights, x.dtype),
    }
    return {name: median_ms(step) for name, step in steps.items()}


def summary_entries(rows: list[dict], common: dict) -> dict:
    by_tokens = {r["tokens"]: r for r in rows}
    d64 = by_tokens.get(64)
    prefill = [r for r in rows if r["phase"] == "prefill"]
    doc = {}
    if d64:
        doc["m3.moe_grouped_vs_loop"] = {
            **common, "value": round(d64["speedup_vs_loop_graph"], 2), "unit": "x",
            "note": (f"decode batch 64, route + experts: per-expert loop (eager) {d64['loop_ms']:.3f} ms / "
                     f"grouped replayed as a CUDA graph {d64['grouped_graph_ms']:.3f} ms; grouped eager "
                     f"{d64['grouped_ms']:.3f} ms ({d64['speedup_vs_loop']:.2f}x). {d64['experts_hit']} of "
                     f"{EXPERTS} experts hit; reading their weights: {d64['floor_ms']:.3f} ms at the copy "
                     f"bandwidth (floor), so grouped runs at {d64['fraction_of_floor']:.2f} of the floor"),
        }
    if prefill:
        worst = min(prefill, key=lambda r: r["fraction_of_dense_gemm"])
        doc["m3.moe_fraction_of_dense_gemm"] = {
            **common, "value": round(worst["fraction_of_dense_gemm"], 3), "unit": "fraction",
            "note": "lowest over prefill sizes of (one bf16 GEMM of the same FLOPs) / (grouped route + "
                    "experts); per size: " + ", ".join(
                        f"{r['tokens']} tokens {r['fraction_of_dense_gemm']:.3f} ({r['grouped_tflops']:.0f} "
                        f"vs {r['dense_gemm_tflops']:.0f} TFLOP/s; grouped {r['grouped_ms']:.3f} ms, dense "
                        f"{r['dense_gemm_ms']:.3f} ms, reading the {r['experts_hit']} experts' weights "
                        f"{r['floor_ms']:.3f} ms)" for r in prefill),
        }
    return doc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--git-revision", default="unknown")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    parser.add_argument("--tokens", default=",".join(map(str, DECODE + PREFILL)))
    args = parser.parse_args()
    torch.manual_seed(0)
    copy_tbps, gemm_tflops = ceilings()
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=DEVICE, dtype=torch.bfloat16) * HIDDEN**-0.5
    down = torch.randn(EXPERTS, HIDDEN, INTER, device=DEVICE, dtype=torch.bfloat16) * INTER**-0.5
    bias = torch.randn(EXPERTS, device=DEVICE) * 0.01
    loop = loop_ops()
    rows, failed = [], []
    with torch.inference_mode():
        for tokens in map(int, args.tokens.split(",")):
            try:
                rows.append(measure(tokens, (gate_up, down, bias), loop, copy_tbps))
                print(json.dumps(rows[-1]), flush=True)
            except Exception as exc:  # one size failing must not lose the others' numbers
                print(f"{tokens} tokens failed: {exc!r}", flush=True)
                failed.append({"tokens": tokens, "error": repr(exc)[:500]})
    memory_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    hardware = (f"{torch.cuda.get_device_name()} ({memory_gib:.0f} GiB), torch {torch.__version__}, "
                f"triton {triton.__version__}")
    common = {"command": f"python benchmarks/models/bench_moe.py --git-revision {args.git_revision}",
              "hardware": hardware, "git_revision": args.git_revision,
              "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}
    shape = {"hidden": HIDDEN, "experts": EXPERTS, "top_k": TOP_K, "intermediate": INTER, "dtype": "bfloat16"}
    doc = {**summary_entries(rows, common), **common, "loop": loop[0], "copy_tbps": copy_tbps,
           "gemm_8192_tflops": gemm_tflops, "shape": shape, "rows": rows,
           "failed": failed}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "moe.json").write_text(json.dumps(doc, indent=1) + "\n")
    print("\nsteps of the grouped path alone, eager ms: " + " ".join(STEPS))
    for r in rows:
        print(f"{r['tokens']:>6} " + " ".join(f"{r['stages_ms'][step]:>{len(step)}.3f}" for step in STEPS))
    print(f"\n{hardware}; copy {copy_tbps:.2f} TB/s; bf16 GEMM 8192³ {gemm_tflops:.0f} TFLOP/s; "
          f"loop = {loop[0]}")
    print(f"{'tokens':>6} {'hit':>4} {'loop ms':>9} {'grouped':>9} {'graph':>9} {'dense':>9} {'floor':>8} "
          f"{'x loop':>7} {'x graph':>7} {'/dense':>6} {'/floor':>6} {'TFLOP/s':>7}")
    for r in rows:
        print(f"{r['tokens']:>6} {r['experts_hit']:>4} {r['loop_ms']:>9.3f} {r['grouped_ms']:>9.3f} "
              f"{r.get('grouped_graph_ms', float('nan')):>9.3f} {r['dense_gemm_ms']:>9.3f} "
              f"{r['floor_ms']:>8.3f} "
              f"{r['speedup_vs_loop']:>7.2f} {r['speedup_vs_loop_graph']:>7.2f} "
              f"{r['fraction_of_dense_gemm']:>6.3f} {r['fraction_of_floor']:>6.3f} "
              f"{r['grouped_tflops']:>7.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
