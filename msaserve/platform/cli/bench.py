"""`msaserve bench`: TTFT / TPOT / throughput of a running server, per concurrency level or trace."""

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

from msaserve.platform.cli.arg_types import (
    non_negative_int,
    positive_float,
    positive_int,
    positive_int_list,
)
from msaserve.platform.loadgen import (
    LevelResult,
    run_closed_loop,
    run_trace,
    synthetic_requests,
    trace_requests,
)

DEFAULT_URL = "http://127.0.0.1:8000/v1"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="Benchmark a running msaserve server (TTFT, TPOT, throughput).")
    p.add_argument("--url", default=DEFAULT_URL, help=f"API base URL (default {DEFAULT_URL}).")
    p.add_argument("--api-key", default=os.environ.get("MSASERVE_API_KEY", "none"))
    p.add_argument("--model", help="Model name (default: the server's first model).")
    p.add_argument(
        "--concurrency", type=positive_int_list, default=[1, 4, 16],
        help="Comma-separated closed-loop levels (default 1,4,16).",
    )
    p.add_argument("--requests", type=non_negative_int, default=0,
                   help="Requests per level (default 0: 2 × concurrency).")
    p.add_argument("--prompt-tokens", type=positive_int, default=128,
                   help="Prompt length of synthetic requests.")
    p.add_argument("--max-tokens", type=positive_int, default=32,
                   help="Output tokens per request (EOS ignored).")
    p.add_argument("--trace", type=Path, help="Replay a Mooncake-format JSONL trace instead of levels.")
    p.add_argument("--trace-limit", type=positive_int, default=32, help="Requests taken from the trace.")
    p.add_argument("--max-input", type=positive_int, default=1024,
                   help="Cap on a trace request's prompt tokens.")
    p.add_argument("--max-output", type=positive_int, default=32,
                   help="Cap on a trace request's output tokens.")
    p.add_argument(
        "--time-scale", type=positive_float, default=1.0, help="Multiply trace inter-arrival times by this."
    )
    p.add_argument("--json-out", type=Path, help="Also write the summaries as JSON here.")
    p.set_defaults(func=run)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def format_table(summaries: list[dict]) -> str:
    header = (
        f"{'level':>12} {'reqs':>5} {'fail':>5} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} "
        f"{'TPOT p99':>9} {'e2e p50':>9} {'tok/s':>8} {'req/s':>7}"
    )
    lines = [header, "-" * len(header)]
    for s in summaries:
        lines.append(
            f"{s['label']:>12} {s['requests']:>5} {s['failed']:>5} {_ms(s['ttft_p50_s']):>9} "
            f"{_ms(s['ttft_p99_s']):>9} {_ms(s['tpot_p50_s']):>9} {_ms(s['tpot_p99_s']):>9} "
            f"{_ms(s['e2e_p50_s']):>9} {s['output_tokens_per_s']:>8.1f} {s['requests_per_s']:>7.2f}"
        )
    lines.append("(times in ms; tok/s = output tokens per second of wall time)")
    return "\n".join(lines)


async def bench(args: argparse.Namespace) -> list[LevelResult]:
    import openai
    from tqdm import tqdm

    client = openai.AsyncOpenAI(base_url=args.url, api_key=args.api_key, max_retries=0, timeout=600)
    model = args.model or (await client.models.list()).data[0].id
    levels: list[LevelResult] = []
    if args.trace:
        specs = trace_requests(args.trace, args.trace_limit, args.max_input, args.max_output, args.time_scale)
        with tqdm(total=len(specs), desc="trace", unit="req") as bar:
            levels.append(await run_trace(client, model, specs, "trace", bar.update))
        return levels
    for concurrency in args.concurrency:
        n = args.requests or 2 * concurrency
        specs = synthetic_requests(n, args.prompt_tokens, args.max_tokens, seed=concurrency)
        with tqdm(total=n, desc=f"c={concurrency}", unit="req") as bar:
            levels.append(
                await run_closed_loop(client, model, specs, concurrency, f"c={concurrency}", bar.update)
            )
    return levels


def run(args: argparse.Namespace) -> int:
    import openai

    if args.trace is not None and not args.trace.is_file():
        print(f"msaserve bench: --trace={args.trace} is not a file: allowed a Mooncake-format JSONL trace",
              file=sys.stderr)
        return 2
    try:
        levels = asyncio.run(bench(args))
    except openai.APIError as e:  # the model lookup: no server there, or a wrong key
        print(f"msaserve bench: cannot reach {args.url}: {e}", file=sys.stderr)
        return 1
    summaries = [level.summary() for level in levels]
    errors = [r.error for level in levels for r in level.results if not r.ok]
    if errors:
        print(f"{len(errors)} requests failed; first: {errors[0]}", file=sys.stderr)
    if args.json_out:
        args.json_out.write_text(json.dumps(summaries, indent=2))
    print(format_table(summaries))
    return 1 if errors else 0
