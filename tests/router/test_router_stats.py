"""Routing-stats payloads: delta encoding, resync after a missed payload, parsing errors."""

import pytest

from msaserve.engine.types import EngineStats, KVEvent
from msaserve.router.state import RequestView, RouterState
from msaserve.router.stats import (
    RoutingStatsRecorder,
    decode_hashes,
    encode_hashes,
    parse_routing_stats,
    routing_stats_payload,
)

STATS = EngineStats(num_running=2, num_waiting=1, num_free_pages=70, num_total_pages=100, prefix_hit_rate=0.4)
BIG = 2**64 - 5  # xxh3 hashes use the whole uint64 range


def payload(recorder, events, **kw):
    return routing_stats_payload(STATS, events, recorder, **kw)


def test_hashes_round_trip_through_base64_including_the_top_bit():
    assert decode_hashes(encode_hashes([0, 1, BIG])) == [0, 1, BIG]
    assert len(encode_hashes(range(3000))) <= 11 * 3000


def test_first_payload_is_full_then_deltas_net_of_each_other():
    rec = RoutingStatsRecorder(full_every=100, clock=lambda: 5.0)
    first = parse_routing_stats(payload(rec, [KVEvent("stored", [1, 2, 3])]))
    assert first.full and sorted(first.stored) == [1, 2, 3] and first.seq == 0 and first.timestamp == 5.0
    events = [KVEvent("stored", [4, 5]), KVEvent("removed", [5, 1]), KVEvent("stored", [6])]
    delta = parse_routing_stats(payload(rec, events))
    assert not delta.full and sorted(delta.stored) == [4, 6] and sorted(delta.removed) == [1, 5]
    loads = (delta.num_running, delta.num_waiting, delta.num_free_pages, delta.prefix_hit_rate)
    assert loads == (2, 1, 70, 0.4)


def test_router_view_follows_the_replica_and_resyncs_after_a_gap():
    rec = RoutingStatsRecorder(full_every=4)
    state = RouterState()
    held = set()
    for step in range(12):
        events = [KVEvent("stored", [step * 10 + i for i in range(3)]), KVEvent("removed", [step * 10 - 9])]
        held |= {step * 10 + i for i in range(3)}
        held.discard(step * 10 - 9)
        parsed = parse_routing_stats(payload(rec, events))
        if step in (5, 6):
            continue  # the router missed these payloads (Serve keeps only the latest)
        state.apply_stats("r0", parsed, now=100.0 + step)
        replica = state.replicas["r0"]
        if step in (7,):
            assert not replica.synced  # a gap: approximate until the next full snapshot
        if step >= 8:
            assert replica.synced and replica.cached == held


def test_cleared_forces_a_full_snapshot():
    rec = RoutingStatsRecorder(full_every=100)
    payload(rec, [KVEvent("stored", [1, 2])])
    after = parse_routing_stats(payload(rec, [KVEvent("cleared", []), KVEvent("stored", [9])]))
    assert after.full and after.stored == [9]


def test_a_repeated_payload_is_applied_once():
    rec = RoutingStatsRecorder()
    state = RouterState()
    state.replica("r0")
    p = parse_routing_stats(payload(rec, [KVEvent("stored", [1])]))
    state.apply_stats("r0", p, now=10.0)
    state.on_routed(RequestView("x", [1, 2], 3), "r0", now=11.0)
    state.apply_stats("r0", p, now=12.0)  # Serve re-sends the same dict until the next poll
    assert state.replicas["r0"].load == 2 + 1 + 1  # the routed request still counts


def test_sessions_reported_by_a_replica_fill_unknown_sessions_only():
    rec = RoutingStatsRecorder()
    rec.note_session("a")
    rec.note_session("b")
    rec.note_session("a")
    state = RouterState()
    state.sessions["b"] = "r1"
    parsed = parse_routing_stats(payload(rec, [], resident_sessions=["a"]))
    assert parsed.sessions == ("a", "b")
    state.apply_stats("r0", parsed, now=1.0)
    assert state.sessions == {"a": "r0", "b": "r1"}
    assert state.replicas["r0"].resident_sessions == {"a"}


def test_parse_errors_name_what_is_wrong():
    assert parse_routing_stats({}) is None
    good = payload(RoutingStatsRecorder(), [])
    with pytest.raises(ValueError, match="v=2"):
        parse_routing_stats({**good, "v": 2})
    broken = dict(good)
    del broken["free_pages"]
    with pytest.raises(ValueError, match="free_pages"):
        parse_routing_stats(broken)
    with pytest.raises(ValueError, match=r"KVEvent\.kind='moved'"):
        payload(RoutingStatsRecorder(), [KVEvent("moved", [1])])  # type: ignore[arg-type]
