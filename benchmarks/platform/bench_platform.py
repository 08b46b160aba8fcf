"""Platform benchmarks on CPU, written to benchmarks/results/platform.json.

1. Gateway overhead: the same requests (tiny preset, 32 prompt tokens, 8 output tokens, greedy)
   sent (a) straight to an in-process `AsyncEngine` and (b) over HTTP through the Serve app
   (proxy → Gateway → Model replica → engine). Reported: added latency = gateway percentile −
   direct percentile, for end-to-end latency (non-streaming) and TTFT (streaming).
2. `msaserve bench` at concurrency 1 / 4 / 16 against the default app (SmolLM2-135M on CPU).

    .venv/bin/python benchmarks/platform/bench_platform.py [--quick]
"""

import argparse
import asyncio
import json
import platform
import random
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import openai
import ray
from ray import serve

from msaserve.engine.async_engine import AsyncEngine
from msaserve.engine.types import GenerateRequest, SamplingParams
from msaserve.platform.app import APP_NAME, build_app
from msaserve.platform.cli.bench import format_table
from msaserve.platform.config import ServeConfig
from msaserve.platform.loadgen import percentile, run_closed_loop, synthetic_requests
from msaserve.platform.model_deployment import engine_config_from

RESULTS = Path(__file__).resolve().parents[1] / "results" / "platform.json"
PORT = 8421
PROMPT_TOKENS, OUTPUT_TOKENS = 32, 8


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 250) for _ in range(PROMPT_TOKENS)] for _ in range(n)]


async def direct_latencies(engine: AsyncEngine, ids: list[list[int]], tag: str) -> tuple[list, list]:
    e2e, ttft = [], []
    for i, prompt in enumerate(ids):
        params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
        start, first = time.perf_counter(), None
        async for _out in engine.generate(GenerateRequest(f"{tag}-{i}", prompt, params)):
            first = first or time.perf_counter()
        e2e.append(time.perf_counter() - start)
        ttft.append(first - start)
    return e2e, ttft


async def gateway_latencies(http: httpx.AsyncClient, model: str, ids: list[list[int]]) -> tuple[list, list]:
    e2e, ttft = [], []
    body = {"model": model, "max_tokens": OUTPUT_TOKENS, "temperature": 0.0, "ignore_eos": True}
    for prompt in ids:
        start = time.perf_counter()
        (await http.post("/v1/completions", json={**body, "prompt": prompt})).raise_for_status()
        e2e.append(time.perf_counter() - start)
        start, first = time.perf_counter(), None
        async with http.stream(
            "POST", "/v1/completions", json={**body, "prompt": prompt, "stream": True}
        ) as r:
            async for line in r.aiter_lines():  # read to the end: requests must not overlap
                if first is None and line.startswith("data: {"):
                    first = time.perf_counter()
        ttft.append(first - start)
    return e2e, ttft


def start_app(config: ServeConfig) -> str:
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    serve.run(build_app(config), name=APP_NAME, route_prefix="/")
    base = f"http://127.0.0.1:{PORT}"
    while httpx.get(base + "/ready", timeout=30).status_code != 200:
        time.sleep(0.5)
    return base


async def gateway_overhead(n: int) -> dict:
    """One event loop for everything: the in-process engine delivers outputs to the loop it started in."""
    config = ServeConfig.from_dict({"model": {"spec": "tiny"}})
    base = start_app(config)
    name = config.model.resolved_name()
    engine = AsyncEngine(engine_config_from(config))
    await engine.start()
    ids = prompts(n)
    direct_e2e, direct_ttft, gw_e2e, gw_ttft = [], [], [], []
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        await gateway_latencies(http, name, prompts(10))  # warm-up
        await direct_latencies(engine, prompts(10), "warm")
        for block in range(0, n, 20):  # alternate blocks so drift hits both sides alike
            chunk = ids[block : block + 20]
            e, t = await direct_latencies(engine, chunk, f"d{block}")
            direct_e2e += e
            direct_ttft += t
            e, t = await gateway_latencies(http, name, chunk)
            gw_e2e += e
            gw_ttft += t
    await engine.shutdown()
    serve.delete(APP_NAME)
    rows = {}
    for key, direct, gateway in [("e2e", direct_e2e, gw_e2e), ("ttft", direct_ttft, gw_ttft)]:
        for q in (50, 99):
            rows[f"{key}_p{q}"] = (percentile(direct, q), percentile(gateway, q))
    return rows


async def serving_levels(levels: list[int], max_tokens: int, prompt_tokens: int) -> list[dict]:
    base = start_app(ServeConfig())
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    await run_closed_loop(
        client, model, synthetic_requests(2, prompt_tokens, 4, seed=99), 1, "warm", lambda: None
    )
    summaries = []
    for c in levels:
        specs = synthetic_requests(max(4, 2 * c), prompt_tokens, max_tokens, seed=c)
        summaries.append((await run_closed_loop(client, model, specs, c, f"c={c}", lambda: None)).summary())
    serve.delete(APP_NAME)
    return summaries


def entry(value: float, unit: str, command: str) -> dict:
    revision = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    return {
        "value": round(value, 3), "unit": unit, "command": command,
        "hardware": f"CPU only: {platform.processor() or platform.machine()}, 2 cores shared, Ray local",
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "git_revision": revision,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Fewer requests (smoke run).")
    args = parser.parse_args()
    command = "make setup && .venv/bin/python benchmarks/platform/bench_platform.py" + (
        " --quick" if args.quick else ""
    )
    ray.init(
        address="local", num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False
    )
    try:
        overhead = asyncio.run(gateway_overhead(40 if args.quick else 200))
        levels = asyncio.run(
            serving_levels([1, 4, 16], max_tokens=16 if args.quick else 32, prompt_tokens=64)
        )
    finally:
        serve.shutdown()
        ray.shutdown()
    results = {}
    for key, (direct, gateway) in overhead.items():
        results[f"platform.gateway_added_{key}_ms"] = entry((gateway - direct) * 1000, "ms", command)
        results[f"platform.direct_engine_{key}_ms"] = entry(direct * 1000, "ms", command)
    for s in levels:
        c = s["label"].removeprefix("c=")
        results[f"platform.smollm2_cpu_c{c}_ttft_p50_ms"] = entry(s["ttft_p50_s"] * 1000, "ms", command)
        results[f"platform.smollm2_cpu_c{c}_tpot_p50_ms"] = entry(s["tpot_p50_s"] * 1000, "ms", command)
        results[f"platform.smollm2_cpu_c{c}_output_tokens_per_s"] = entry(
            s["output_tokens_per_s"], "tokens/s", command
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {RESULTS}\n")
    print("Gateway overhead (tiny preset, 32 prompt + 8 output tokens, sequential requests)")
    print(f"{'metric':>10} {'direct engine':>14} {'through gateway':>16} {'added':>9}")
    for key, (direct, gateway) in overhead.items():
        added = (gateway - direct) * 1000
        print(f"{key:>10} {direct * 1000:>11.2f} ms {gateway * 1000:>13.2f} ms {added:>6.2f} ms")
    print("\nmsaserve bench, SmolLM2-135M on CPU (64 prompt tokens, EOS ignored)")
    print(format_table(levels))


if __name__ == "__main__":
    main()
