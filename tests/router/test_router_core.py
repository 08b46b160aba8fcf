"""The Ray-free core of the Serve router: reading the call, recording decisions, config mapping."""

import pytest

from msaserve.engine.types import EngineStats, GenerateRequest, KVEvent, SamplingParams
from msaserve.kvcache.page_hash import page_hashes
from msaserve.router.core import RouterCore, request_view
from msaserve.router.stats import RoutingStatsRecorder, routing_stats_payload

PAGE = 16
PROMPT = list(range(100, 100 + 5 * PAGE + 3))  # 5 full pages and a partial one


def test_request_view_reads_a_generate_request():
    gen = GenerateRequest("r1", PROMPT, SamplingParams(max_tokens=30), session_id="chat-1")
    view = request_view([gen], {}, PAGE, "k")
    assert view.page_hashes == page_hashes(PROMPT, PAGE)
    assert view.session_id == "chat-1" and view.num_pages == -(-(len(PROMPT) + 30) // PAGE)


def test_request_view_reads_a_dict_or_keyword_and_falls_back_safely():
    view = request_view([], {"request": {"prompt_token_ids": PROMPT, "session_id": "s"}}, PAGE, "k")
    assert len(view.page_hashes) == 5 and view.session_id == "s"
    for args in ([], ["a prompt string"], [{"messages": []}], [42]):
        fallback = request_view(args, {}, PAGE, "k")
        assert fallback.page_hashes == () and fallback.num_pages == 1


def test_rank_records_a_request_once_and_counts_spills():
    core = RouterCore("kv_aware", PAGE, seed=0, clock=lambda: 50.0)
    core.sync(["a", "b"])
    gen = GenerateRequest("r1", PROMPT, session_id="chat")
    first = core.rank([gen], {}, "req-1", ["a", "b"])
    again = core.rank([gen], {}, "req-1", ["a", "b"])  # Serve retries after full queues
    assert [d.replica_id for d in first] == [d.replica_id for d in again]
    assert sum(core.log.decisions.values()) == 1 and core.state.replicas[first[0].replica_id].load == 1
    core.routed("req-1", first[1].replica_id)  # Serve took the second rank
    assert core.log.decisions["spilled"] == 1
    loads = {rid: r.load for rid, r in core.state.replicas.items()}
    assert loads == {first[0].replica_id: 0, first[1].replica_id: 1}
    assert core.state.sessions["chat"] == first[1].replica_id


def test_refresh_applies_payloads_and_the_next_turn_follows_the_pages():
    clock = [10.0]
    core = RouterCore("kv_aware", PAGE, clock=lambda: clock[0])
    rec_a, rec_b = RoutingStatsRecorder(clock=lambda: clock[0]), RoutingStatsRecorder(clock=lambda: clock[0])
    stats = EngineStats(num_running=1, num_waiting=0, num_free_pages=90, num_total_pages=100,
                        prefix_hit_rate=0.5)
    events_b = [KVEvent("stored", page_hashes(PROMPT, PAGE))]
    core.refresh([("a", routing_stats_payload(stats, [], rec_a)),
                  ("b", routing_stats_payload(stats, events_b, rec_b))])
    ranking = core.rank([{"prompt_token_ids": [*PROMPT, 1, 2, 3]}], {}, "q", ["a", "b"])
    assert ranking[0].replica_id == "b" and ranking[0].predicted_hit_pages == 5
    assert core.log.reported_hit_rate == {"a": 0.5, "b": 0.5}
    core.replica_died("b")
    assert core.rank([{"prompt_token_ids": PROMPT}], {}, "q2", ["a"])[0].replica_id == "a"


def test_request_router_config_takes_the_serve_config_router_section():
    serve_router = pytest.importorskip("msaserve.router.serve_router")
    section = {"policy": "kv_aware", "w_prefill": 2.0, "w_decode": 0.1, "affinity_credit": 8.0,
               "imbalance_ratio": 1.5, "imbalance_min_load": 4, "stats_period_s": 0.5}
    cfg = serve_router.request_router_config(section, page_size=64)
    assert cfg.request_router_class == serve_router.ROUTER_CLASS_PATH
    assert cfg.request_routing_stats_period_s == 0.5
    core = serve_router.build_core(cfg.request_router_kwargs)
    policy_cfg = core.policy.config
    assert (policy_cfg.w_prefill, policy_cfg.w_decode, policy_cfg.affinity_credit) == (2.0, 0.1, 8.0)
    assert (policy_cfg.imbalance_rel, policy_cfg.imbalance_abs) == (1.5, 4.0)
    assert core.state.estimate_expiry_s == 10.0 and core.page_size == 64
    with pytest.raises(ValueError, match=r"unknown keys \['w_prefil'\]"):
        serve_router.request_router_config({"w_prefil": 1.0})
    with pytest.raises(ValueError, match=r"router\.policy='lru'"):
        serve_router.request_router_config({"policy": "lru"})


def test_page_size_is_learned_from_a_payload_or_from_matching_hashes():
    stats = EngineStats(num_running=0, num_waiting=0, num_free_pages=10, num_total_pages=10)
    told = RouterCore("kv_aware")
    told.refresh([("a", routing_stats_payload(stats, [], RoutingStatsRecorder(page_size=32)))])
    assert told.page_size == 32
    guessed = RouterCore("kv_aware")
    guessed.rank([{"prompt_token_ids": PROMPT}], {}, "q", ["a"])  # routed before any report
    events = [KVEvent("stored", page_hashes(PROMPT, PAGE))]  # the engine used 16-token pages
    guessed.refresh([("a", routing_stats_payload(stats, events, RoutingStatsRecorder()))])
    assert guessed.page_size == PAGE
    assert guessed.rank([{"prompt_token_ids": PROMPT}], {}, "q2", ["a"])[0].predicted_hit_pages == 5


def test_calls_without_tokens_follow_the_session_and_are_not_counted():
    core = RouterCore("kv_aware", PAGE, clock=lambda: 1.0)
    core.sync(["a", "b", "c"])
    turn = core.rank([GenerateRequest("r", PROMPT, session_id="chat")], {}, "k1", ["a", "b", "c"])
    home = turn[0].replica_id
    core.state.replicas[home].waiting_prefill_pages = 10_000  # even a busy home answers lookups
    for key in ("k2", "k3"):  # session_info("chat") with the handle's session_id option
        assert core.rank(["chat"], {}, key, ["a", "b", "c"], session_id="chat")[0].replica_id == home
    assert sum(core.log.decisions.values()) == 1
    assert sum(r.load for r in core.state.replicas.values()) == 1
