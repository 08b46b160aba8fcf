"""KV events live: does the router's view of every replica equal the replica's own hash set?

Starts the msaserve app locally (real Ray Serve, 2 CPU replicas of the `tiny` preset with a small
KV cache, so that prefixes are evicted as well as stored), drives generate calls through a handle
from this process for `--seconds` (the router that places them is the real MSARequestRouter,
reachable through `serve_router.live_cores()`), lets the replicas go idle, then asks each replica
for its snapshot and compares: events lost = hashes in one set and not the other. Also counts the
payloads, deltas replayed, gaps, snapshot resyncs and placements that differ from the decision.

    python benchmarks/router/live_events.py [--seconds 20] [--concurrency 12]
"""

import argparse
import datetime
import json
import random
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from local_serve_app import start_live_app  # noqa: E402

from msaserve.engine.types import GenerateRequest, SamplingParams  # noqa: E402
from msaserve.router.core import ROUTING_TARGET  # noqa: E402
from msaserve.router.serve_router import live_cores  # noqa: E402
from msaserve.router.stats import parse_routing_stats  # noqa: E402

CONFIG = {
    "model": {"spec": "tiny"},
    "engine": {"max_num_seqs": 8, "max_waiting": 256, "max_model_len": 2048, "num_pages": 160},
    "router": {"policy": "kv_aware", "stats_period_s": 0.1},
    "auth": {"api_keys": ["k"]},
    "deployments": {"model": {"num_replicas": 2, "max_ongoing_requests": 64,
                              "ray_actor_options": {"num_cpus": 0.5}}},
}


def drive(handle, seconds: float, concurrency: int, seed: int) -> int:
    """Closed-loop traffic: prompts share one of 12 prefixes (hits) and add random pages (misses,
    and evictions once the 160-page caches fill)."""
    stop = time.monotonic() + seconds
    count = [0]
    prefixes = [[random.Random(p).randrange(3, 250) for _ in range(64)] for p in range(12)]

    def worker(w: int) -> None:
        rng = random.Random(seed * 100 + w)
        while time.monotonic() < stop:
            prompt = rng.choice(prefixes) + [rng.randrange(3, 250) for _ in range(rng.randrange(16, 200))]
            sampling = SamplingParams(max_tokens=4, temperature=0.0)
            request = GenerateRequest(f"w{w}-{count[0]}", prompt, sampling)
            for _ in handle.generate.remote(request):
                pass
            count[0] += 1

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return count[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "router_live.json"))
    args = parser.parse_args(argv)
    with start_live_app(CONFIG, timeout_s=180) as app:
        handle = app.model_handle()
        stream = handle.options(stream=True)
        drive(stream, 3.0, 2, args.seed + 1)  # warm-up: both engines up
        start = time.monotonic()
        requests = drive(stream, args.seconds, args.concurrency, args.seed)
        elapsed = time.monotonic() - start
        time.sleep(1.0)  # idle: hash sets stop changing, the last payloads arrive
        core = max(live_cores(), key=lambda c: len(c.placements))
        rows = []
        for replica_id, view in sorted(core.state.replicas.items()):
            answer = handle.routing_snapshot.remote({ROUTING_TARGET: replica_id}).result(timeout_s=30)
            snapshot = parse_routing_stats(answer)
            deadline = time.monotonic() + 5
            while view.stats_seq < snapshot.seq and time.monotonic() < deadline:
                time.sleep(0.05)
            held = set(snapshot.snapshot)
            rows.append({"replica": replica_id, "events": snapshot.num_events, "held": len(held),
                         "lost": len(held ^ view.cached), "seq": snapshot.seq, "router_seq": view.stats_seq,
                         "deltas_applied": view.deltas_applied, "snapshots": view.snapshots_applied,
                         "gaps": view.gaps, "mismatches": view.mismatches})
        wrong = sum(1 for _, d, routed in core.placements if d.replica_id != routed)
    lost = sum(r["lost"] for r in rows)
    events = sum(r["events"] for r in rows)
    meta = {"command": "python benchmarks/router/live_events.py " + " ".join(argv or sys.argv[1:]),
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "git_revision": _git_revision(),
            "hardware": "local Ray Serve on a 2-core CPU machine, 2 replicas of the tiny preset",
            "note": f"{requests} requests in {elapsed:.0f} s at concurrency {args.concurrency}; "
                    f"{events} KV hash events ({events / elapsed:.0f}/s); router resyncs {core.log.resyncs}; "
                    f"placements different from the decision (Serve spills): {wrong}"}
    entries = {"router.live_events_lost": {"value": lost, "unit": "page hashes", **meta},
               "router.live_kv_events": {"value": events, "unit": "page hashes stored or removed", **meta}}
    Path(args.out).write_text(json.dumps(entries, indent=2) + "\n")
    print(f"{'replica':10s} {'events':>8} {'held':>6} {'lost':>5} {'seq':>5} {'r.seq':>5} {'deltas':>7} "
          f"{'snaps':>5} {'gaps':>4} {'mism':>4}")
    for r in rows:
        print(f"{r['replica']:10s} {r['events']:>8} {r['held']:>6} {r['lost']:>5} {r['seq']:>5} "
              f"{r['router_seq']:>5} {r['deltas_applied']:>7} {r['snapshots']:>5} {r['gaps']:>4} "
              f"{r['mismatches']:>4}")
    print(f"{requests} requests, {events} KV hash events, lost {lost}, resyncs {core.log.resyncs}, "
          f"placements ≠ decision {wrong}")
    return 0


def _git_revision() -> str:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=ROOT).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
