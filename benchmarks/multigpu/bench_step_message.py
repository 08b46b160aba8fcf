"""The host work the group path adds to a decode step, alone, on the CPU: what the driver and a rank
do that the plain engine does not — pack the step inputs into a StepMessage, pickle and unpickle it
(Ray's transport of an inline argument, without the actor call), unpack it into tensors (here on the
CPU: the pinned copies to the device are the plain path's too), and pickle the greedy tokens back.
The same for the message as the group path sent it before (the step's seven torch tensors pickled).

Inputs: a decode step of `batch` sequences at --context tokens, M3's page size (128), built by the
engine's own build_step_inputs. Timing: median of --repeats rounds, each the mean of 200 steps.

  python benchmarks/multigpu/bench_step_message.py --git-revision $(git rev-parse --short HEAD)
"""

import argparse
import dataclasses
import datetime
import json
import pickle
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from msaserve.engine.parallel.messages import StepMessage
from msaserve.engine.scheduler import ScheduledBatch
from msaserve.engine.sequence import Sequence
from msaserve.engine.step_inputs import build_step_inputs
from msaserve.engine.types import SamplingParams

RESULTS = Path(__file__).resolve().parents[1] / "results" / "multigpu_message.json"
PAGE = 128


def decode_batch(batch: int, context: int) -> ScheduledBatch:
    seqs = []
    pages_per_seq = -(-(context + 1) // PAGE)
    for i in range(batch):
        seq = Sequence(request_id=f"r{i}", token_ids=list(range(3, context + 4)), num_prompt_tokens=context,
                       sampling=SamplingParams(max_tokens=16, temperature=0.0), arrival_time=0.0)
        seq.num_computed_tokens = context
        seq.block_table = list(range(i * pages_per_seq, (i + 1) * pages_per_seq))
        seqs.append(seq)
    return ScheduledBatch(seqs=seqs, num_new_tokens=[1] * batch)


def new_path(batch: ScheduledBatch) -> None:
    inputs = build_step_inputs(batch, PAGE, torch.device("cpu"))
    message = pickle.loads(pickle.dumps(StepMessage.pack(inputs, greedy=True)))
    message.unpack(torch.device("cpu"))
    pickle.loads(pickle.dumps(list(range(len(batch.seqs)))))


def old_path(batch: ScheduledBatch) -> None:
    """Before: input ids and every metadata tensor pickled as torch tensors, and rank 0's logits
    (not timed here: a [B, 200064] fp32 copy) — only the message part, for comparison."""
    inputs = build_step_inputs(batch, PAGE, torch.device("cpu"))
    tensors = {f.name: getattr(inputs.meta, f.name) for f in dataclasses.fields(inputs.meta)}
    pickle.loads(pickle.dumps((inputs.input_ids, tensors, inputs.sample_rows)))


def plain_host(batch: ScheduledBatch) -> None:
    build_step_inputs(batch, PAGE, torch.device("cpu"))  # what both paths build (the baseline)


def per_step_us(fn, batch: ScheduledBatch, repeats: int) -> float:
    means = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(200):
            fn(batch)
        means.append((time.perf_counter() - start) / 200 * 1e6)
    return statistics.median(means)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--git-revision", default="unknown")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    stamp = dict(command="python benchmarks/multigpu/bench_step_message.py " + " ".join(sys.argv[1:]),
                 hardware=f"CPU ({platform.processor() or platform.machine()}, shared 2-core dev machine), "
                          f"torch {torch.__version__}",
                 git_revision=args.git_revision,
                 date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
    out, rows = {}, []
    for b in args.batches:
        batch = decode_batch(b, args.context)
        base = per_step_us(plain_host, batch, args.repeats)
        new = per_step_us(new_path, batch, args.repeats) - base
        old = per_step_us(old_path, batch, args.repeats) - base
        rows.append((b, base, new, old))
        out[f"multigpu.step_message_host_us_b{b}"] = {
            **stamp, "value": round(new, 1), "unit": "us",
            "note": (f"host work the group path adds per decode step (pack, pickle round trip, unpack, "
                     f"tokens back), batch {b}, context {args.context}, beyond build_step_inputs ({base:.1f} "
                     f"us, both paths); the torch-tensor message before: {old:.1f} us (its logits copy not "
                     "counted)")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"{'batch':>6} {'build us':>9} {'group adds us':>14} {'before us':>10}")
    for b, base, new, old in rows:
        print(f"{b:>6} {base:>9.1f} {new:>14.1f} {old:>10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
