"""Summaries of simulated runs and the headline figures (simulate.py calls these).

Definitions (all from the same sweep, every policy on the same trace, rates and replica counts):
- sustained: the last request finishes within max(30 s, 5% of the arrival span) after the last
  arrival (the queues do not grow without bound).
- max sustainable rate of a policy: the highest offered rate of the grid at which it is sustained.
- p90 TTFT ratio: at the baseline's (ray_pow2's) max sustainable rate, the baseline's p90 TTFT over
  kv_aware's (the definition the earlier `router.p90_ttft_ratio_vs_pow2` used).
- within the SLO (`--slo-p90-ttft-s`): the same two with "sustained and p90 TTFT ≤ SLO" in place of
  "sustained"; throughput at the SLO = output tokens/s at the highest such rate.
"""

import datetime
import json
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path

from replica_model import Calibration, SimReplica, SimRequest

BASELINE = "ray_pow2"
OURS = "kv_aware"


def percentile(values: list[float], q: float) -> float:
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
    per_replica = []
    for rid, rep in replicas.items():
        mine = [r for r in requests if r.replica == rid]
        tokens = sum(r.input_tokens for r in mine)
        hits = sum(min(r.hit_blocks * cal.page_tokens, r.input_tokens) for r in mine)
        per_replica.append({"replica": rid, "requests": len(mine), "busy": rep.busy_s / makespan,
                            "hit": hits / tokens if tokens else 0.0})
    return {
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p90_s": percentile(ttft, 0.9),
        "ttft_p99_s": percentile(ttft, 0.99),
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
        "per_replica": per_replica,
    }


def max_rate(rows: list[dict], n: int, policy: str, slo_s: float | None = None) -> dict | None:
    ok = [r for r in rows if r["replicas"] == n and r["policy"] == policy and r["sustained"]
          and (slo_s is None or r["ttft_p90_s"] <= slo_s)]
    return max(ok, key=lambda r: r["offered_req_s"]) if ok else None


def _at(rows: list[dict], n: int, policy: str, scale: float) -> dict:
    return next(r for r in rows if r["replicas"] == n and r["policy"] == policy and r["scale"] == scale)


def headline(rows: list[dict], n: int, slo_s: float) -> dict | None:
    base, ours = max_rate(rows, n, BASELINE), max_rate(rows, n, OURS)
    base_slo, ours_slo = max_rate(rows, n, BASELINE, slo_s), max_rate(rows, n, OURS, slo_s)
    if None in (base, ours, base_slo, ours_slo):
        return None
    kv = _at(rows, n, OURS, base["scale"])
    kv_slo = _at(rows, n, OURS, base_slo["scale"])
    return {"replicas": n, "scale": base["scale"], "offered_req_s": base["offered_req_s"],
            "ratio": base["ttft_p90_s"] / kv["ttft_p90_s"], "base_p90_s": base["ttft_p90_s"],
            "kv_aware_p90_s": kv["ttft_p90_s"], "kv_aware_hit_rate": kv["prefix_hit_rate"],
            "base_hit_rate": base["prefix_hit_rate"],
            "max_rate_ratio": ours["offered_req_s"] / base["offered_req_s"],
            "base_max_rate": base["offered_req_s"], "kv_aware_max_rate": ours["offered_req_s"],
            "ratio_slo": base_slo["ttft_p90_s"] / kv_slo["ttft_p90_s"],
            "max_rate_ratio_slo": ours_slo["offered_req_s"] / base_slo["offered_req_s"],
            "base_tok_s_at_slo": base_slo["throughput_tok_s"],
            "kv_aware_tok_s_at_slo": ours_slo["throughput_tok_s"]}


def git_revision() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_results(path: Path, heads: list[dict], command: str, cal: Calibration, prefix: str,
                  trace_note: str, slo_s: float) -> dict:
    meta = {"command": command, "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "git_revision": git_revision(),
            "hardware": f"simulated H200 replicas ({cal.source}); simulator ran on a 2-core CPU",
            "note": f"{trace_note}; baseline {BASELINE} = simulation of Ray Serve's "
                    f"PowerOfTwoChoicesRequestRouter (benchmarks/router/ray_baselines.py); SLO p90 TTFT "
                    f"{slo_s:g} s"}
    entries = {}
    for h in heads:
        suffix = "" if h["replicas"] == 4 else f"_{h['replicas']}_replicas"
        figures = {
            "p90_ttft_ratio_vs_ray_pow2": (h["ratio"], "x"),
            "max_rate_ratio_vs_ray_pow2": (h["max_rate_ratio"], "x"),
            "kv_aware_max_rate": (h["kv_aware_max_rate"], "requests/s"),
            "ray_pow2_max_rate": (h["base_max_rate"], "requests/s"),
            "kv_aware_p90_ttft_at_ray_pow2_max_rate": (h["kv_aware_p90_s"], "s"),
            "ray_pow2_p90_ttft_at_its_max_rate": (h["base_p90_s"], "s"),
            "kv_aware_prefix_hit_rate": (h["kv_aware_hit_rate"], "fraction of prompt tokens"),
            "p90_ttft_ratio_vs_ray_pow2_within_slo": (h["ratio_slo"], "x"),
            "max_rate_ratio_vs_ray_pow2_within_slo": (h["max_rate_ratio_slo"], "x"),
            "kv_aware_tok_s_at_slo": (h["kv_aware_tok_s_at_slo"], "tokens/s"),
            "ray_pow2_tok_s_at_slo": (h["base_tok_s_at_slo"], "tokens/s"),
        }
        for name, (value, unit) in figures.items():
            entries[f"{prefix}{name}{suffix}"] = {"value": round(value, 4), "unit": unit, **meta}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(entries, indent=2) + "\n")
    return entries


def merge_into_summary(entries: dict, results_file: Path) -> None:
    """Add or replace these entries in summary.json, keeping every other entry."""
    summary_path = results_file.parent / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    for key, entry in entries.items():
        summary[key] = {**entry, "source": f"benchmarks/results/{results_file.name}"}
    summary_path.write_text(json.dumps(dict(sorted(summary.items())), indent=2) + "\n")


def plot(rows: list[dict], path: Path, policies: list[str], title: str) -> bool:
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
        for policy in policies:
            pts = sorted((r["offered_req_s"], r["ttft_p90_s"]) for r in rows
                         if r["replicas"] == n and r["policy"] == policy)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=policy)
        ax.set_yscale("log")
        ax.set_xlabel(f"offered load (requests/s, {title})")
        ax.set_ylabel("p90 TTFT (s)")
        ax.set_title(f"{n} replicas")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return True


def print_table(rows: list[dict], heads: list[dict], slo_s: float) -> None:
    print(f"{'N':>2} {'scale':>5} {'req/s':>6} {'policy':20s} {'p50 s':>8} {'p90 s':>8} {'p99 s':>8} "
          f"{'hit':>6} {'tok/s':>8} {'imbal':>6} sust")
    for r in rows:
        print(f"{r['replicas']:>2} {r['scale']:>5.2f} {r['offered_req_s']:>6.2f} {r['policy']:20s} "
              f"{r['ttft_p50_s']:>8.2f} {r['ttft_p90_s']:>8.2f} {r['ttft_p99_s']:>8.2f} "
              f"{r['prefix_hit_rate']:>6.3f} {r['throughput_tok_s']:>8.0f} {r['load_imbalance']:>6.3f} "
              f"{'yes' if r['sustained'] else 'no'}")
    policies = sorted({r["policy"] for r in rows})
    for n in sorted({r["replicas"] for r in rows}):
        for slo, label in ((None, "max sustained rate"), (slo_s, f"max rate within p90 TTFT ≤ {slo_s:g} s")):
            rates = []
            for p in policies:
                best = max_rate(rows, n, p, slo)
                rates.append(f"{p} {best['offered_req_s']:.2f} req/s ({best['throughput_tok_s']:.0f} tok/s)"
                             if best else f"{p} none")
            print(f"{n} replicas, {label}: " + "; ".join(rates))
    for h in heads:
        print(f"{h['replicas']} replicas: at {BASELINE}'s max rate ({h['offered_req_s']:.2f} req/s) p90 TTFT "
              f"{BASELINE} {h['base_p90_s']:.2f} s / {OURS} {h['kv_aware_p90_s']:.2f} s = {h['ratio']:.2f}x; "
              f"max rate {OURS} {h['kv_aware_max_rate']:.2f} / {BASELINE} {h['base_max_rate']:.2f} = "
              f"{h['max_rate_ratio']:.2f}x; prefix hit {OURS} {h['kv_aware_hit_rate']:.3f} "
              f"({BASELINE} {h['base_hit_rate']:.3f}); within the SLO: p90 ratio {h['ratio_slo']:.2f}x, "
              f"max rate ratio {h['max_rate_ratio_slo']:.2f}x")


def print_markdown(rows: list[dict], policies: list[str]) -> None:
    """p90 TTFT (and prefix hit rate) per offered rate and policy, one table per replica count,
    for docs/performance-router.md; '*' marks a run that was not sustained."""
    for n in sorted({r["replicas"] for r in rows}):
        print(f"\n{n} replicas, p90 TTFT in s (prefix hit rate); * = not sustained\n")
        print("| req/s | " + " | ".join(policies) + " |")
        print("| --- |" + " --- |" * len(policies))
        for scale in sorted({r["scale"] for r in rows if r["replicas"] == n}):
            cells, rate = [], 0.0
            for p in policies:
                r = next(x for x in rows if x["replicas"] == n and x["policy"] == p and x["scale"] == scale)
                rate = r["offered_req_s"]
                star = "" if r["sustained"] else "*"
                cells.append(f"{r['ttft_p90_s']:.2f}{star} ({r['prefix_hit_rate']:.2f})")
            print(f"| {rate:.2f} | " + " | ".join(cells) + " |")
