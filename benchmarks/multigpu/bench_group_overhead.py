"""What the multi-rank replica's machinery costs a decode step, measured where it is alone: TP 1 /
EP 1 through the group path (the driver's GroupRunner builds the step on the host and sends one
StepMessage; a RankWorker in an NCCL group of one runs it and returns rank 0's greedy tokens, or its
logits for requests sampled on the host) against the plain single-GPU engine (ModelRunner): the same
(rank's) model, each engine its own page pool, the same batches.

Model: MiniMax-M3's widths (hidden 6144, 64 query / 4 KV heads of 128, index head 128, 128 experts
top-4 of width 3072, shared expert 3072, dense MLP 12288, vocab 200064), bf16, random weights,
--layers layers (the first with the dense MLP, the rest MoE; every layer MSA as m3-mini, or with
--full-attention-first the first attending densely). Dense layers decode through the `msa` backend's
SDPA dense_decode, which reads sequence offsets on the host: no CUDA graph captures on either path
then (the first H200 run); all-MSA layers capture (m3-mini's runs). Ray is not on the H200
image, so the rank runs in-process behind LocalGroup, which pickles and unpickles every call's
arguments and result as Ray's transport would (the actor call's own latency is not in this number:
see docs/scaling.md).

Timing: both engines hold the same batch (every sequence at ~--context tokens) at once, prefilled
first; then the two engines step in turns, one engine.step() each per pair (plain first in even
pairs, group first in odd ones), --warmup pairs untimed, then --steps timed pairs, wall time per step
with a device sync. Interleaving step by step puts any slow phase of the machine on both paths alike
(a first H200 run of whole 25-step runs per path saw runs alternate 5× in speed). Per path: the
median of its timed steps; overhead = group median / plain median − 1; beside it the median and
quartiles of the per-pair ratios (the noise). --raw writes every step's time. Whether each path
replays CUDA graphs is recorded (a failed capture's warning too). `--tiny` runs a small config on
the CPU (gloo).

  python benchmarks/multigpu/bench_group_overhead.py --git-revision $(git rev-parse --short HEAD)
"""

import argparse
import datetime
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from msaserve.engine.config import EngineConfig
from msaserve.engine.llm_engine import LLMEngine
from msaserve.engine.parallel.local import LocalGroup
from msaserve.engine.parallel.runner import GroupRunner
from msaserve.engine.parallel.worker import RankWorker, free_address
from msaserve.engine.types import GenerateRequest, SamplingParams
from msaserve.models.minimax_m3.config import TEXT_MODEL_TYPE, m3_config_from_hf
from msaserve.models.minimax_m3.model import M3ForCausalLM

RESULTS = Path(__file__).resolve().parents[1] / "results" / "multigpu.json"
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=32, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, dense_intermediate_size=96, shared_intermediate_size=32,
            num_local_experts=8, index_n_heads=2, index_head_dim=16, index_block_size=16,
            index_topk_blocks=4, bos_token_id=1, eos_token_id=2)


def build_model(layers: int, tiny: bool, device: str, full_first: bool = False) -> M3ForCausalLM:
    first = "full_attention" if full_first else "minimax_m3_sparse"
    raw = dict(model_type=TEXT_MODEL_TYPE, num_hidden_layers=layers, **(TINY if tiny else {}),
               layer_types=[first] + ["minimax_m3_sparse"] * (layers - 1),
               mlp_layer_types=["dense"] + ["sparse"] * (layers - 1))
    config = m3_config_from_hf(raw)
    dtype = torch.float32 if tiny else torch.bfloat16
    torch.set_default_dtype(dtype)
    with torch.device(device):
        model = M3ForCausalLM(config, "msa")
    torch.set_default_dtype(torch.float32)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("correction_bias"):
                param.zero_()
            else:
                param.normal_(0.0, param.shape[-1] ** -0.5, generator=generator)
    return model.eval()


def engine_config(args) -> EngineConfig:
    """One config (pool sized for the largest batch) for every engine, plain and group."""
    page, batch = (16 if args.tiny else 128), max(args.batches)
    per_seq = -(-(args.context + args.warmup + args.steps + 200) // page)
    return EngineConfig(
        model="m3-bench", device=args.device, dtype="float32" if args.tiny else "bfloat16",
        attention_backend="msa", num_pages=batch * per_seq + 8, max_num_seqs=batch,
        max_num_batched_tokens=8192, max_model_len=per_seq * page, enable_prefix_caching=False,
    )


class GraphWarnings(logging.Handler):
    """Keeps the CUDA graph capture warnings (why a path decodes without graphs)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage()[:300])


def fill(engine: LLMEngine, args, batch: int) -> None:
    """Add `batch` requests of --context random tokens and prefill (chunked) until every sequence
    samples each step."""
    # Early sequences decode while later ones prefill: room for those tokens too.
    max_tokens = args.warmup + args.steps + 150
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    generator = torch.Generator().manual_seed(batch)
    vocab = engine.model.config.vocab_size
    for i in range(batch):
        ids = torch.randint(3, vocab, (args.context,), generator=generator).tolist()
        engine.add_request(GenerateRequest(f"b{batch}-{i}", ids, sampling))
    while len(engine.step()) < batch:
        pass


def step_ms(engine: LLMEngine, args, batch: int) -> float:
    """One engine.step() (every sequence decodes) → its wall time, ms."""
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    outputs = engine.step()
    sync()
    elapsed = (time.perf_counter() - start) * 1e3
    assert len(outputs) == batch
    return elapsed


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, q2, q3 = statistics.quantiles(values, n=4)
    return q1, q2, q3


def measure_batch(engines: dict[str, LLMEngine], args, batch: int) -> dict:
    for engine in engines.values():
        fill(engine, args, batch)
    steps: dict[str, list[float]] = {name: [] for name in engines}
    for pair in range(args.warmup + args.steps):
        order = ("plain", "group") if pair % 2 == 0 else ("group", "plain")
        for name in order:
            elapsed = step_ms(engines[name], args, batch)
            if pair >= args.warmup:
                steps[name].append(elapsed)
    for engine in engines.values():
        for request_id in list(engine.trackers):
            engine.abort(request_id)
    plain, group = statistics.median(steps["plain"]), statistics.median(steps["group"])
    ratios = [g / p - 1.0 for g, p in zip(steps["group"], steps["plain"], strict=True)]
    return {"plain_ms": plain, "group_ms": group, "overhead": group / plain - 1.0,
            "pair_quartiles": quartiles(ratios), "steps_ms": steps}


def measure(args) -> tuple[dict, dict]:
    warnings = GraphWarnings()
    logging.getLogger("msaserve.engine.cuda_graphs").addHandler(warnings)
    config = engine_config(args)
    worker = RankWorker(config, 0)
    worker.join(free_address())
    # TP 1 / EP 1: the rank keeps the whole model (its MoE behind ParallelMoE); the plain engine
    # runs the same (rank's) weights.
    model = build_model(args.layers, args.tiny, args.device, args.full_attention_first)
    info = worker.take_model(model, None)
    runner = GroupRunner(LocalGroup(worker, info, serialize=True), config)
    engines = {"group": LLMEngine(config, model=runner.model, runner=runner),
               "plain": LLMEngine(config, model=worker.runner.model)}
    graphs = {"plain": engines["plain"].runner.graphs is not None, "group": worker.runner.graphs is not None,
              "capture_warnings": sorted(set(warnings.messages))}
    results = {b: measure_batch(engines, args, b) for b in args.batches}
    worker.shutdown()
    return results, graphs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--full-attention-first", action="store_true",
                        help="the first layer full attention (M3's pattern) instead of MSA (m3-mini's)")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=120, help="timed step pairs (plain, group) per batch")
    parser.add_argument("--warmup", type=int, default=10, help="untimed step pairs first")
    parser.add_argument("--raw", type=Path, default=None, help="where to write every step's time (JSON)")
    parser.add_argument("--tiny", action="store_true", help="a small config on the CPU (gloo), a dry run")
    parser.add_argument("--git-revision", default="unknown")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    args.device = "cpu" if args.tiny else "cuda"
    results, graphs = measure(args)
    write_results(args, results, graphs)
    print(f"CUDA graphs: plain {graphs['plain']}, group {graphs['group']}; {graphs['capture_warnings']}")
    if args.raw is not None:
        args.raw.write_text(json.dumps({b: r["steps_ms"] for b, r in results.items()}) + "\n")
    print(f"{'batch':>6} {'plain ms':>10} {'group ms':>10} {'overhead':>9}  per-pair ratio q1 / median / q3")
    for b, r in results.items():
        q = " / ".join(f"{100 * x:+.1f}%" for x in r["pair_quartiles"])
        print(f"{b:>6} {r['plain_ms']:>10.3f} {r['group_ms']:>10.3f} {100 * r['overhead']:>+8.2f}%  {q}")
    return 0


def write_results(args, results: dict, graphs: dict) -> None:
    hardware = (f"{torch.cuda.get_device_name()}, torch {torch.__version__}" if args.device == "cuda"
                else f"CPU, torch {torch.__version__}")
    command = "python benchmarks/multigpu/bench_group_overhead.py " + " ".join(sys.argv[1:])
    stamp = dict(command=command, hardware=hardware, git_revision=args.git_revision,
                 date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
    first = "first layer full attention" if args.full_attention_first else "every layer MSA"
    shape = ("tiny (CPU)" if args.tiny
             else f"M3 widths, {args.layers} layers ({first}), bf16, context {args.context}")
    per_batch = "; ".join(
        f"batch {b}: plain {r['plain_ms']:.3f} ms, group {r['group_ms']:.3f} ms, {100 * r['overhead']:+.2f}% "
        f"(per-pair ratio quartiles {' / '.join(f'{100 * x:+.1f}%' for x in r['pair_quartiles'])})"
        for b, r in results.items()
    )
    worst = max(results, key=lambda b: results[b]["overhead"])
    warned = "; ".join(graphs["capture_warnings"])
    capture = (f"CUDA graphs replayed: plain {graphs['plain']}, group {graphs['group']}"
               + (f" (capture: {warned})" if warned else ""))
    note = (f"decode step (engine.step) through the group path at TP 1 / EP 1 (NCCL group of one, "
            f"in-process rank, pickled calls, greedy tokens sampled on the rank) vs the plain engine, "
            f"medians of {args.steps} interleaved step pairs (after {args.warmup} warm-up pairs), "
            f"worst batch ({worst}); {shape}; {per_batch}. {capture}. Target <= 3%. "
            "Excludes Ray's actor-call latency (Ray is not on the H200 image; docs/scaling.md).")
    out = {"multigpu.group_overhead_tp1": {
        **stamp, "value": round(100 * results[worst]["overhead"], 2), "unit": "%", "note": note}}
    for b, r in results.items():
        out[f"multigpu.decode_step_ms_group_tp1_b{b}"] = {
            **stamp, "value": round(r["group_ms"], 3), "unit": "ms",
            "note": f"{shape}; plain engine {r['plain_ms']:.3f} ms (interleaved with these steps)"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
