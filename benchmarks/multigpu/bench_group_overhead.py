"""What the multi-rank replica's machinery costs a decode step, measured where it is alone: TP 1 /
EP 1 through the group path (the driver's GroupRunner builds the step on the host and sends one
StepMessage; a RankWorker in an NCCL group of one runs it and returns rank 0's logits) against the
plain single-GPU engine (ModelRunner), same model, same pages, same batches, CUDA graphs on.

Model: MiniMax-M3's widths (hidden 6144, 64 query / 4 KV heads of 128, index head 128, 128 experts
top-4 of width 3072, shared expert 3072, dense MLP 12288, vocab 200064), bf16, random weights,
--layers layers (first: full attention + dense MLP; the rest: MSA + MoE). Ray is not on the H200
image, so the rank runs in-process and each call's arguments are pickled and unpickled as Ray's
object store would (the actor call's own latency is not in this number: see docs/scaling.md).

Timing: engine.step() of a batch in steady decode (every sequence at --context tokens), wall time
with a device sync, median of --steps after --warmup; plain before and after the group run, and the
ratio is against the faster plain. `--tiny` runs a small config on the CPU (gloo), to try the script.

  python benchmarks/multigpu/bench_group_overhead.py --git-revision $(git rev-parse --short HEAD)
"""

import argparse
import datetime
import gc
import json
import pickle
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from msaserve.engine.config import EngineConfig
from msaserve.engine.llm_engine import LLMEngine
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


class InProcessGroup:
    """WorkerGroup's calls on one rank in this process; arguments pickled and unpickled per call."""

    def __init__(self, worker: RankWorker, info: dict) -> None:
        self.worker, self.ranks = worker, [info]
        self.full_config, self.tokenizer = worker.full_config, None

    def call_all(self, method: str, *args):
        return [getattr(self.worker, method)(*pickle.loads(pickle.dumps(args)))]

    def call_one(self, rank: int, method: str, *args):
        return getattr(self.worker, method)(*pickle.loads(pickle.dumps(args)))

    def shutdown(self) -> None:
        self.worker.shutdown()


def build_model(layers: int, tiny: bool, device: str) -> M3ForCausalLM:
    raw = dict(model_type=TEXT_MODEL_TYPE, num_hidden_layers=layers, **(TINY if tiny else {}),
               layer_types=["full_attention"] + ["minimax_m3_sparse"] * (layers - 1),
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


def decode_step_ms(engine: LLMEngine, args, batch: int) -> float:
    """Median wall time of engine.step() with `batch` sequences decoding at ~--context tokens."""
    # Early sequences decode while later ones prefill: room for those tokens too.
    sampling = SamplingParams(max_tokens=args.warmup + args.steps + 150, temperature=0.0, ignore_eos=True)
    generator = torch.Generator().manual_seed(batch)
    vocab = engine.model.config.vocab_size
    for i in range(batch):
        ids = torch.randint(3, vocab, (args.context,), generator=generator).tolist()
        engine.add_request(GenerateRequest(f"b{batch}-{i}", ids, sampling))
    while len(engine.step()) < batch:  # prefill (chunked) until every sequence samples each step
        pass
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    times = []
    for _ in range(args.warmup + args.steps):
        sync()
        start = time.perf_counter()
        outputs = engine.step()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
        assert len(outputs) == batch
    for request_id in list(engine.trackers):
        engine.abort(request_id)
    return statistics.median(times[args.warmup:])


def measure(args) -> dict:
    model, config = build_model(args.layers, args.tiny, args.device), engine_config(args)
    plain: dict[int, list[float]] = {b: [] for b in args.batches}
    group: dict[int, float] = {}

    def plain_run(model) -> None:
        for batch in args.batches:
            plain[batch].append(decode_step_ms(LLMEngine(config, model=model), args, batch))
            _free()

    plain_run(model)
    worker = RankWorker(config, 0)
    worker.join(free_address())
    info = worker.take_model(model, None)  # TP 1 / EP 1: the same weights, the MoE behind ParallelMoE
    for batch in args.batches:
        runner = GroupRunner(InProcessGroup(worker, info), config)
        group[batch] = decode_step_ms(LLMEngine(config, model=runner.model, runner=runner), args, batch)
    plain_run(worker.runner.model)  # plain again, on the rank's model
    worker.shutdown()
    return {b: {"plain_ms": min(plain[b]), "plain_runs_ms": plain[b], "group_ms": group[b],
                "overhead": group[b] / min(plain[b]) - 1.0} for b in args.batches}


def _free() -> None:
    gc.collect()  # a finished engine's CUDA graphs and pool
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--tiny", action="store_true", help="a small config on the CPU (gloo), a dry run")
    parser.add_argument("--git-revision", default="unknown")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    args.device = "cpu" if args.tiny else "cuda"
    results = measure(args)
    hardware = (f"{torch.cuda.get_device_name()}, torch {torch.__version__}" if args.device == "cuda"
                else f"CPU, torch {torch.__version__}")
    command = "python benchmarks/multigpu/bench_group_overhead.py " + " ".join(sys.argv[1:])
    stamp = dict(command=command, hardware=hardware, git_revision=args.git_revision,
                 date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
    shape = "tiny (CPU)" if args.tiny else f"M3 widths, {args.layers} layers, bf16, context {args.context}"
    runs = {b: ", ".join(f"{x:.3f}" for x in r["plain_runs_ms"]) for b, r in results.items()}
    per_batch = "; ".join(
        f"batch {b}: plain {r['plain_ms']:.3f} ms (runs {runs[b]}), "
        f"group {r['group_ms']:.3f} ms, {100 * r['overhead']:+.2f}%" for b, r in results.items()
    )
    worst = max(results, key=lambda b: results[b]["overhead"])
    note = (f"decode step (engine.step, median of {args.steps}) through the group path at TP 1 / EP 1 (NCCL "
            f"group of one, in-process rank, pickled messages) vs the plain engine, worst batch ({worst}); "
            f"{shape}; {per_batch}. Target <= 3%. Excludes Ray's actor-call latency (Ray is not on the H200 "
            "image; docs/scaling.md).")
    out = {"multigpu.group_overhead_tp1": {
        **stamp, "value": round(100 * results[worst]["overhead"], 2), "unit": "%", "note": note}}
    for b, r in results.items():
        out[f"multigpu.decode_step_ms_group_tp1_b{b}"] = {
            **stamp, "value": round(r["group_ms"], 3), "unit": "ms",
            "note": f"{shape}; plain engine {r['plain_ms']:.3f} ms"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"{'batch':>6} {'plain ms':>10} {'group ms':>10} {'overhead':>9}")
    for b, r in results.items():
        print(f"{b:>6} {r['plain_ms']:>10.3f} {r['group_ms']:>10.3f} {100 * r['overhead']:>+8.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
