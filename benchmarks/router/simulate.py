"""Replay a request trace against N simulated replicas under each routing policy.

The router side is the production code: `msaserve.router` policies over `RouterState`, fed by
`routing_stats_payload` / `parse_routing_stats` every `--stats-period-s` (so the router sees KV
events and load as late as it would live) plus its own estimates of what it routed since. The
replica side is `replica_model.py` (chunked prefill, LRU prefix cache of the trace's 512-token
blocks, finite KV pages), priced by a calibration (`--calibration`, default: H200 figures from
docs/environment.md, see `Calibration.default`).

Trace rows (JSONL): timestamp (ms), input_length, output_length, hash_ids (512-token prefix
blocks; equal ids = equal prefix). `--scales` compresses arrival times (scale 2 = twice the
rate) for 4 replicas; with N replicas each scale is multiplied by N/4 so that the load per replica
is the same across replica counts. A load is *sustained* when the last request finishes within
max(30 s, 5% of the arrival span) after the last arrival.

    .venv/bin/python benchmarks/router/simulate.py [--trace PATH] [--replicas 4,8] [--scales ...]
"""

import argparse
import datetime
import json
import math
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from replica_model import Calibration, SimReplica, SimRequest

from msaserve.engine.types import EngineStats, KVEvent
from msaserve.router.kv_aware import POLICIES, KVAwareConfig, make_policy
from msaserve.router.state import RequestView, RouterState, estimate_expiry_for
from msaserve.router.stats import RoutingStatsRecorder, parse_routing_stats, routing_stats_payload

DEFAULT_TRACE = str(Path(__file__).resolve().parents[1] / "data" / "mooncake_synthetic_trace.jsonl")


def load_trace(path: str, limit: int | None = None) -> list[dict]:
    rows = []
    with open(path) as f:
        for i, line in enumerate(f):
            if limit is not None and i >= limit:
                break
            row = json.loads(line)
            for key in ("timestamp", "input_length", "output_length", "hash_ids"):
                if key not in row:
                    raise ValueError(f"{path}:{i + 1}: trace row lacks {key!r}")
            rows.append(row)
    return sorted(rows, key=lambda r: r["timestamp"])


def _events(replica: SimReplica) -> list[KVEvent]:
    """The replica's (kind, hash) log as KV events, in order (runs of one kind grouped)."""
    out: list[KVEvent] = []
    for kind, h in replica.events:
        if out and out[-1].kind == kind:
            out[-1].page_hashes.append(h)
        else:
            out.append(KVEvent(kind, [h]))
    replica.events.clear()
    return out


def _publish(replica: SimReplica, recorder: RoutingStatsRecorder, state: RouterState, now: float) -> None:
    stats = EngineStats(
        num_running=len(replica.prefilling) + len(replica.decoding), num_waiting=len(replica.waiting),
        num_free_pages=replica.free_pages(), num_total_pages=replica.capacity,
    )
    payload = routing_stats_payload(stats, _events(replica), recorder,
                                    waiting_prefill_pages=replica.waiting_prefill_pages())
    parsed = parse_routing_stats(payload)
    assert parsed is not None
    state.apply_stats(replica.replica_id, parsed, now)


def run(trace: list[dict], policy_name: str, n_replicas: int, scale: float, cal: Calibration,
        stats_period_s: float, kv_cfg: KVAwareConfig, seed: int = 0) -> dict:
    clock = [0.0]
    state = RouterState(estimate_expiry_s=estimate_expiry_for(stats_period_s))
    policy = make_policy(policy_name, state, random.Random(seed), kv_aware=kv_cfg)
    replicas = {f"r{i}": SimReplica(f"r{i}", cal, cal.capacity_pages) for i in range(n_replicas)}
    recorders = {rid: RoutingStatsRecorder(clock=lambda: clock[0]) for rid in replicas}
    state.sync_replicas(replicas)
    t0 = trace[0]["timestamp"]
    requests, decisions, predicted = [], Counter(), 0
    next_stats = 0.0
    for i, row in enumerate(trace):
        t = (row["timestamp"] - t0) / 1000.0 / scale
        while next_stats <= t:
            clock[0] = next_stats
            for rid, replica in replicas.items():
                replica.advance(next_stats)
                _publish(replica, recorders[rid], state, next_stats)
            next_stats += stats_period_s
        for replica in replicas.values():
            replica.advance(t)
        req = SimRequest(i, t, row["input_length"], max(1, row["output_length"]), list(row["hash_ids"]))
        req.out_pages = math.ceil((req.input_tokens + req.output_tokens) / cal.page_tokens) - len(req.blocks)
        view = RequestView(str(i), req.blocks, req.pages)
        decision = policy.choose(view, [state.replicas[rid] for rid in replicas], t)
        state.on_routed(view, decision.replica_id, t)
        decisions[decision.reason] += 1
        predicted += decision.predicted_hit_pages
        req.replica = decision.replica_id
        replicas[decision.replica_id].waiting.append(req)
        requests.append(req)
    for replica in replicas.values():
        replica.advance(math.inf)
    return summarize(requests, replicas, decisions, predicted, cal)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summarize(requests: list[SimRequest], replicas: dict[str, SimReplica], decisions: Counter,
              predicted_hit_pages: int, cal: Calibration) -> dict:
    ttft = [r.first_token - r.arrival for r in requests]  # type: ignore[operator]
    last_arrival = max(r.arrival for r in requests)
    span = last_arrival - min(r.arrival for r in requests)
    makespan = max(r.finish for r in requests) - min(r.arrival for r in requests)  # type: ignore[type-var]
    drain = max(r.finish for r in requests) - last_arrival  # type: ignore[operator]
    hit_tokens = sum(min(r.hit_blocks * cal.page_tokens, r.input_tokens) for r in requests)
    busy = [rep.busy_s for rep in replicas.values()]
    return {
        "ttft_p50_s": _percentile(ttft, 0.5),
        "ttft_p90_s": _percentile(ttft, 0.9),
        "prefix_hit_rate": hit_tokens / sum(r.input_tokens for r in requests),
        "predicted_hit_pages": predicted_hit_pages,
        "actual_hit_pages": sum(r.hit_blocks for r in requests),
        "throughput_tok_s": sum(r.output_tokens for r in requests) / makespan,
        "throughput_req_s": len(requests) / makespan,
        "offered_req_s": len(requests) / span if span > 0 else math.inf,
        "load_imbalance": max(busy) / (sum(busy) / len(busy)) if sum(busy) else 1.0,
        "drain_s": drain,
        "sustained": drain <= max(30.0, 0.05 * span),
        "decisions": dict(decisions),
    }


def sweep(trace: list[dict], replica_counts: list[int], scales: list[float], cal: Calibration,
          stats_period_s: float, kv_cfg: KVAwareConfig, seed: int) -> list[dict]:
    rows = []
    for n in replica_counts:
        for scale in scales:
            for policy in POLICIES:
                result = run(trace, policy, n, scale * n / 4, cal, stats_period_s, kv_cfg, seed)
                rows.append({"replicas": n, "scale": scale, "policy": policy, **result})
                print(f"  {n} replicas, scale {scale:.2f}, {policy:16s} "
                      f"p90 TTFT {result['ttft_p90_s']:8.2f} s  hit {result['prefix_hit_rate']:.3f}",
                      file=sys.stderr, flush=True)
    return rows


def headline(rows: list[dict], n: int) -> dict | None:
    """At the highest load pow2 sustains with n replicas: pow2's p90 TTFT over kv_aware's."""
    pow2 = [r for r in rows if r["replicas"] == n and r["policy"] == "pow2" and r["sustained"]]
    if not pow2:
        return None
    top = max(pow2, key=lambda r: r["scale"])
    kv = next(r for r in rows
              if r["replicas"] == n and r["policy"] == "kv_aware" and r["scale"] == top["scale"])
    return {"replicas": n, "scale": top["scale"], "offered_req_s": top["offered_req_s"],
            "ratio": top["ttft_p90_s"] / kv["ttft_p90_s"], "pow2_p90_s": top["ttft_p90_s"],
            "kv_aware_p90_s": kv["ttft_p90_s"], "kv_aware_hit_rate": kv["prefix_hit_rate"],
            "pow2_hit_rate": top["prefix_hit_rate"], "kv_aware_throughput_tok_s": kv["throughput_tok_s"],
            "kv_aware_load_imbalance": kv["load_imbalance"]}


def _git_revision() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_results(path: Path, heads: list[dict], command: str, cal: Calibration) -> None:
    meta = {"command": command, "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "git_revision": _git_revision(),
            "hardware": f"simulated H200 replicas ({cal.source}); simulator ran on a 2-core CPU"}
    entries = {}
    for h in heads:
        suffix = "" if h["replicas"] == 4 else f"_{h['replicas']}_replicas"
        entries[f"router.p90_ttft_ratio_vs_pow2{suffix}"] = {"value": round(h["ratio"], 3), "unit": "x",
                                                             **meta}
        entries[f"router.prefix_hit_rate{suffix}"] = {"value": round(h["kv_aware_hit_rate"], 4),
                                                     "unit": "fraction of prompt tokens", **meta}
        entries[f"router.kv_aware_p90_ttft{suffix}"] = {"value": round(h["kv_aware_p90_s"], 3), "unit": "s",
                                                        **meta}
        entries[f"router.pow2_p90_ttft{suffix}"] = {"value": round(h["pow2_p90_s"], 3), "unit": "s", **meta}
        entries[f"router.max_pow2_sustained_rate{suffix}"] = {"value": round(h["offered_req_s"], 3),
                                                             "unit": "requests/s", **meta}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(entries, indent=2) + "\n")


def plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return False
    counts = sorted({r["replicas"] for r in rows})
    fig, axes = plt.subplots(1, len(counts), figsize=(6 * len(counts), 4.2), squeeze=False)
    for ax, n in zip(axes[0], counts, strict=True):
        for policy in POLICIES:
            pts = sorted((r["offered_req_s"], r["ttft_p90_s"]) for r in rows
                         if r["replicas"] == n and r["policy"] == policy)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=policy)
        ax.set_yscale("log")
        ax.set_xlabel("offered load (requests/s, Mooncake trace time-scaled)")
        ax.set_ylabel("p90 TTFT (s)")
        ax.set_title(f"{n} replicas")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return True


def print_table(rows: list[dict], heads: list[dict]) -> None:
    print(f"{'N':>2} {'scale':>5} {'req/s':>6} {'policy':16s} {'p50 s':>8} {'p90 s':>8} {'hit':>6} "
          f"{'tok/s':>8} {'imbal':>6} sust  decisions")
    for r in rows:
        print(f"{r['replicas']:>2} {r['scale']:>5.2f} {r['offered_req_s']:>6.2f} {r['policy']:16s} "
              f"{r['ttft_p50_s']:>8.2f} {r['ttft_p90_s']:>8.2f} {r['prefix_hit_rate']:>6.3f} "
              f"{r['throughput_tok_s']:>8.0f} {r['load_imbalance']:>6.3f} "
              f"{'yes' if r['sustained'] else 'no ':4s} "
              f"{r['decisions']}")
    for h in heads:
        print(f"{h['replicas']} replicas, highest load pow2 sustains (scale {h['scale']:.2f}, "
              f"{h['offered_req_s']:.2f} req/s): p90 TTFT pow2 {h['pow2_p90_s']:.2f} s / kv_aware "
              f"{h['kv_aware_p90_s']:.2f} s = {h['ratio']:.2f}x; prefix hit rate kv_aware "
              f"{h['kv_aware_hit_rate']:.3f} (pow2 {h['pow2_hit_rate']:.3f})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", default=DEFAULT_TRACE, help="JSONL trace (Mooncake format)")
    parser.add_argument("--replicas", default="4,8", help="comma-separated replica counts")
    parser.add_argument("--scales", default="0.3,0.4,0.5,0.55,0.6,0.65,0.7,0.8,1.0",
                        help="arrival-rate scales for 4 replicas (×N/4 for N replicas)")
    parser.add_argument("--calibration", help="JSON overriding Calibration fields (measured engine speeds)")
    parser.add_argument("--stats-period-s", type=float, default=1.0, help="routing-stats period")
    parser.add_argument("--kv-aware", default="{}", help="JSON of KVAwareConfig fields")
    parser.add_argument("--limit", type=int, help="first N trace rows only (smoke runs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/router.json")
    parser.add_argument("--plot", default="docs/router_p90_ttft.png")
    args = parser.parse_args(argv)
    cal = Calibration.load(args.calibration) if args.calibration else Calibration.default()
    kv_cfg = KVAwareConfig(**json.loads(args.kv_aware))
    trace = load_trace(args.trace, args.limit)
    counts = [int(x) for x in args.replicas.split(",")]
    scales = [float(x) for x in args.scales.split(",")]
    print(f"trace {args.trace}: {len(trace)} requests; calibration: {cal.source}; "
          f"{cal.capacity_pages} pages of {cal.page_tokens} tokens per replica", file=sys.stderr)
    run(trace[:200], "kv_aware", counts[0], scales[0], cal, args.stats_period_s, kv_cfg, args.seed)  # warm-up
    rows = sweep(trace, counts, scales, cal, args.stats_period_s, kv_cfg, args.seed)
    heads = [h for h in (headline(rows, n) for n in counts) if h is not None]
    command = "python benchmarks/router/simulate.py " + " ".join(argv if argv is not None else sys.argv[1:])
    write_results(Path(args.out), heads, command.strip(), cal)
    sweep_path = Path(args.out).with_name(Path(args.out).stem + "_sweep.json")
    sweep_path.write_text(json.dumps({"calibration": cal.to_dict(), "kv_aware": kv_cfg.__dict__,
                                      "stats_period_s": args.stats_period_s, "rows": rows}, indent=1) + "\n")
    if args.plot:
        plot(rows, Path(args.plot))
    print_table(rows, heads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
