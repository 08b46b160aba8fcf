"""The host time the group path adds to a whole `engine.step()`, on the CPU, with the model's
forward taken out: both engines of `bench_group_overhead.py --tiny` (the plain ModelRunner, and the
GroupRunner → StepMessage → RankWorker behind LocalGroup with every call pickled as Ray would), one
MSA layer, each holding a decode batch at --context tokens, but `ModelRunner.forward` replaced by a
constant hidden [B, H] for the timed steps, so a step is only host work: scheduling, the step's
inputs, the message and its pickling, the LM head of the tiny model, sampling, outputs. The
difference is what the group machinery costs the host per step (what the H200 run sees at a ~3×
slower host, plus nothing on the device: both paths run the same kernels). --no-pickle leaves the
pickling out (the transport's share).

Timing: --steps interleaved step pairs (order alternating) after --warmup; per batch the median of
each path and the median of the per-pair differences. The script runs unchanged at older revisions
(copy it there) for a before/after on one machine.

  python benchmarks/multigpu/bench_group_host.py --git-revision $(git rev-parse --short HEAD)
"""

import argparse
import dataclasses
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_group_overhead as overhead

from msaserve.engine.llm_engine import LLMEngine
from msaserve.engine.model_runner import ModelRunner
from msaserve.engine.parallel.local import LocalGroup
from msaserve.engine.parallel.runner import GroupRunner
from msaserve.engine.parallel.worker import RankWorker, free_address

RESULTS = Path(__file__).resolve().parents[1] / "results" / "multigpu_host.json"


def engines(args) -> tuple[dict[str, LLMEngine], RankWorker]:
    config = dataclasses.replace(overhead.engine_config(args), max_num_batched_tokens=65536)
    worker = RankWorker(config, 0)
    worker.join(free_address())
    info = worker.take_model(overhead.build_model(1, True, "cpu"), None)
    runner = GroupRunner(LocalGroup(worker, info, serialize=not args.no_pickle), config)
    return {"plain": LLMEngine(config, model=worker.runner.model),
            "group": LLMEngine(config, model=runner.model, runner=runner)}, worker


def measure_batch(pair: dict[str, LLMEngine], args, batch: int, hidden_size: int) -> dict:
    for engine in pair.values():
        overhead.fill(engine, args, batch)  # prefilled with the real forward
    forward = ModelRunner.forward
    ModelRunner.forward = lambda self, ids, meta, *rest, **kw: torch.zeros(meta.num_seqs, hidden_size)
    times: dict[str, list[float]] = {"plain": [], "group": []}
    try:
        for i in range(args.warmup + args.steps):
            for name in (("plain", "group") if i % 2 == 0 else ("group", "plain")):
                start = time.perf_counter()
                outputs = pair[name].step()
                elapsed = (time.perf_counter() - start) * 1e6
                assert len(outputs) == batch
                if i >= args.warmup:
                    times[name].append(elapsed)
    finally:
        ModelRunner.forward = forward
    for engine in pair.values():
        for request_id in list(engine.trackers):
            engine.abort(request_id)
    return {"plain_us": statistics.median(times["plain"]), "group_us": statistics.median(times["group"]),
            "adds_us": statistics.median(g - p for g, p in zip(times["group"], times["plain"], strict=True))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=600, help="timed step pairs (plain, group) per batch")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--no-pickle", action="store_true",
                        help="LocalGroup without pickling: the machinery's cost without the transport's")
    parser.add_argument("--git-revision", default="unknown")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    args.tiny, args.device, args.layers, args.full_attention_first = True, "cpu", 1, False
    torch.set_num_threads(1)
    pair, worker = engines(args)
    hidden = pair["plain"].model.config.hidden_size
    try:
        results = {b: measure_batch(pair, args, b, hidden) for b in args.batches}
    finally:
        worker.shutdown()
    stamp = dict(command="python benchmarks/multigpu/bench_group_host.py " + " ".join(sys.argv[1:]),
                 hardware=f"CPU ({platform.machine()}, shared 2-core dev machine), torch {torch.__version__}",
                 git_revision=args.git_revision,
                 date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
    transport = "without pickling" if args.no_pickle else "pickling as Ray"
    out = {f"multigpu.group_host_us_b{b}": {
        **stamp, "value": round(r["adds_us"], 1), "unit": "us",
        "note": (f"host time the group path adds to engine.step() (forward taken out; tiny M3, 1 layer, "
                 f"LocalGroup {transport}), decode batch {b}, context {args.context}: median of "
                 f"{args.steps} interleaved pair differences; plain {r['plain_us']:.1f} us, group "
                 f"{r['group_us']:.1f} us per step")} for b, r in results.items()}
    if args.no_pickle:
        out = {key.replace("group_host_us", "group_host_unpickled_us"): entry for key, entry in out.items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"{'batch':>6} {'plain us':>9} {'group us':>9} {'group adds us':>14}")
    for b, r in results.items():
        print(f"{b:>6} {r['plain_us']:>9.1f} {r['group_us']:>9.1f} {r['adds_us']:>14.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
