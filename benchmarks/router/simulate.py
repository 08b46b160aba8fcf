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
import json
import math
import random
import sys
from collections import Counter, deque
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ray_baselines import RayPow2Sim, RayPrefixAffinitySim
from replica_model import Calibration, SimReplica, SimRequest
from report import headline, merge_into_summary, plot, print_markdown, print_table, summarize, write_results

from msaserve.engine.types import EngineStats, KVEvent
from msaserve.router.kv_aware import POLICIES, KVAwareConfig, make_policy
from msaserve.router.policies import Decision
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
    waiting = replica.waiting_prefill_pages() if REPORT_PREFILL else None
    payload = routing_stats_payload(stats, _events(replica), recorder, waiting_prefill_pages=waiting)
    parsed = parse_routing_stats(payload)
    assert parsed is not None
    state.apply_stats(replica.replica_id, parsed, now)


REPORT_PREFILL = True
"""Whether simulated replicas report `waiting_prefill_pages`, as the live ModelDeployment does
(`EngineStats.waiting_prefill_pages`, since issue 29's third pass); `--no-prefill-report` runs the
router on waiting × mean miss size, what it had before."""
POLICY_NAMES = tuple(dict.fromkeys((*POLICIES, "ray_pow2", "ray_prefix_affinity")))
"""Our policies (production code) and the simulated Ray Serve routers (ray_baselines.py), once each:
importing ray_baselines first registers its classes in `POLICY_CLASSES` too, so `POLICIES` may
already hold them (the sweeps of 1b698fe ran both Ray baselines twice, identical rows)."""


def build_policy(name: str, state: RouterState, rng: random.Random, kv_cfg: KVAwareConfig,
                 replicas: dict[str, SimReplica], max_ongoing: int):
    def queue_len(rid: str) -> int:
        return replicas[rid].num_ongoing()

    if name == "ray_pow2":
        return RayPow2Sim(state, rng, queue_len, max_ongoing)
    if name == "ray_prefix_affinity":
        return RayPrefixAffinitySim(state, rng, queue_len, max_ongoing)
    return make_policy(name, state, rng, kv_aware=kv_cfg)


def _place(policy, view: RequestView, state: RouterState, replicas: dict[str, SimReplica],
           max_ongoing: int, t: float) -> Decision | None:
    """Where Serve sends the request: the policy's ranking, first replica below max_ongoing_requests
    (Serve's queue-length probe); None if every one is full (it waits in the router)."""
    candidates = [state.replicas[rid] for rid in replicas]
    if isinstance(policy, RayPow2Sim | RayPrefixAffinitySim):
        return policy.choose(view, candidates, t)
    for decision in policy.rank(view, candidates, t):
        if replicas[decision.replica_id].num_ongoing() < max_ongoing:
            return decision
    return None


def run(trace: list[dict], policy_name: str, n_replicas: int, scale: float, cal: Calibration,
        stats_period_s: float, kv_cfg: KVAwareConfig, seed: int = 0, max_ongoing: int = 256,
        retry_s: float = 0.05) -> dict:
    clock = [0.0]
    state = RouterState(estimate_expiry_s=estimate_expiry_for(stats_period_s))
    replicas = {f"r{i}": SimReplica(f"r{i}", cal, cal.capacity_pages) for i in range(n_replicas)}
    policy = build_policy(policy_name, state, random.Random(seed), kv_cfg, replicas, max_ongoing)
    recorders = {rid: RoutingStatsRecorder(clock=lambda: clock[0]) for rid in replicas}
    state.sync_replicas(replicas)
    t0 = trace[0]["timestamp"]
    requests, decisions, predicted = [], Counter(), 0
    waiting: deque[tuple[SimRequest, RequestView]] = deque()  # in the router (all replicas full)
    next_stats = 0.0

    def advance(until: float) -> None:
        nonlocal next_stats
        while True:
            retry_at = clock[0] + retry_s if waiting else math.inf
            step = min(next_stats, retry_at, until)
            for replica in replicas.values():
                replica.advance(step)
            clock[0] = step
            if step == next_stats:
                for rid, replica in replicas.items():
                    _publish(replica, recorders[rid], state, step)
                next_stats += stats_period_s
            while waiting and dispatch(*waiting[0], step):
                waiting.popleft()
            if step == until:
                return

    def dispatch(req: SimRequest, view: RequestView, t: float) -> bool:
        nonlocal predicted
        decision = _place(policy, view, state, replicas, max_ongoing, t)
        if decision is None:
            return False
        hit = state.on_routed(view, decision.replica_id, t)
        decisions[decision.reason] += 1
        predicted += hit
        req.replica = decision.replica_id
        replicas[decision.replica_id].waiting.append(req)
        return True

    for i, row in enumerate(trace):
        t = (row["timestamp"] - t0) / 1000.0 / scale
        advance(t)
        req = SimRequest(i, t, row["input_length"], max(1, row["output_length"]), list(row["hash_ids"]))
        req.out_pages = math.ceil((req.input_tokens + req.output_tokens) / cal.page_tokens) - len(req.blocks)
        view = RequestView(str(i), req.blocks, req.pages, row.get("session_id"))
        requests.append(req)
        if waiting or not dispatch(req, view, t):
            waiting.append((req, view))
    while waiting:
        advance(clock[0] + 1.0)
    for replica in replicas.values():
        replica.advance(math.inf)
    return summarize(requests, replicas, decisions, predicted, cal)


def sweep(trace: list[dict], replica_counts: list[int], scales: list[float], cal: Calibration,
          stats_period_s: float, kv_cfg: KVAwareConfig, seed: int, policies: Sequence[str],
          max_ongoing: int) -> list[dict]:
    rows = []
    for n in replica_counts:
        for scale in scales:
            for policy in policies:
                result = run(trace, policy, n, scale * n / 4, cal, stats_period_s, kv_cfg, seed, max_ongoing)
                rows.append({"replicas": n, "scale": scale, "policy": policy, **result})
                print(f"  {n} replicas, scale {scale:.2f}, {policy:20s} "
                      f"p90 TTFT {result['ttft_p90_s']:8.2f} s  hit {result['prefix_hit_rate']:.3f}",
                      file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", default=DEFAULT_TRACE, help="JSONL trace (Mooncake format)")
    parser.add_argument("--replicas", default="4,8", help="comma-separated replica counts")
    parser.add_argument("--scales", default="0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0,1.1,1.2,1.4",
                        help="arrival-rate scales for 4 replicas (×N/4 for N replicas)")
    parser.add_argument("--policies", default=",".join(POLICY_NAMES))
    parser.add_argument("--calibration", help="JSON overriding Calibration fields (measured engine speeds)")
    parser.add_argument("--stats-period-s", type=float, default=1.0, help="routing-stats period")
    parser.add_argument("--max-ongoing", type=int, default=256,
                        help="Serve's max_ongoing_requests per replica (the platform's default)")
    parser.add_argument("--slo-p90-ttft-s", type=float, default=10.0)
    parser.add_argument("--kv-aware", default="{}", help="JSON of KVAwareConfig fields")
    parser.add_argument("--limit", type=int, help="first N trace rows only (smoke runs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-prefill-report", action="store_true",
                        help="replicas do not report waiting_prefill_pages (live before issue 29)")
    parser.add_argument("--prefix", default="router.", help="figure name prefix in the results JSON")
    parser.add_argument("--out", default="benchmarks/results/router.json")
    parser.add_argument("--plot", default="docs/router_p90_ttft.png")
    parser.add_argument("--summary", action="store_true", help="also merge the figures into summary.json")
    parser.add_argument("--from-sweep", help="recompute the figures from a sweep JSON this script wrote")
    parser.add_argument("--markdown", action="store_true", help="also print the sweep as markdown tables")
    parser.add_argument("--record-command", help="the command to record (with --from-sweep: the sweep's)")
    args = parser.parse_args(argv)
    global REPORT_PREFILL
    REPORT_PREFILL = not args.no_prefill_report
    cal = Calibration.load(args.calibration) if args.calibration else Calibration.default()
    kv_cfg = KVAwareConfig(**json.loads(args.kv_aware))
    trace = load_trace(args.trace, args.limit)
    counts = [int(x) for x in args.replicas.split(",")]
    scales = [float(x) for x in args.scales.split(",")]
    policies = args.policies.split(",")
    print(f"trace {args.trace}: {len(trace)} requests; calibration: {cal.source}; "
          f"{cal.capacity_pages} pages of {cal.page_tokens} tokens per replica", file=sys.stderr)
    if args.from_sweep:
        rows = json.loads(Path(args.from_sweep).read_text())["rows"]
        policies = sorted({r["policy"] for r in rows}, key=lambda p: POLICY_NAMES.index(p))
        counts = sorted({r["replicas"] for r in rows})
    else:
        rows = sweep(trace, counts, scales, cal, args.stats_period_s, kv_cfg, args.seed, policies,
                     args.max_ongoing)
    heads = [h for h in (headline(rows, n, args.slo_p90_ttft_s) for n in counts) if h is not None]
    command = args.record_command or (
        "python benchmarks/router/simulate.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    trace_note = f"trace {Path(args.trace).name} ({len(trace)} requests)"
    entries = write_results(Path(args.out), heads, command.strip(), cal, args.prefix, trace_note,
                            args.slo_p90_ttft_s)
    if args.summary:
        merge_into_summary(entries, Path(args.out))
    sweep_path = Path(args.out).with_name(Path(args.out).stem + "_sweep.json")
    if not args.from_sweep:
        sweep_path.write_text(json.dumps({"calibration": cal.to_dict(), "kv_aware": kv_cfg.__dict__,
                                          "stats_period_s": args.stats_period_s, "rows": rows}, indent=1)
                              + "\n")
    if args.plot:
        plot(rows, Path(args.plot), policies, Path(args.trace).stem)
    if args.markdown:
        print_markdown(rows, policies)
    print_table(rows, heads, args.slo_p90_ttft_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
