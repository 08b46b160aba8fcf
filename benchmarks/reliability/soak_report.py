"""The soak's figures: per-minute rows, the summary (with the JSON figures) and the final table."""

from soak_client import SoakState
from soak_workload import Outcome

from msaserve.platform.loadgen import percentile

MIB = 1 << 20


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 1)


def _ttfts(outcomes: list[Outcome]) -> list[float]:
    return [o.ttft_s for o in outcomes if o.ok and o.stream and o.ttft_s is not None]


def _window(state: SoakState, lo: float, hi: float) -> tuple[list[Outcome], list[int]]:
    outcomes = [o for o in state.outcomes if lo <= o.ended < hi]
    rss = [total for t, total, _ in state.rss if lo <= t < hi]
    return outcomes, rss


def minute_rows(state: SoakState, measure_from: float) -> list[dict]:
    """One row per whole or partial minute since measure_from (minute 0 = the warm-up)."""
    last = max([o.ended for o in state.outcomes] + [t for t, _, _ in state.rss], default=measure_from)
    rows = []
    minute = 0
    while measure_from + 60 * (minute - 1) <= last:
        lo = measure_from + 60 * (minute - 1) if minute else float("-inf")
        outcomes, rss = _window(state, lo, measure_from + 60 * minute)
        ttfts = _ttfts(outcomes)
        rows.append({
            "minute": minute, "requests": len(outcomes), "errors": sum(not o.ok for o in outcomes),
            "ttft_p50_ms": _ms(percentile(ttfts, 50)), "ttft_p99_ms": _ms(percentile(ttfts, 99)),
            "rss_mib": round(sum(rss) / len(rss) / MIB) if rss else None,
            "kills": sum(lo <= k < measure_from + 60 * minute for k in state.kills),
        })  # fmt: skip
        minute += 1
    return rows


def level_row(state: SoakState, measure_from: float, concurrency: int) -> dict:
    outcomes = [o for o in state.outcomes if o.ended >= measure_from]
    span = max((o.ended for o in outcomes), default=measure_from) - measure_from
    ttfts = _ttfts(outcomes)
    return {"concurrency": concurrency, "req_per_s": round(len(outcomes) / max(span, 1e-9), 2),
            "errors": sum(not o.ok for o in outcomes), "ttft_p50_ms": _ms(percentile(ttfts, 50)),
            "ttft_p99_ms": _ms(percentile(ttfts, 99))}  # fmt: skip


def rss_growth_pct(state: SoakState, measure_from: float) -> tuple[float | None, dict[str, float]]:
    """Growth of the total, and per process kind, last minute's mean vs the first measured minute's."""
    end = max((t for t, _, _ in state.rss), default=measure_from)
    first = [(total, kinds) for t, total, kinds in state.rss if measure_from <= t < measure_from + 60]
    last = [(total, kinds) for t, total, kinds in state.rss if end - 60 < t <= end]
    if not first or not last or end - 60 < measure_from + 60:
        return None, {}

    def mean(samples: list, kind: str | None = None) -> float:
        return sum(total if kind is None else kinds.get(kind, 0) for total, kinds in samples) / len(samples)

    names = {k for _, kinds in first + last for k in kinds}
    per_kind = {k: (mean(first, k) / MIB, mean(last, k) / MIB) for k in names}
    growth = 100.0 * (mean(last) / mean(first) - 1.0)
    return round(growth, 2), per_kind


def _overlaps_kill(state: SoakState, started: float, ended: float) -> bool:
    return any(started < k <= ended for k in state.kills)


def soak_summary(state: SoakState, measure_from: float, kill_mode: bool) -> dict:
    outcomes = [o for o in state.outcomes if o.ended >= measure_from]
    ttfts = _ttfts(outcomes)
    failed = [o for o in outcomes if not o.ok]
    growth, per_kind = rss_growth_pct(state, measure_from)
    sessions = [s for s in state.sessions if s.finished and s.ended >= measure_from]
    out: dict = {
        "requests": len(outcomes), "streamed_ok": len(ttfts), "failed": len(failed),
        "failures": sorted({o.error for o in failed}), "sessions_judged": len(sessions),
        "sessions_wrong": [(s.session_id, s.failure) for s in sessions if s.failure],
        "rss_per_kind_mib": per_kind, "kills": len(state.kills),
    }  # fmt: skip
    prefix = "reliability.kill_" if kill_mode else "reliability.soak_"
    out[prefix + "ttft_p50_ms"] = (_ms(percentile(ttfts, 50)), "ms")
    out[prefix + "ttft_p99_ms"] = (_ms(percentile(ttfts, 99)), "ms")
    out[prefix + "rss_growth_pct"] = (growth, "%")
    out[prefix + "concurrency"] = (state.concurrency, "clients")
    if not kill_mode:
        out["reliability.soak_errors"] = (len(failed), "requests")
        out["reliability.soak_requests"] = (len(outcomes), "requests")
        out["reliability.soak_wrong_session_turns"] = (len(out["sessions_wrong"]), "sessions")
        return out
    cut = [o for o in failed if _overlaps_kill(state, o.started, o.ended)]
    new = [o for o in failed if not _overlaps_kill(state, o.started, o.ended)]
    disturbed = [s for s in sessions if _overlaps_kill(state, s.started, s.ended)]
    out["cut_errors"] = sorted({o.error for o in cut})
    out["new_errors"] = sorted({o.error for o in new})
    out["undisturbed_sessions_wrong"] = [(s.session_id, s.failure) for s in sessions
                                         if s.failure and s not in disturbed]  # fmt: skip
    out["reliability.kill_lost_sessions"] = (sum(bool(s.failure) for s in disturbed), "sessions")
    out["reliability.kill_sessions_across_a_kill"] = (len(disturbed), "sessions")
    out["reliability.kill_client_errors_new_requests"] = (len(new), "requests")
    out["reliability.kill_inflight_cut"] = (len(cut), "requests")
    out["reliability.kill_inflight_cut_retryable"] = (sum(o.retryable for o in cut), "requests")
    out["reliability.kill_requests"] = (len(outcomes), "requests")
    out["reliability.kill_kills"] = (len(state.kills), "replicas killed")
    return out


def print_table(state: SoakState, measure_from: float, summary: dict) -> None:
    print(f"\n{'minute':>6} {'requests':>8} {'errors':>6} {'TTFT p50 ms':>11} {'TTFT p99 ms':>11} "
          f"{'RSS MiB':>8} {'kills':>5}")  # fmt: skip
    for r in minute_rows(state, measure_from):
        label = "warm" if r["minute"] == 0 else r["minute"]
        print(f"{label:>6} {r['requests']:>8} {r['errors']:>6} {r['ttft_p50_ms']!s:>11} "
              f"{r['ttft_p99_ms']!s:>11} {r['rss_mib']!s:>8} {r['kills']:>5}")  # fmt: skip
    print("\nRSS by process kind, MiB (first measured minute → last minute):")
    for kind, (first, last) in sorted(summary["rss_per_kind_mib"].items(), key=lambda kv: -kv[1][1]):
        print(f"  {kind:<40} {first:8.1f} → {last:8.1f}")
    for key in ("failures", "cut_errors", "new_errors", "sessions_wrong", "undisturbed_sessions_wrong"):
        if summary.get(key):
            print(f"{key}: {summary[key][:10]}")
    print(
        f"\nrequests {summary['requests']}, sessions judged {summary['sessions_judged']}, "
        f"kills {summary['kills']}"
    )
    for key, value in summary.items():
        if key.startswith("reliability."):
            print(f"{key:<48} {value[0]!s:>10} {value[1]}")
