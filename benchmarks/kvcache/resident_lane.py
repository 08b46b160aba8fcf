"""The engine's sparse-resident lane (`msaserve/engine/kv/resident_lane.py`) against the page pool
alone, on the same model, the same requests and the same pool.

The pool holds `--pool-requests` requests of `--context` tokens (plus their output). `--requests`
such requests arrive at once, greedy, `--max-tokens` each:
- **pool**: the engine as it ships (`sparse_residency_sessions=0`): a request is admitted only when
  the pool holds its whole prompt, so the others wait for the first to finish;
- **lane**: the same engine with `sparse_residency_sessions=--requests`: a request that has
  finished its prefill moves off the pool (its index and `--budget` of its K/V on the device, the
  rest in host memory), which admits the next one.
Per mode: the time until every request is done, each request's time to first token and mean time
per output token after it, the most requests decoding at once, the device bytes a moved request
holds against its pages in the pool, and whether the tokens equal the pool's. The model is
`m3-mini` (`--layers` layers; small widths on the CPU: a check of the script, not a figure).
Prints a table last; writes benchmarks/results/kvcache_resident_lane[_cpu].json.

    python benchmarks/kvcache/resident_lane.py                              # CPU check
    python benchmarks/kvcache/resident_lane.py --device cuda --context 131072 --requests 4
"""

import argparse
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(HERE), str(ROOT / "benchmarks" / "serving")]

from adopt import git_revision, hardware, merge_results  # noqa: E402
from bench_setup import PRESET, model_label, model_overrides, shared_model  # noqa: E402

from msaserve.engine.config import EngineConfig  # noqa: E402
from msaserve.engine.llm_engine import LLMEngine  # noqa: E402
from msaserve.engine.types import GenerateRequest, SamplingParams  # noqa: E402


def build(args: argparse.Namespace, lane: bool) -> LLMEngine:
    loaded = shared_model(args)
    page_size = loaded.config.page_size
    max_model_len = args.context + args.max_tokens
    pages = args.pool_requests * -(-max_model_len // page_size) + 2
    config = EngineConfig(
        model=PRESET, model_overrides=model_overrides(args), device=args.device,
        dtype="bfloat16" if args.device == "cuda" else "float32", attention_backend="msa",
        max_num_seqs=args.requests, max_num_batched_tokens=args.chunk, max_model_len=max_model_len,
        num_pages=pages, cuda_graphs=args.device == "cuda", enable_prefix_caching=False,
        sparse_residency_sessions=args.requests if lane else 0, sparse_residency_min_tokens=args.context,
        sparse_residency_budget=args.budget,
    )
    return LLMEngine(config, model=loaded.model, tokenizer=loaded.tokenizer)


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, device: str) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(GenerateRequest(f"r{i}", prompt, params))
    tokens: dict[str, list[int]] = {}
    times: dict[str, list[float]] = {}
    most = 0
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter() - start
        for output in outputs:
            tokens.setdefault(output.request_id, []).extend(output.token_ids)
            times.setdefault(output.request_id, []).append(now)
        decoding = sum(1 for s in engine.scheduler.running if s.num_uncomputed_tokens == 1)
        most = max(most, decoding + len(engine.resident or ()))
    if device == "cuda":
        torch.cuda.synchronize()
    total = time.perf_counter() - start
    ttft = [times[r][0] for r in sorted(times)]
    tpot = [(times[r][-1] - times[r][0]) / max(1, len(times[r]) - 1) for r in sorted(times)]
    result = dict(total_s=total, ttft_s=ttft, mean_tpot_ms=[t * 1e3 for t in tpot], most_decoding=most,
                  tokens=tokens)
    lane = engine.resident
    if lane is not None:
        s = lane.stats
        result["lane"] = dict(moved_in=s.moved_in, steps=s.steps, graph_steps=s.graph_steps,
                              pages_freed=s.pages_freed, move_s_mean=s.move_seconds / max(1, s.moved_in),
                              pages_fetched_per_step=s.pages_fetched / max(1, s.steps),
                              evictions=s.evictions, budget_pages=lane.budget_pages,
                              session_device_bytes=s.session_device_bytes)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--context", type=int, default=None, help="prompt tokens (CPU 1536, CUDA 131072)")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--pool-requests", type=int, default=1, help="requests the pool holds at once")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--budget", type=float, default=0.1, help="sparse_residency_budget")
    parser.add_argument("--chunk", type=int, default=None,
                        help="max_num_batched_tokens (CPU 512, CUDA 16384)")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    cuda = args.device == "cuda"
    args.context = args.context or (131072 if cuda else 1536)
    args.chunk = args.chunk or (16384 if cuda else 512)
    torch.manual_seed(0)
    loaded = shared_model(args)
    vocab = min(loaded.config.vocab_size, 32000)
    prompts = [torch.randint(3, vocab, (args.context,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(args.requests)]
    results = {}
    for mode in ("pool", "lane"):
        engine = build(args, lane=mode == "lane")
        page_bytes = sum(cache.page_bytes for cache in engine.runner.caches)
        # warm-up (kernels compiled, graphs of the pool's batch sizes captured): one short request
        run(engine, [prompts[0][: 4 * loaded.config.page_size]], 4, args.device)
        results[mode] = run(engine, prompts, args.max_tokens, args.device)
        print(f"{mode}: {results[mode]['total_s']:.2f} s", file=sys.stderr, flush=True)
        del engine
    pool, lane = results["pool"], results["lane"]
    equal = pool["tokens"] == lane["tokens"]
    for r in results.values():
        r.pop("tokens")
    # a request's pages in the pool (K, V, index-K of every layer) against its moved session's tensors
    pool_bytes = -(-(args.context + args.max_tokens) // loaded.config.page_size) * page_bytes
    lane_bytes = lane["lane"]["session_device_bytes"]
    out = dict(
        command="python " + " ".join(sys.argv), device=hardware(torch.device(args.device)),
        date=datetime.now(UTC).isoformat(timespec="seconds"), git=git_revision(), model=model_label(args),
        context=args.context, requests=args.requests, pool_requests=args.pool_requests,
        max_tokens=args.max_tokens, budget=args.budget, tokens_equal=equal,
        request_device_bytes_pool=pool_bytes, request_device_bytes_lane=lane_bytes,
        speedup_total=pool["total_s"] / lane["total_s"], pool=pool, lane=lane,
    )
    name = "kvcache_resident_lane.json" if cuda else "kvcache_resident_lane_cpu.json"
    suffix = "" if cuda else "_cpu"
    common = dict(command=out["command"], device=out["device"], date=out["date"], git=out["git"])
    note = (f"{args.requests} greedy requests of {args.context} tokens + {args.max_tokens}, a pool for "
            f"{args.pool_requests}, budget {args.budget}, {out['model']}; tokens equal: {equal}; total "
            f"{pool['total_s']:.2f} s pool alone vs {lane['total_s']:.2f} s with the lane")
    keys = {
        f"kvcache.resident_lane_request_bytes_ratio{suffix}": dict(
            value=pool_bytes / lane_bytes, unit="x: a request's device bytes in the pool / once moved",
            note=note, **common),
        f"kvcache.resident_lane_total_speedup{suffix}": dict(
            value=out["speedup_total"], note=note, **common,
            unit="x: time until every request is done, pool alone / with the lane"),
    }
    path = merge_results(args.output or ROOT / "benchmarks" / "results" / name,
                         {"resident_lane": out, **keys})
    print(f"wrote {path}")
    print(f"\n{args.requests} requests of {args.context} tokens + {args.max_tokens}, pool for "
          f"{args.pool_requests}, {out['device']}, git {out['git']}, tokens equal: {equal}")
    print(f"{'mode':6} {'total s':>9} {'TTFT median s':>14} {'TPOT median ms':>15} {'decoding at once':>17}")
    for mode, r in results.items():
        print(f"{mode:6} {r['total_s']:9.2f} {statistics.median(r['ttft_s']):14.2f} "
              f"{statistics.median(r['mean_tpot_ms']):15.2f} {r['most_decoding']:17d}")
    print(f"device bytes per request: pool {pool_bytes / 2**20:.1f} MiB, lane {lane_bytes / 2**20:.1f} MiB "
          f"({pool_bytes / lane_bytes:.2f}x fewer); lane total {out['speedup_total']:.2f}x faster")


if __name__ == "__main__":
    main()
