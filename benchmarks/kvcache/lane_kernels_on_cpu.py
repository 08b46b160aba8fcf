"""Does the sparse-resident lane give the pool's greedy tokens with the GPU's kernels? A diagnostic for
`tests/gpu/test_gpu_resident_lane.py`'s tiny-M3 bf16 case, which differed from the pool on the H200
and the H100, run on the CPU: the engine's MSA ops replaced by the GPU backend's (the Triton MSA
kernels and `kernels/dense/gpu.py`'s dense ops) under the Triton interpreter, the tiny M3 in `--dtype`,
the GPU test's prompts, requests and lane settings. Equal tokens in fp32 and different ones in bf16
point at summation order, not at the lane reading the wrong pages.

`--sequential` runs the requests one after the other in both engines (each collected before the
next is added), so the pool never batches one request's decode tokens with another's prefill chunk
(a mixed step, which runs every token through the prefill kernels) or with other decode tokens:
what is left is the lane against the pool for the same request alone.

Slow (the interpreter runs every kernel in Python): about 3 min for 12 tokens, 7–10 min for 40, per
dtype.

    python benchmarks/kvcache/lane_kernels_on_cpu.py --dtype float32 --tokens 40
    python benchmarks/kvcache/lane_kernels_on_cpu.py --dtype bfloat16 --tokens 40
    python benchmarks/kvcache/lane_kernels_on_cpu.py --dtype bfloat16 --tokens 40 --sequential
"""

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

import torch  # noqa: E402
from engine.engine_helpers import collect, greedy, random_prompt, run_to_completion  # noqa: E402
from parallel.m3_tiny import random_m3  # noqa: E402

import msaserve.kernels.backends.msa as msa_backend  # noqa: E402
from msaserve.engine.config import EngineConfig  # noqa: E402
from msaserve.engine.llm_engine import LLMEngine  # noqa: E402
from msaserve.engine.types import GenerateRequest  # noqa: E402
from msaserve.kernels.dispatch import AttentionOps, load_op, msa_ops  # noqa: E402

LANE = dict(sparse_residency_sessions=2, sparse_residency_min_tokens=256, sparse_residency_budget=0.01)
"""As tests/gpu/test_gpu_resident_lane.py."""


def gpu_ops(device: torch.device) -> AttentionOps:
    """The `triton` backend's ops (backends/triton.py) for CPU tensors under the interpreter."""
    dense = (load_op("gpu", "dense", "dense_prefill"), load_op("gpu", "dense", "dense_decode"))
    return msa_ops("msa", "triton", dense, graph_capturable=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--tokens", type=int, default=12)
    parser.add_argument("--sequential", action="store_true",
                        help="requests one after the other in both engines (no mixed or batched steps)")
    parser.add_argument("--output", default=None, help="JSON path (default: print only)")
    args = parser.parse_args()
    msa_backend.resolve = gpu_ops  # the engine resolves the "msa" backend's ops through this
    model = random_m3(seed=0, backend="msa").to(getattr(torch, args.dtype))
    prompts = [random_prompt(n, seed=40 + i, vocab=250) for i, n in enumerate((300, 420, 560))]

    def run(lane: bool) -> dict[str, list[int]]:
        config = EngineConfig(model="tiny", device="cpu", dtype=args.dtype, attention_backend="msa",
                              num_pages=256, max_num_seqs=4, max_num_batched_tokens=128, max_model_len=640,
                              **(LANE if lane else {}))
        engine = LLMEngine(config, model=model)
        if engine.runner.ops.indexer_decode.__module__ != "msaserve.kernels.indexer_decode.triton":
            raise SystemExit("the engine did not take the GPU backend's ops")
        requests = [GenerateRequest(f"r{i}", p, greedy(args.tokens)) for i, p in enumerate(prompts)]
        if args.sequential:
            out: dict[str, list[int]] = {}
            for request in requests:
                engine.add_request(request)
                collect(engine, out)
        else:
            out = run_to_completion(engine, requests)
        if lane and engine.resident.stats.moved_in != 3:
            raise SystemExit(f"{engine.resident.stats.moved_in} of 3 requests moved to the lane")
        return out

    start = time.perf_counter()
    want, got = run(lane=False), run(lane=True)
    first = {r: next((i for i, (a, b) in enumerate(zip(got[r], want[r], strict=True)) if a != b), None)
             for r in want}
    result = dict(dtype=args.dtype, tokens=args.tokens, sequential=args.sequential, equal=got == want,
                  first_differing_token=first,
                  pool=want, lane=got, seconds=round(time.perf_counter() - start, 1),
                  command="python benchmarks/kvcache/lane_kernels_on_cpu.py " + " ".join(sys.argv[1:]),
                  date=datetime.now(UTC).isoformat(timespec="seconds"),
                  git_revision=os.environ.get("MSASERVE_GIT_REVISION") or subprocess.run(
                      ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                      text=True).stdout.strip())
    order = ", one after the other" if args.sequential else ""
    print(f"{args.dtype}, {args.tokens} tokens per request{order}: lane tokens equal to the pool's: "
          f"{result['equal']}; first differing token per request: {first} ({result['seconds']} s)")
    if args.output:
        path = Path(args.output)
        runs = json.loads(path.read_text()) if path.exists() else {}
        runs[f"{args.dtype}_{args.tokens}{'_sequential' if args.sequential else ''}"] = result
        path.write_text(json.dumps(runs, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
