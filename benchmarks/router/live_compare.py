"""Live A/B inside Ray Serve: our KV-aware router against Ray's own, same trace slice, same HTTP API.

For each router in `--routers` this starts the msaserve app afresh (real Ray Serve on this CPU
machine, `--replicas` replicas of the `tiny` preset with a small KV cache, so where a prefix is
decides whether it is still cached), replays the same slice of a Mooncake-format trace through
`/v1/completions` (streamed, token-id prompts: each 512-token trace block becomes `--block-tokens`
seeded random token ids, so requests sharing trace blocks share real token prefixes and the
trace's reuse structure survives at CPU-sized lengths) at the trace's arrival times ×
`--time-scale`, and
records per request the TTFT (first streamed text chunk) and the cached prompt tokens the replica
reported (`usage.prompt_tokens_details.cached_tokens`). Routers:

- `kv_aware`: msaserve's MSARequestRouter with the kv_aware policy (the platform default);
- `ray_pow2`: Serve's default PowerOfTwoChoicesRequestRouter (`RequestRouterConfig()`);
- `ray_prefix_affinity`: Ray Serve LLM's PrefixCacheAffinityRouter, fed token ids as text
  (ray_live_routers.py).

Writes `router.live.<router>.{ttft_p50_s,ttft_p90_s,prefix_hit_rate}` and the kv_aware / ray_pow2
ratios to `--out`, then prints a table.

    python benchmarks/router/live_compare.py [--start 3000 --limit 300 --time-scale 1.5] [--summary]
"""

import argparse
import asyncio
import datetime
import json
import math
import os
import random
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(HERE))
# Serve imports a request router class by module path in the replica that owns the handle: put this
# folder (ray_live_routers) and the repository on the workers' path before Ray starts.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(ROOT), str(HERE), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])

import httpx  # noqa: E402
import openai  # noqa: E402
from local_serve_app import start_live_app  # noqa: E402
from ray import serve  # noqa: E402
from ray_live_routers import ray_router_config  # noqa: E402
from report import git_revision, merge_into_summary, percentile  # noqa: E402

import msaserve.platform.app as platform_app  # noqa: E402
from msaserve.platform.loadgen import TOKEN_ID_RANGE, RequestSpec  # noqa: E402

DEFAULT_TRACE = ROOT / "benchmarks" / "data" / "mooncake_synthetic_trace.jsonl"
ROUTERS = ("ray_pow2", "ray_prefix_affinity", "kv_aware")


def block_tokens(hash_id: int, n: int) -> list[int]:
    rng = random.Random(hash_id)
    return [rng.randrange(*TOKEN_ID_RANGE) for _ in range(n)]


def slice_requests(path: Path, start: int, limit: int, per_block: int, max_input: int, max_output: int,
                   time_scale: float) -> list[RequestSpec]:
    """Rows [start, start + limit) of a Mooncake-format trace, each 512-token block as `per_block`
    tokens (the last block cut to the row's length), prompts capped at `max_input` tokens."""
    with open(path) as f:
        rows = [json.loads(line) for line in f][start:start + limit]
    if not rows:
        raise ValueError(f"--start={start} is past the trace's end: allowed fewer than its rows")
    t0, specs = rows[0]["timestamp"], []
    for row in rows:
        length = min(max_input, max(1, math.ceil(row["input_length"] / 512 * per_block)))
        tokens = [t for h in row["hash_ids"] for t in block_tokens(h, per_block)][:length]
        specs.append(RequestSpec(tokens, max(1, min(row["output_length"], max_output)),
                                 (row["timestamp"] - t0) / 1000.0 * time_scale))
    return specs


def app_config(replicas: int, num_pages: int, max_num_seqs: int, router: dict) -> dict:
    return {
        "model": {"spec": "tiny"},
        "engine": {"max_num_seqs": max_num_seqs, "max_waiting": 512, "max_model_len": 4096,
                   "num_pages": num_pages},
        "router": {"policy": "kv_aware", "stats_period_s": 0.25, **router},
        "auth": {"api_keys": ["k"]},
        "deployments": {"model": {"num_replicas": replicas, "max_ongoing_requests": 64,
                                  "ray_actor_options": {"num_cpus": 0.5}}},
    }


async def one(client: openai.AsyncOpenAI, spec: RequestSpec) -> dict:
    start = time.perf_counter()
    first, cached, prompt, error = None, 0, len(spec.prompt_token_ids), ""
    try:
        stream = await client.completions.create(
            model="msaserve/tiny", prompt=spec.prompt_token_ids, max_tokens=spec.max_tokens, temperature=0.0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].text:
                first = time.perf_counter()
            if chunk.usage:
                prompt = chunk.usage.prompt_tokens
                details = chunk.usage.prompt_tokens_details
                cached = (details.cached_tokens or 0) if details else 0
    except Exception as e:  # a failed request is counted, not fatal
        error = f"{type(e).__name__}: {e}"
    end = time.perf_counter()
    return {"ok": not error, "error": error, "ttft_s": (first or end) - start, "prompt_tokens": prompt,
            "cached_tokens": cached}


async def replay(base_url: str, specs: list[RequestSpec]) -> tuple[list[dict], float]:
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="k", timeout=600, max_retries=0)
    start = time.perf_counter()

    async def timed(spec: RequestSpec) -> dict:
        await asyncio.sleep(max(0.0, spec.send_at_s - (time.perf_counter() - start)))
        return await one(client, spec)

    results = await asyncio.gather(*(timed(s) for s in specs))
    await client.close()
    return list(results), time.perf_counter() - start


def wait_replicas(n: int, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        app = serve.status().applications.get(platform_app.APP_NAME)
        model = app.deployments.get("Model") if app else None
        if model and model.replica_states.get("RUNNING", 0) >= n:
            return
        time.sleep(0.5)
    raise TimeoutError(f"{n} Model replicas not RUNNING after {timeout_s}s")


def served_per_replica(metrics_url: str) -> dict:
    """Requests each Model replica served, and our router's decisions by reason (when it ran), from
    the Prometheus export of this Ray session."""
    served: dict[str, float] = {}
    decisions: dict[str, float] = {}
    text = httpx.get(metrics_url, timeout=30).text
    for line in text.splitlines():
        if line.startswith("ray_serve_deployment_request_counter") and 'deployment="Model"' in line \
                and 'route="/"' not in line:
            replica = re.search(r'replica="([^"]+)"', line)
            if replica:
                served[replica.group(1)] = served.get(replica.group(1), 0) + float(line.rsplit(" ", 1)[1])
        elif line.startswith("ray_msaserve_router_decisions"):
            reason = re.search(r'reason="([^"]+)"', line)
            if reason:
                decisions[reason.group(1)] = decisions.get(reason.group(1), 0) + float(line.rsplit(" ", 1)[1])
    return {"served_per_replica": sorted(served.values()), "router_decisions": decisions}


def run_router(router: str, args: argparse.Namespace, specs: list[RequestSpec],
               warm: list[RequestSpec]) -> dict:
    default = platform_app.router_config
    if router != "kv_aware":
        platform_app.router_config = lambda _section: ray_router_config(router)
    try:
        with start_live_app(app_config(args.replicas, args.num_pages, args.max_num_seqs,
                                   json.loads(args.router_section)), timeout_s=240) as app:
            wait_replicas(args.replicas)
            asyncio.run(replay(app.base_url, warm))  # both engines compiled and answering
            results, wall = asyncio.run(replay(app.base_url, specs))
            time.sleep(2.5)  # one more metrics export
            placement = served_per_replica(app.metrics_url)
    finally:
        platform_app.router_config = default
    ok = [r for r in results if r["ok"]]
    errors = sorted({r["error"] for r in results if not r["ok"]})
    if not ok:
        raise RuntimeError(f"{router}: every request failed, e.g. {errors[:3]}")
    ttft = [r["ttft_s"] for r in ok]
    row = {"router": router, "requests": len(results), "failed": len(results) - len(ok), "wall_s": wall,
           "ttft_p50_s": percentile(ttft, 0.5), "ttft_p90_s": percentile(ttft, 0.9),
           "ttft_p99_s": percentile(ttft, 0.99),
           "errors": errors[:5], **placement,
           "prefix_hit_rate": sum(r["cached_tokens"] for r in ok)
           / max(1, sum(r["prompt_tokens"] for r in ok))}
    print(f"  {router}: {row}", file=sys.stderr, flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", default=str(DEFAULT_TRACE))
    parser.add_argument("--routers", default=",".join(ROUTERS))
    parser.add_argument("--start", type=int, default=3000, help="first trace row of the slice")
    parser.add_argument("--limit", type=int, default=300, help="trace rows in the slice")
    parser.add_argument("--block-tokens", type=int, default=32, help="tokens per 512-token trace block")
    parser.add_argument("--time-scale", type=float, default=1.0, help="× the trace's inter-arrival times")
    parser.add_argument("--max-input", type=int, default=4000, help="prompt tokens cap")
    parser.add_argument("--max-output", type=int, default=8, help="output tokens cap")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--num-pages", type=int, default=1280, help="KV pages per replica (16 tokens)")
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--router-section", default="{}",
                        help="JSON of ServeConfig router fields for kv_aware (default: the platform's)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "router_live_compare.json"))
    parser.add_argument("--summary", action="store_true", help="also merge the entries into summary.json")
    args = parser.parse_args(argv)
    specs = slice_requests(Path(args.trace), args.start, args.limit, args.block_tokens, args.max_input,
                           args.max_output, args.time_scale)
    warm = [RequestSpec([3 + (i * 7 + j) % 240 for j in range(40)], 2, 0.0) for i in range(4 * args.replicas)]
    rows = [run_router(r, args, specs, warm) for r in args.routers.split(",")]
    span = specs[-1].send_at_s
    meta = {"command": "python benchmarks/router/live_compare.py " + " ".join(argv if argv is not None
                                                                               else sys.argv[1:]),
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "git_revision": git_revision(),
            "hardware": f"live: local Ray Serve on a shared 2-core CPU machine, {args.replicas} CPU replicas "
                        f"of the tiny preset ({args.num_pages} pages of 16 tokens, max_num_seqs "
                        f"{args.max_num_seqs}), requests through the HTTP API",
            "note": f"rows {args.start}..{args.start + len(specs) - 1} of {Path(args.trace).name} over "
                    f"{span:.0f} s (time scale {args.time_scale}), {args.block_tokens} tokens per trace "
                    "block, "
                    f"prompts capped at {args.max_input} tokens, "
                    f"outputs at {args.max_output}; every router from the same script run, a fresh app each"}
    entries = {}
    for row in rows:
        for key, unit in (("ttft_p50_s", "s"), ("ttft_p90_s", "s"), ("ttft_p99_s", "s"),
                          ("prefix_hit_rate", "fraction of prompt tokens"), ("failed", "requests")):
            entries[f"router.live.{row['router']}.{key}"] = {"value": round(row[key], 4), "unit": unit,
                                                              **meta}
    by = {r["router"]: r for r in rows}
    if "kv_aware" in by and "ray_pow2" in by:
        for q in ("p50", "p90"):
            entries[f"router.live.{q}_ttft_ratio_vs_ray_pow2"] = {
                "value": round(by["ray_pow2"][f"ttft_{q}_s"] / by["kv_aware"][f"ttft_{q}_s"], 4), "unit": "x",
                **meta}
    out = Path(args.out)
    out.write_text(json.dumps(entries, indent=2) + "\n")
    out.with_name(out.stem + "_rows.json").write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    if args.summary:
        merge_into_summary(entries, out)
    print(f"{'router':22s} {'reqs':>5} {'fail':>4} {'p50 s':>7} {'p90 s':>7} {'p99 s':>7} {'hit':>6} "
          f"{'wall s':>7} served per replica")
    for r in rows:
        print(f"{r['router']:22s} {r['requests']:>5} {r['failed']:>4} {r['ttft_p50_s']:>7.3f} "
              f"{r['ttft_p90_s']:>7.3f} {r['ttft_p99_s']:>7.3f} {r['prefix_hit_rate']:>6.3f} "
              f"{r['wall_s']:>7.1f} {r['served_per_replica']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
