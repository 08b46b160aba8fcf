"""Max sustainable rate by bisection, not one grid step (issue 29: the grid bounded the ratio).

For each policy and replica count, bisects the arrival-rate scale between a sustained `--lo` and
an unsustained `--hi` (checked first) until the bracket is narrower than `--tol` (relative), with
the same simulator, trace, calibration and definition of *sustained* as simulate.py (the last
request finishes within max(30 s, 5% of the arrival span) after the last arrival). Prints each
probe with the per-replica picture (requests, busy fraction, prefix hit rate) and writes the
brackets as JSON; `--prefix` names the headline entries (`<prefix>max_rate_ratio_vs_ray_pow2_bisected`).

    python benchmarks/router/bisect_rate.py --calibration benchmarks/router/calibration_h200_engine.json \
        --replicas 4 --lo 0.5 --hi 1.0 --out benchmarks/results/router_bisect.json
"""

import argparse
import datetime
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from replica_model import Calibration
from report import git_revision, merge_into_summary
from simulate import DEFAULT_TRACE, load_trace, run

from msaserve.router.kv_aware import KVAwareConfig


def probe(trace: list[dict], policy: str, n: int, scale: float, cal: Calibration, kv_cfg: KVAwareConfig,
          stats_period_s: float) -> dict:
    r = run(trace, policy, n, scale * n / 4, cal, stats_period_s, kv_cfg)
    per = " ".join(f"{p['replica']}:{p['requests']}/{p['busy']:.2f}/{p['hit']:.2f}" for p in r["per_replica"])
    print(f"  {n} replicas {policy:20s} scale {scale:.4f} ({r['offered_req_s']:.3f} req/s): "
          f"{'sustained' if r['sustained'] else 'NOT sustained'} drain {r['drain_s']:7.1f} s "
          f"p90 {r['ttft_p90_s']:7.2f} s hit {r['prefix_hit_rate']:.3f}  [req/busy/hit] {per}",
          file=sys.stderr, flush=True)
    return r


def bisect(trace: list[dict], policy: str, n: int, lo: float, hi: float, tol: float, cal: Calibration,
           kv_cfg: KVAwareConfig, stats_period_s: float) -> dict:
    """The bracket [lo, hi] of scales: lo sustained, hi not, hi/lo − 1 ≤ tol."""
    lo_r = probe(trace, policy, n, lo, cal, kv_cfg, stats_period_s)
    if not lo_r["sustained"]:
        raise ValueError(f"--lo={lo} is not sustained by {policy} at {n} replicas: allowed a lower --lo")
    hi_r = probe(trace, policy, n, hi, cal, kv_cfg, stats_period_s)
    if hi_r["sustained"]:
        raise ValueError(f"--hi={hi} is sustained by {policy} at {n} replicas: allowed a higher --hi")
    probes = [(lo, lo_r), (hi, hi_r)]
    while hi / lo - 1 > tol:
        mid = (lo * hi) ** 0.5
        r = probe(trace, policy, n, mid, cal, kv_cfg, stats_period_s)
        probes.append((mid, r))
        if r["sustained"]:
            lo, lo_r = mid, r
        else:
            hi, hi_r = mid, r
    return {"policy": policy, "replicas": n, "lo_scale": lo, "hi_scale": hi,
            "max_rate": lo_r["offered_req_s"], "unsustained_rate": hi_r["offered_req_s"],
            "p90_at_max_rate_s": lo_r["ttft_p90_s"], "hit_rate_at_max_rate": lo_r["prefix_hit_rate"],
            "probes": [{"scale": s, "offered_req_s": r["offered_req_s"], "sustained": r["sustained"],
                        "ttft_p90_s": r["ttft_p90_s"], "prefix_hit_rate": r["prefix_hit_rate"],
                        "drain_s": r["drain_s"], "per_replica": r["per_replica"]} for s, r in probes]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", default=DEFAULT_TRACE)
    parser.add_argument("--calibration", help="JSON overriding Calibration fields")
    parser.add_argument("--replicas", default="4")
    parser.add_argument("--policies", default="kv_aware,ray_pow2,prefix_affinity,ray_prefix_affinity")
    parser.add_argument("--lo", type=float, default=0.5, help="a scale every policy sustains")
    parser.add_argument("--hi", type=float, default=1.0, help="a scale no policy sustains")
    parser.add_argument("--tol", type=float, default=0.01, help="relative width of the final bracket")
    parser.add_argument("--stats-period-s", type=float, default=1.0)
    parser.add_argument("--kv-aware", default="{}", help="JSON of KVAwareConfig fields")
    parser.add_argument("--prefix", default="router.")
    parser.add_argument("--out", default="benchmarks/results/router_bisect.json")
    parser.add_argument("--summary", action="store_true", help="also merge the headline into summary.json")
    args = parser.parse_args(argv)
    cal = Calibration.load(args.calibration) if args.calibration else Calibration.default()
    kv_cfg = KVAwareConfig(**json.loads(args.kv_aware))
    trace = load_trace(args.trace)
    results = [bisect(trace, p, n, args.lo, args.hi, args.tol, cal, kv_cfg, args.stats_period_s)
               for n in (int(x) for x in args.replicas.split(",")) for p in args.policies.split(",")]
    meta = {"command": "python benchmarks/router/bisect_rate.py " + " ".join(argv if argv is not None
                                                                              else sys.argv[1:]),
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "git_revision": git_revision(),
            "hardware": f"simulated H200 replicas ({cal.source}); simulator ran on a 2-core CPU",
            "note": f"trace {Path(args.trace).name}; max sustained rate bisected to {args.tol:.0%} "
                    f"(the highest rate probed that is sustained); kv_aware config {kv_cfg.__dict__}"}
    entries = {}
    for n in sorted({r["replicas"] for r in results}):
        rate = {r["policy"]: r["max_rate"] for r in results if r["replicas"] == n}
        suffix = "" if n == 4 else f"_{n}_replicas"
        if "kv_aware" in rate and "ray_pow2" in rate:
            entries[f"{args.prefix}max_rate_ratio_vs_ray_pow2_bisected{suffix}"] = {
                "value": round(rate["kv_aware"] / rate["ray_pow2"], 4), "unit": "x", **meta}
        for p, v in rate.items():
            entries[f"{args.prefix}{p}_max_rate_bisected{suffix}"] = {"value": round(v, 4),
                                                                       "unit": "requests/s", **meta}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(entries, indent=2) + "\n")
    out.with_name(out.stem + "_probes.json").write_text(json.dumps({"results": results}, indent=1) + "\n")
    if args.summary:
        merge_into_summary(entries, out)
    print(f"{'N':>2} {'policy':20s} {'max rate':>9} {'unsust.':>8} {'p90 s':>7} {'hit':>6}")
    for r in results:
        print(f"{r['replicas']:>2} {r['policy']:20s} {r['max_rate']:>9.3f} {r['unsustained_rate']:>8.3f} "
              f"{r['p90_at_max_rate_s']:>7.2f} {r['hit_rate_at_max_rate']:>6.3f}")
    for key, e in entries.items():
        print(f"{key} = {e['value']} {e['unit']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
