"""Soak: the real platform (local Ray Serve, `tiny`, 2 model replicas, KV cache service on) under a
closed-loop client for --duration seconds after a warm-up; optionally a model replica killed every
--kill-every seconds.

    .venv/bin/python benchmarks/reliability/soak.py --concurrency 12 [--duration 600]
    .venv/bin/python benchmarks/reliability/soak.py --concurrency 12 --kill-every 120
    .venv/bin/python benchmarks/reliability/soak.py --probe 4,8,16 --probe-s 40   # find a concurrency

Workload (soak_client.py): half multi-turn sessions (X-Session-Id; every turn checked exactly
against a fault-free reference through the session's record in the KV cache service),
half one-shot requests; streaming or not at random. Per minute: requests, errors (not 2xx, or a
stream without [DONE]), p50/p99 TTFT (streamed requests), RSS of the driver and every Ray process
(sampled every 10 s). RSS growth = mean of the last minute vs the first minute after warm-up.
With --kill-every: a failure that overlaps a kill is an in-flight cut, any other is an error on a
new request; a session is lost when it overlaps a kill and does not finish exactly.
Writes reliability.soak_* (or reliability.kill_*) to benchmarks/results/reliability.json.
"""

import argparse
import asyncio
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "reliability"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from local_serve_app import start_live_app  # noqa: E402
from reliability_sessions import make_scripts, record_reader, reference_engine  # noqa: E402
from soak_client import SoakState, killer, rss_sampler, worker  # noqa: E402
from soak_report import minute_rows, print_table, soak_summary  # noqa: E402

from msaserve.platform.config import ServeConfig  # noqa: E402

SERVE_CONFIG = {
    "model": {"spec": "tiny"},
    "engine": {"max_num_seqs": 8, "max_waiting": 32, "max_model_len": 1024},
    "kvcache": {"enabled": True, "memory_bytes": 64 << 20},
    "router": {"stats_period_s": 0.5},
    "deployments": {"model": {"num_replicas": 2, "max_ongoing_requests": 16,
                              "ray_actor_options": {"num_cpus": 0.5}}},
}  # fmt: skip
RESULTS = ROOT / "benchmarks" / "results" / "reliability.json"
HARDWARE = "2-core CPU dev machine"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


async def drive(
    state: SoakState, concurrency: int, seconds: float, on_minute, kill_every: float, warmup_s: float
) -> float:
    """Run the workers for warmup_s + seconds; returns the monotonic time the measurement began."""
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=10.0), limits=limits) as http:
        state.concurrency = concurrency
        tasks = [asyncio.create_task(worker(state, http, i)) for i in range(concurrency)]
        tasks.append(asyncio.create_task(rss_sampler(state)))
        measure_from = time.monotonic() + warmup_s
        if kill_every > 0:  # kills mid-way through each period, so every kill is watched for a while
            tasks.append(asyncio.create_task(killer(state, measure_from + kill_every / 2, kill_every, log)))
        end = measure_from + seconds
        next_minute = time.monotonic() + 60
        while time.monotonic() < end:
            await asyncio.sleep(min(1.0, max(0.0, end - time.monotonic())))
            if time.monotonic() >= next_minute:
                on_minute(measure_from)
                next_minute += 60
        state.stop = True
        await asyncio.wait(tasks, timeout=180)
    return measure_from


def progress(state: SoakState):
    def on_minute(measure_from: float) -> None:
        completed = round((time.monotonic() - measure_from) / 60)  # the minute that just ended
        rows = [r for r in minute_rows(state, measure_from) if r["minute"] == completed]
        if rows:
            r = rows[0]
            log(f"minute {r['minute']:>3}: {r['requests']} requests, {r['errors']} errors, "
                f"TTFT p50 {r['ttft_p50_ms']} ms p99 {r['ttft_p99_ms']} ms, RSS {r['rss_mib']} MiB, "
                f"{len(state.kills)} kills")  # fmt: skip

    return on_minute


def git_revision() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip()


def write_results(figures: dict[str, tuple[float, str]], command: str) -> None:
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    for name, (value, unit) in figures.items():
        results[name] = {"value": value, "unit": unit, "command": command, "hardware": HARDWARE,
                         "date": date, "git_revision": git_revision()}  # fmt: skip
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")


def probe(args, config: ServeConfig, scripts, read) -> None:
    from soak_report import level_row

    rows = []
    for level in [int(x) for x in args.probe.split(",")]:
        state = SoakState(args.url, config.model.resolved_name(), scripts, read, args.seed)
        measure_from = asyncio.run(drive(state, level, args.probe_s, lambda _: None, 0, 15.0))
        rows.append(level_row(state, measure_from, level))
        log(f"probe {rows[-1]}")
    print(f"\n{'concurrency':>11} {'req/s':>7} {'errors':>6} {'TTFT p50 ms':>11} {'TTFT p99 ms':>11}")
    for r in rows:
        print(f"{r['concurrency']:>11} {r['req_per_s']:>7} {r['errors']:>6} {r['ttft_p50_ms']:>11} "
              f"{r['ttft_p99_ms']:>11}")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--duration", type=float, default=600.0, help="measured seconds after warm-up")
    parser.add_argument("--warmup", type=float, default=60.0)
    parser.add_argument("--kill-every", type=float, default=0.0, help="kill a model replica this often (s)")
    parser.add_argument("--scripts", type=int, default=96, help="distinct session scripts")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--probe", default="", help="comma-separated concurrencies to try, then exit")
    parser.add_argument("--probe-s", type=float, default=40.0)
    parser.add_argument("--no-write", action="store_true", help="do not write the JSON (smoke runs)")
    parser.add_argument(
        "--gcs-task-events", type=int, default=0,
        help="cap on task events the GCS keeps (RAY_task_events_max_num_task_in_gcs), overriding msaserve's "
        "default of 10,000 (Ray's own: 100,000); figures then go under soak_gcs<N>_ / kill_gcs<N>_",
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(1)  # the reference model is tiny; leave the cores to the platform

    config = ServeConfig.from_dict(SERVE_CONFIG)
    start = time.monotonic()
    engine, tokenizer = reference_engine(config)
    scripts = make_scripts(engine, tokenizer, args.scripts, args.turns, args.seed)
    log(f"{len(scripts)} session scripts × {args.turns} turns made in {time.monotonic() - start:.0f} s")
    if args.gcs_task_events:  # read by gcs_server, which inherits this process's environment
        os.environ["RAY_task_events_max_num_task_in_gcs"] = str(args.gcs_task_events)  # noqa: SIM112
    with start_live_app(SERVE_CONFIG) as app:
        args.url = app.base_url
        read = record_reader(app.config, engine)
        if args.probe:
            probe(args, config, scripts, read)
            return 0
        state = SoakState(app.base_url, config.model.resolved_name(), scripts, read, args.seed)
        log(
            f"soak: concurrency {args.concurrency}, {args.warmup:.0f} s warm-up + {args.duration:.0f} s"
            + (f", a model replica killed every {args.kill_every:.0f} s" if args.kill_every else "")
        )
        measure_from = asyncio.run(
            drive(state, args.concurrency, args.duration, progress(state), args.kill_every, args.warmup)
        )
    summary = soak_summary(state, measure_from, args.kill_every > 0)
    print_table(state, measure_from, summary)
    if not args.no_write:
        command = (
            f"python benchmarks/reliability/soak.py --concurrency {args.concurrency} --duration "
            f"{args.duration:.0f}"
            + (f" --kill-every {args.kill_every:.0f}" if args.kill_every else "")
            + (f" --gcs-task-events {args.gcs_task_events}" if args.gcs_task_events else "")
        )
        figures = {k: v for k, v in summary.items() if k.startswith("reliability.")}
        if args.gcs_task_events:  # a variant: kept apart from the figures under msaserve's defaults
            tag = f"gcs{args.gcs_task_events}_"
            figures = {k.replace("soak_", "soak_" + tag).replace("kill_", "kill_" + tag): v
                       for k, v in figures.items()}  # fmt: skip
        write_results(figures, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
