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
holds against its pages in the pool, and whether the tokens equal the pool's (`--part move`).

`--part adopt`: a session of `--context` tokens stored in the KV cache service (4 in-process shards,
arenas pinned on CUDA) by a pool-only engine, then continued with one new token on an engine whose
lane adopts it (index first, K/V leased in place), against a pool-only engine that prefills it all
again (MSA, chunked): time to first token of each, the ratio, TPOT after it, tokens equal.

The model is `m3-mini` (`--layers` layers; small widths on the CPU: a check of the script, not a
figure). Prints a table last; writes benchmarks/results/kvcache_resident_lane[_cpu].json.

    python benchmarks/kvcache/resident_lane.py                              # CPU check
    python benchmarks/kvcache/resident_lane.py --device cuda --context 131072 --requests 4
    python benchmarks/kvcache/resident_lane.py --device cuda --part adopt --context 1048576
"""

import argparse
import dataclasses
import itertools
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
from bench_setup import (  # noqa: E402
    PRESET,
    free_memory,
    model_label,
    model_overrides,
    shared_model,
    synchronize,
)

from msaserve.engine.config import EngineConfig  # noqa: E402
from msaserve.engine.kv.pages import identity_for  # noqa: E402
from msaserve.engine.kv.pinned_segments import segment_allocators  # noqa: E402
from msaserve.engine.llm_engine import LLMEngine  # noqa: E402
from msaserve.engine.types import GenerateRequest, SamplingParams  # noqa: E402
from msaserve.kvcache.arena import numpy_segment  # noqa: E402
from msaserve.kvcache.client import KVCacheClient  # noqa: E402
from msaserve.kvcache.config import ServiceConfig  # noqa: E402


def build(args: argparse.Namespace, lane: bool, client: KVCacheClient | None = None,
          min_tokens: int | None = None) -> LLMEngine:
    """An engine over the shared model whose pool holds --pool-requests requests of --context tokens
    (and their output); lane: with a sparse-resident lane of --requests sessions, entered from
    `min_tokens` (default --context) on; client: the KV cache service its sessions persist to."""
    loaded = shared_model(args)
    page_size = loaded.config.page_size
    max_model_len = args.context + args.max_tokens + 2
    pages = max(16, args.pool_requests * -(-max_model_len // page_size) + 2)
    config = EngineConfig(
        model=PRESET, model_overrides=model_overrides(args), device=args.device,
        dtype="bfloat16" if args.device == "cuda" else "float32", attention_backend="msa",
        max_num_seqs=args.requests, max_num_batched_tokens=args.chunk, max_model_len=max_model_len,
        num_pages=pages, cuda_graphs=args.device == "cuda", enable_prefix_caching=False,
        sparse_residency_sessions=args.requests if lane else 0,
        sparse_residency_min_tokens=args.context if min_tokens is None else min_tokens,
        sparse_residency_budget=args.budget,
    )
    return LLMEngine(config, model=loaded.model, tokenizer=loaded.tokenizer, kv_client=client)


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


def move_part(args: argparse.Namespace, loaded) -> tuple[dict, list[str]]:
    """Requests moving off the pool (see the module docstring) → (JSON entries, table lines)."""
    cuda = args.device == "cuda"
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
        free_memory()
    pool, lane = results["pool"], results["lane"]
    equal = pool["tokens"] == lane["tokens"]
    for r in results.values():
        r.pop("tokens")
    # a request's pages in the pool (K, V, index-K of every layer) against its moved session's tensors
    pool_bytes = -(-(args.context + args.max_tokens) // loaded.config.page_size) * page_bytes
    lane_bytes = lane["lane"]["session_device_bytes"]
    out = dict(
        **header(args), requests=args.requests, pool_requests=args.pool_requests,
        max_tokens=args.max_tokens, budget=args.budget, tokens_equal=equal,
        request_device_bytes_pool=pool_bytes, request_device_bytes_lane=lane_bytes,
        speedup_total=pool["total_s"] / lane["total_s"], pool=pool, lane=lane,
    )
    suffix = "" if cuda else "_cpu"
    common = {k: out[k] for k in ("command", "device", "date", "git")}
    note = (f"{args.requests} greedy requests of {args.context} tokens + {args.max_tokens}, a pool for "
            f"{args.pool_requests}, budget {args.budget}, {out['model']}; tokens equal: {equal}; total "
            f"{pool['total_s']:.2f} s pool alone vs {lane['total_s']:.2f} s with the lane")
    entries = {
        "resident_lane": out,
        f"kvcache.resident_lane_request_bytes_ratio{suffix}": dict(
            value=pool_bytes / lane_bytes, unit="x: a request's device bytes in the pool / once moved",
            note=note, **common),
        f"kvcache.resident_lane_total_speedup{suffix}": dict(
            value=out["speedup_total"], note=note, **common,
            unit="x: time until every request is done, pool alone / with the lane"),
    }
    lines = [f"{args.requests} requests of {args.context} tokens + {args.max_tokens}, pool for "
             f"{args.pool_requests}, tokens equal: {equal}",
             f"{'mode':6} {'total s':>9} {'TTFT median s':>14} {'TPOT median ms':>15} "
             f"{'decoding at once':>17}"]
    for mode, r in results.items():
        lines.append(f"{mode:6} {r['total_s']:9.2f} {statistics.median(r['ttft_s']):14.2f} "
                     f"{statistics.median(r['mean_tpot_ms']):15.2f} {r['most_decoding']:17d}")
    lines.append(f"device bytes per request: pool {pool_bytes / 2**20:.1f} MiB, lane "
                 f"{lane_bytes / 2**20:.1f} MiB ({pool_bytes / lane_bytes:.2f}x fewer); lane total "
                 f"{out['speedup_total']:.2f}x faster")
    return entries, lines


def adopt_part(args: argparse.Namespace, loaded) -> tuple[dict, list[str]]:
    """A stored session adopted into an engine's lane against a pool-only re-prefill (see the module
    docstring) → (JSON entries, table lines)."""
    cuda, device = args.device == "cuda", torch.device(args.device)
    c = loaded.config
    dtype = torch.bfloat16 if cuda else torch.float32
    vocab = min(c.vocab_size, 32000)
    generator = torch.Generator().manual_seed(7)
    prompt = torch.randint(3, vocab, (args.context,), generator=generator).tolist()
    warm = torch.randint(3, vocab, (min(args.context, 8 * c.page_size),), generator=generator).tolist()
    page_bytes = 2 * c.page_size * c.num_kv_heads * c.head_dim * dtype.itemsize + (
        c.page_size * c.num_index_heads * c.index_head_dim * dtype.itemsize)
    stored_bytes = -(-(args.context + 2) // c.page_size) * page_bytes * c.num_layers
    client = KVCacheClient.in_process(
        ServiceConfig(num_shards=4, memory_bytes=max(2 * stored_bytes, 64 << 20)),
        identity_for(c, f"m3-mini-L{args.layers}-seed0", dtype),
        # K/V and index pages in arenas (pinned on CUDA): the lane's adoption leases the K/V in place
        segment_allocators=segment_allocators(device, ("index", "kv"))
        or {"index": numpy_segment, "kv": numpy_segment},
    )
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    def first_turn(session: str, tokens: list[int]) -> list[int]:
        """Prefill and persist a session on a pool-only engine → the whole conversation so far."""
        engine = build(args, lane=False, client=client)
        engine.add_request(GenerateRequest(session, tokens, SamplingParams(max_tokens=1, temperature=0.0,
                                                                           ignore_eos=True),
                                           session_id=session))
        out = [t for o in drain(engine) for t in o.token_ids]
        del engine
        free_memory()
        return [*tokens, *out, 3]  # the turn's answer, then one new user token

    def timed(engine: LLMEngine, tokens: list[int], session: str | None) -> dict:
        synchronize(args.device)
        t0 = time.perf_counter()
        engine.add_request(GenerateRequest("next", tokens, greedy, session_id=session))
        times, out = [], []
        while engine.has_unfinished():
            for o in engine.step():
                out += o.token_ids
                times.append(time.perf_counter() - t0)
        synchronize(args.device)
        steps = [b - a for a, b in itertools.pairwise(times)]
        return dict(ttft_s=times[0], tpot_median_ms=statistics.median(steps) * 1e3 if steps else 0.0,
                    tpot_mean_ms=statistics.mean(steps) * 1e3 if steps else 0.0, tokens=out)

    conversation = first_turn("s", prompt)
    warm_conversation = first_turn("w", warm)
    # re-prefill: a pool-only engine without the service computes the whole conversation again
    engine = build(args, lane=False)
    timed(engine, warm_conversation, None)  # warm-up off the clock
    reprefill = timed(engine, conversation, None)
    del engine
    free_memory()
    # adoption into the lane: index first, K/V leased in place, decoded sparse-resident (the pool could
    # hold the session, but one new token after the stored ones goes to the lane)
    engine = build(args, lane=True, client=client, min_tokens=len(warm))
    timed(engine, warm_conversation, "w")  # warm-up off the clock, through the lane too
    adopted = timed(engine, conversation, "s")
    lane = engine.resident.stats
    assert lane.adopted == 2, lane
    equal = adopted.pop("tokens") == reprefill.pop("tokens")
    ratio = reprefill["ttft_s"] / adopted["ttft_s"]
    out = dict(**header(args), max_tokens=args.max_tokens, budget=args.budget, tokens_equal=equal,
               reprefill=reprefill, lane_adopt=adopted, ttft_ratio=ratio, lane_stats=dataclasses.asdict(lane))
    suffix = "" if cuda else "_cpu"
    common = {k: out[k] for k in ("command", "device", "date", "git")}
    note = (f"a stored session of {args.context} tokens + 1 new, {out['model']}: first token "
            f"{adopted['ttft_s'] * 1e3:.1f} ms adopted into the lane vs {reprefill['ttft_s'] * 1e3:.1f} ms "
            f"re-prefilled (MSA, pool); tokens equal: {equal}")
    entries = {"resident_lane_adopt": out, f"kvcache.engine_lane_adopt_vs_reprefill{suffix}": dict(
        value=ratio, unit="x: first token re-prefilled / adopted into the engine's lane", note=note,
        **common)}
    lines = [f"stored session of {args.context} tokens + 1 new token, tokens equal: {equal}",
             f"{'path':24} {'first token ms':>15} {'TPOT median ms':>15}"]
    for label, r in (("re-prefill (pool, MSA)", reprefill), ("adopted into the lane", adopted)):
        lines.append(f"{label:24} {r['ttft_s'] * 1e3:15.1f} {r['tpot_median_ms']:15.2f}")
    lines.append(f"ratio {ratio:.1f}x")
    return entries, lines


def drain(engine: LLMEngine) -> list:
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    return outputs


def header(args: argparse.Namespace) -> dict:
    return dict(command="python " + " ".join(sys.argv), device=hardware(torch.device(args.device)),
                date=datetime.now(UTC).isoformat(timespec="seconds"), git=git_revision(),
                model=model_label(args), context=args.context)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--part", default="move,adopt", help="move, adopt, or both (comma-separated)")
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
    parts = set(args.part.split(","))
    if not parts or parts - {"move", "adopt"}:
        parser.error(f"--part={args.part!r} is invalid: allowed move, adopt or move,adopt")
    torch.manual_seed(0)
    loaded = shared_model(args)
    entries, lines = {}, []
    for name, part in (("move", move_part), ("adopt", adopt_part)):
        if name in parts:
            more, text = part(args, loaded)
            entries.update(more)
            lines += ["", *text]
    name = "kvcache_resident_lane.json" if cuda else "kvcache_resident_lane_cpu.json"
    path = merge_results(args.output or ROOT / "benchmarks" / "results" / name, entries)
    print(f"wrote {path}")
    print(f"\n{hardware(torch.device(args.device))}, git {git_revision()}, {model_label(args)}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
