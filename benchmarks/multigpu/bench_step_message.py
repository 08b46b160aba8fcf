"""The host work the group path adds to a decode step, alone, on the CPU: what the driver and a rank
do that the plain engine does not. Both paths build the step's flat host buffer with the same code
(`build_host_step`) and upload it with the same code (`HostStep.upload`); the group path adds the
`StepMessage` around it, its pickling there and back (Ray's transport of an inline argument, without
the actor call) and the greedy tokens pickled back. Here the upload is to the CPU (on CUDA both
paths make the same one pinned copy); a pickled buffer arrives read-only, so the rank's CPU upload
copies it once (on CUDA that copy is the pinned one, which the plain path makes too).

Inputs: a decode step of `batch` sequences at --context tokens, M3's page size (128). Timing:
--repeats rounds, each the mean of 200 steps of each path, the paths interleaved round by round;
medians of the rounds (the group path's addition: of the per-round differences).

  python benchmarks/multigpu/bench_step_message.py --git-revision $(git rev-parse --short HEAD)
"""

import argparse
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
from msaserve.engine.step_inputs import build_host_step, build_step_inputs
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


def group_path(batch: ScheduledBatch) -> None:
    """The driver's build and message, Ray's pickling both ways, the rank's upload, tokens back."""
    message = pickle.loads(pickle.dumps(StepMessage(build_host_step(batch, PAGE), greedy=True)))
    message.step.upload(torch.device("cpu"))
    pickle.loads(pickle.dumps(list(range(len(batch.seqs)))))


def plain_path(batch: ScheduledBatch) -> None:
    build_step_inputs(batch, PAGE, torch.device("cpu"))  # build_host_step + upload: the baseline


def round_trip(step) -> None:
    """The message alone: wrapped, pickled, unpickled (as an inline Ray argument)."""
    pickle.loads(pickle.dumps(StepMessage(step, greedy=True)))


def mean_us(fn, arg) -> float:
    start = time.perf_counter()
    for _ in range(200):
        fn(arg)
    return (time.perf_counter() - start) / 200 * 1e6


def paired_us(batch: ScheduledBatch, repeats: int) -> dict[str, float]:
    """Plain and group rounds interleaved (a slow phase of the shared machine falls on both) →
    medians of plain, group, their per-round difference and the message's round trip alone."""
    rounds: dict[str, list[float]] = {"plain": [], "group": [], "adds": [], "round_trip": []}
    step = build_host_step(batch, PAGE)
    for _ in range(repeats):
        plain, group = mean_us(plain_path, batch), mean_us(group_path, batch)
        for name, value in (("plain", plain), ("group", group), ("adds", group - plain),
                            ("round_trip", mean_us(round_trip, step))):
            rounds[name].append(value)
    return {name: statistics.median(values) for name, values in rounds.items()}


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
        r = paired_us(decode_batch(b, args.context), args.repeats)
        rows.append((b, r))
        out[f"multigpu.step_message_host_us_b{b}"] = {
            **stamp, "value": round(r["adds"], 1), "unit": "us",
            "note": (f"host work the group path adds per decode step (the StepMessage, its pickle round "
                     f"trip, the rank's copy of the read-only buffer, tokens back), batch {b}, context "
                     f"{args.context}: median per-round difference of group ({r['group']:.1f} us) and plain "
                     f"({r['plain']:.1f} us: build_step_inputs on the CPU, the build and upload both paths "
                     f"share); the message's pickle round trip alone {r['round_trip']:.1f} us")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"{'batch':>6} {'plain us':>9} {'group us':>9} {'group adds us':>14} {'round trip us':>14}")
    for b, r in rows:
        print(f"{b:>6} {r['plain']:>9.1f} {r['group']:>9.1f} {r['adds']:>14.1f} {r['round_trip']:>14.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
