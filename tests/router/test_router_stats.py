"""Routing-stats payloads: numbered deltas, replay of missed payloads, resync, parsing errors."""

import random

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
    assert first.full and sorted(first.snapshot) == [1, 2, 3] and first.seq == 0 and first.timestamp == 5.0
    events = [KVEvent("stored", [4, 5]), KVEvent("removed", [5, 1]), KVEvent("stored", [6])]
    delta = parse_routing_stats(payload(rec, events))
    assert not delta.full and [d.seq for d in delta.deltas] == [0, 1]
    assert sorted(delta.deltas[-1].stored) == [4, 6] and sorted(delta.deltas[-1].removed) == [1, 5]
    assert (delta.held_count, delta.held_digest) == (4, 2 ^ 3 ^ 4 ^ 6)
    loads = (delta.num_running, delta.num_waiting, delta.num_free_pages, delta.prefix_hit_rate)
    assert loads == (2, 1, 70, 0.4)


def test_missed_payloads_are_replayed_from_the_journal_in_order():
    rec = RoutingStatsRecorder(full_every=1000, journal_len=4)
    state = RouterState()
    held = set()
    for step in range(12):
        gone = max(0, step * 10 - 9)
        events = [KVEvent("stored", [step * 10 + i for i in range(3)]), KVEvent("removed", [gone])]
        held |= {step * 10 + i for i in range(3)}
        held.discard(gone)
        parsed = parse_routing_stats(payload(rec, events))
        if step in (5, 6, 7):
            continue  # the router missed these payloads (Serve's long poll keeps only the latest)
        state.apply_stats("r0", parsed, now=100.0 + step)
        replica = state.replicas["r0"]
        assert replica.synced and replica.cached == held, step
    assert state.replicas["r0"].gaps == 0 and state.replicas["r0"].snapshots_applied == 1


def test_a_gap_longer_than_the_journal_needs_a_snapshot_and_a_snapshot_resyncs():
    rec = RoutingStatsRecorder(full_every=1000, journal_len=2)
    state = RouterState()
    state.apply_stats("r0", parse_routing_stats(payload(rec, [KVEvent("stored", [1])])), now=1.0)
    for step in range(3):  # three payloads missed, the journal holds two
        payload(rec, [KVEvent("stored", [10 + step]), KVEvent("removed", [1])])
    state.apply_stats("r0", parse_routing_stats(payload(rec, [KVEvent("stored", [20])])), now=2.0)
    replica = state.replicas["r0"]
    assert replica.needs_resync and replica.gaps == 1
    snapshot = parse_routing_stats(rec.snapshot_payload(STATS))
    assert snapshot.seq == rec.seq and sorted(snapshot.snapshot) == [10, 11, 12, 20]
    state.apply_stats("r0", snapshot, now=3.0)
    assert not replica.needs_resync and replica.cached == {10, 11, 12, 20}
    state.apply_stats("r0", parse_routing_stats(payload(rec, [KVEvent("removed", [10])])), now=4.0)
    assert replica.synced and replica.cached == {11, 12, 20}


def test_a_view_that_disagrees_with_the_replica_checksum_is_resynced():
    rec = RoutingStatsRecorder(full_every=1000)
    state = RouterState()
    state.apply_stats("r0", parse_routing_stats(payload(rec, [KVEvent("stored", [1, 2])])), now=1.0)
    state.replicas["r0"].cached.add(99)  # a view gone wrong (whatever the cause)
    state.apply_stats("r0", parse_routing_stats(payload(rec, [KVEvent("stored", [3])])), now=2.0)
    assert state.replicas["r0"].needs_resync and state.replicas["r0"].mismatches == 1


def test_nothing_is_lost_at_1000_events_per_second_from_4_replicas():
    """4 replicas emit 1,000 KV events/s in all for 20 s; their payloads (every 0.25 s) reach the
    router the way Serve's long poll delivers them: late, coalesced (only the latest one), between
    routing calls. After every delivery the router's view of each replica equals the replica's
    hash set as of the payload it applied; gaps are closed by snapshots through `core.resync`."""
    from msaserve.router.core import RouterCore

    rng = random.Random(0)
    clock = [0.0]
    recorders = {f"r{i}": RoutingStatsRecorder(full_every=10_000, journal_len=4, clock=lambda: clock[0])
                 for i in range(4)}
    truth: dict[str, list[set[int]]] = {rid: [] for rid in recorders}  # held after each seq
    pending: list[tuple[str, str]] = []
    core = RouterCore("kv_aware", 16, clock=lambda: clock[0],
                      resync=lambda rid: pending.append(("snap", rid)))
    live: dict[str, set[int]] = {rid: set() for rid in recorders}
    latest: dict[str, dict] = {}
    num_events = 0
    for tick in range(80):  # 20 s of 0.25 s periods
        clock[0] = tick * 0.25
        for rid, rec in recorders.items():
            events = []
            for _ in range(62 + (tick + int(rid[1])) % 2):  # 250 events per period over 4 replicas
                h = rng.getrandbits(64)
                if live[rid] and rng.random() < 0.4:
                    h = rng.choice(sorted(live[rid]))
                    live[rid].discard(h)
                    events.append(KVEvent("removed", [h]))
                else:
                    live[rid].add(h)
                    events.append(KVEvent("stored", [h]))
                num_events += 1
            latest[rid] = payload(rec, events)
            truth[rid].append(set(rec.held))
        if rng.random() < 0.7:  # a broadcast reaches the router (else it is coalesced into the next)
            delivered = [(rid, latest[rid]) for rid in recorders if rng.random() < 0.8]
            core.refresh(delivered)
            for rid, _ in delivered:
                view = core.state.replicas[rid]
                if view.synced:
                    assert view.cached == truth[rid][view.stats_seq], (tick, rid)
        while pending:  # the replicas answer the router's snapshot requests
            _, rid = pending.pop()
            core.snapshot_arrived(rid, recorders[rid].snapshot_payload(STATS))
    core.refresh(list(latest.items()))
    assert num_events >= 20_000
    for rid, rec in recorders.items():
        view = core.state.replicas[rid]
        assert view.synced and view.cached == rec.held and view.stats_seq == rec.seq
        assert view.mismatches == 0
    assert sum(r.deltas_applied for r in core.state.replicas.values()) > 200
    assert core.log.resyncs > 0  # some gaps outran the journal and were closed by snapshots


def test_cleared_forces_a_full_snapshot():
    rec = RoutingStatsRecorder(full_every=100)
    payload(rec, [KVEvent("stored", [1, 2])])
    after = parse_routing_stats(payload(rec, [KVEvent("cleared", []), KVEvent("stored", [9])]))
    assert after.full and after.snapshot == [9] and [d.seq for d in after.deltas] == [1]
    state = RouterState()
    state.apply_stats("r0", after, now=1.0)
    assert state.replicas["r0"].cached == {9}


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
    with pytest.raises(ValueError, match="v=1"):
        parse_routing_stats({**good, "v": 1})
    broken = dict(good)
    del broken["free_pages"]
    with pytest.raises(ValueError, match="free_pages"):
        parse_routing_stats(broken)
    with pytest.raises(ValueError, match=r"KVEvent\.kind='moved'"):
        payload(RoutingStatsRecorder(), [KVEvent("moved", [1])])  # type: ignore[arg-type]
