"""Every policy on constructed states: which replica, and the reason it gives."""

import random

import pytest

from msaserve.router.kv_aware import KVAwareConfig, KVAwarePolicy, family_home, make_policy
from msaserve.router.policies import Pow2Policy, PrefixAffinityPolicy, RoundRobinPolicy, is_imbalanced
from msaserve.router.state import RequestView, RouterState

NOW = 100.0


def make_state(*specs: dict) -> RouterState:
    """specs: per replica r0, r1, ...: cached (hashes), running, waiting, free, total, draining."""
    state = RouterState(estimate_expiry_s=10.0)
    for i, spec in enumerate(specs):
        r = state.replica(f"r{i}")
        r.cached = set(spec.get("cached", ()))
        r.num_running, r.num_waiting = spec.get("running", 0), spec.get("waiting", 0)
        r.num_total_pages = spec.get("total", 1000)
        r.num_free_pages = spec.get("free", r.num_total_pages)
        r.waiting_prefill_pages = spec.get("queued", 0)
        r.draining = spec.get("draining", False)
    return state


def req(hashes=(), session=None, pages=None, rid="q"):
    return RequestView(rid, list(hashes), pages if pages is not None else max(1, len(hashes) + 1), session)


def choose(policy, state, request):
    return policy.choose(request, list(state.replicas.values()), NOW)


PREFIX = list(range(1000, 1040))  # a 40-page prompt


def test_round_robin_cycles_and_skips_draining():
    state = make_state({}, {"draining": True}, {})
    policy = RoundRobinPolicy(state)
    picks = [choose(policy, state, req()).replica_id for _ in range(4)]
    assert picks == ["r0", "r2", "r0", "r2"]
    assert choose(policy, state, req()).reason == "round_robin"


def test_pow2_takes_the_less_loaded_of_two_and_is_seeded():
    state = make_state({"running": 5}, {"running": 1})
    assert {choose(Pow2Policy(state, random.Random(s)), state, req()).replica_id for s in range(10)} == {"r1"}
    state3 = make_state({"running": 3}, {"running": 2}, {"running": 1})
    a = [choose(Pow2Policy(state3, random.Random(7)), state3, req()).replica_id for _ in range(5)]
    b = [choose(Pow2Policy(state3, random.Random(7)), state3, req()).replica_id for _ in range(5)]
    assert a == b and "r0" not in a  # the most loaded never wins a pair


def test_pow2_single_candidate_and_no_candidates():
    state = make_state({})
    assert choose(Pow2Policy(state), state, req()).reason == "only_candidate"
    state.replicas["r0"].alive = False
    with pytest.raises(ValueError, match="no live replica"):
        choose(Pow2Policy(state), state, req())


def test_hit_pages_stop_at_the_first_miss_of_the_chain():
    state = make_state({"cached": PREFIX[:10] + PREFIX[11:]})
    assert state.replicas["r0"].hit_pages(PREFIX, NOW) == 10


def test_prefix_affinity_prefers_longest_prefix_then_guard():
    state = make_state({"cached": PREFIX[:5]}, {"cached": PREFIX[:30], "running": 3}, {})
    policy = PrefixAffinityPolicy(state, random.Random(0), imbalance_abs=8, imbalance_rel=1.5)
    d = choose(policy, state, req(PREFIX))
    assert (d.replica_id, d.reason, d.predicted_hit_pages) == ("r1", "prefix_hit", 30)
    state.replicas["r1"].num_waiting = 40  # now imbalanced: 43 vs 0 vs 0
    assert choose(policy, state, req(PREFIX)).reason == "imbalance_pow2"
    assert choose(policy, make_state({"running": 2}, {}), req([1, 2])).reason == "least_load"


def test_kv_aware_goes_where_the_prefix_is():
    state = make_state({}, {"cached": PREFIX}, {})
    d = choose(KVAwarePolicy(state), state, req(PREFIX))
    assert (d.replica_id, d.reason, d.predicted_hit_pages) == ("r1", "prefix_hit", 40)


def test_kv_aware_spills_when_the_holder_has_more_queued_prefill_than_the_prefix_saves():
    state = make_state({}, {"cached": PREFIX, "queued": 500, "waiting": 3}, {"queued": 10, "waiting": 1})
    unbounded = KVAwareConfig(queue_horizon_pages=1024)  # 500 queued pages all priced
    d = choose(KVAwarePolicy(state, config=unbounded), state, req(PREFIX))
    assert d.replica_id == "r0" and d.reason == "least_cost"
    # The default horizon (32 pages) prices at most 16 pages of queue: the 40-page prefix decides.
    assert choose(KVAwarePolicy(state), state, req(PREFIX)).replica_id == "r1"


def test_kv_aware_decode_weight_breaks_ties_toward_fewer_active_pages():
    state = make_state({"free": 200}, {"free": 900})
    assert choose(KVAwarePolicy(state), state, req([7, 8])).replica_id == "r1"


def test_kv_aware_session_stays_home_against_a_slightly_cheaper_replica():
    state = make_state({"queued": 8}, {"queued": 0})
    state.sessions["s1"] = "r0"
    d = choose(KVAwarePolicy(state), state, req([5, 6], session="s1"))
    assert (d.replica_id, d.reason) == ("r0", "session_affinity")
    state.replicas["r0"].waiting_prefill_pages = 100  # past the credit: the session spills
    assert choose(KVAwarePolicy(state), state, req([5, 6], session="s1")).reason == "session_moved"


@pytest.mark.parametrize("how", ["full", "draining", "dead", "overloaded"])
def test_kv_aware_moves_a_session_off_a_bad_home(how):
    state = make_state({"cached": PREFIX}, {}, {})
    state.sessions["s1"] = "r0"
    home = state.replicas["r0"]
    if how == "full":
        home.num_free_pages = 5  # the request needs 41 pages
    elif how == "draining":
        home.draining = True
    elif how == "dead":
        state.remove_replica("r0")
    else:
        home.num_running = 60  # 60 vs 0, 0: past 16 absolute and 2× mean
        state.replicas["r1"].num_running = 1
    strict = KVAwareConfig(spill_on_full_kv=True, imbalance_rel=2.0)  # both guards on
    d = choose(KVAwarePolicy(state, config=strict), state, req(PREFIX, session="s1"))
    assert d.replica_id != "r0" and d.reason == "session_moved"


def test_by_default_a_full_kv_cache_keeps_the_session_home():
    """Near capacity every replica's pages are full of running sequences: leaving the home for
    that scattered sessions away from their prefixes (the session trace in performance-router)."""
    state = make_state({"cached": PREFIX}, {}, {})
    state.sessions["s1"] = "r0"
    state.replicas["r0"].num_free_pages = 5
    d = choose(KVAwarePolicy(state), state, req(PREFIX, session="s1"))
    assert (d.replica_id, d.reason) == ("r0", "session_affinity")


def test_queued_work_is_priced_up_to_the_horizon_then_the_prefix_decides():
    cfg = KVAwareConfig(queue_horizon_pages=64, w_queue=0.5, family_credit=0.0)
    below = make_state({"cached": PREFIX, "queued": 60}, {"queued": 0})  # 40-page hit vs 30 pages queued
    assert choose(KVAwarePolicy(below, config=cfg), below, req(PREFIX)).replica_id == "r0"
    short = make_state({"cached": PREFIX[:5], "queued": 60}, {"queued": 0})  # 5-page hit: the queue wins
    assert choose(KVAwarePolicy(short, config=cfg), short, req(PREFIX)).replica_id == "r1"
    past = make_state({"cached": PREFIX[:5], "queued": 500}, {"queued": 80})  # both past 64 pages
    assert choose(KVAwarePolicy(past, config=cfg), past, req(PREFIX)).replica_id == "r0"


def test_kv_aware_guard_falls_back_to_pow2_when_imbalanced():
    state = make_state({"cached": PREFIX, "running": 40}, {"running": 2}, {"running": 3})
    assert is_imbalanced(list(state.replicas.values()), 16, 2.0)
    guard = KVAwareConfig(imbalance_rel=2.0)
    d = choose(KVAwarePolicy(state, random.Random(1), guard), state, req(PREFIX))
    assert d.reason == "imbalance_pow2"
    picks = {choose(KVAwarePolicy(state, random.Random(s), guard), state, req(PREFIX)).replica_id
             for s in range(20)}
    assert "r0" not in picks  # pow2 never prefers the 40-sequence replica over a 2- or 3-sequence one


def test_guard_needs_both_thresholds():
    light = make_state({"running": 3}, {"running": 0})  # 3× the mean but only 3 apart
    heavy = make_state({"running": 120}, {"running": 100})  # 20 apart but 1.09× the mean
    assert not is_imbalanced(list(light.replicas.values()), 16, 2.0)
    assert not is_imbalanced(list(heavy.replicas.values()), 16, 2.0)


def test_kv_aware_prefers_where_the_session_index_is_resident():
    state = make_state({"queued": 5}, {})
    state.replicas["r0"].resident_sessions.add("s9")
    assert choose(KVAwarePolicy(state), state, req([1], session="s9")).replica_id == "r0"
    cfg = KVAwareConfig(index_credit=0.0)
    assert choose(KVAwarePolicy(state, config=cfg), state, req([1], session="s9")).replica_id == "r1"


def test_routed_requests_are_followed_before_any_report_and_expire():
    state = make_state({}, {}, {})
    policy = KVAwarePolicy(state)
    first = choose(policy, state, req(PREFIX, rid="a"))
    state.on_routed(req(PREFIX, rid="a"), first.replica_id, NOW)
    state.replicas[first.replica_id].routed.clear()  # same load everywhere: only the prefix differs
    second = policy.choose(req(PREFIX, rid="b"), list(state.replicas.values()), NOW + 1)
    assert second.replica_id == first.replica_id and second.predicted_hit_pages == 40
    late = policy.choose(req(PREFIX, rid="c"), list(state.replicas.values()), NOW + 11)
    assert late.predicted_hit_pages == 0


def test_routed_load_counts_until_the_next_report():
    state = make_state({}, {})
    policy = KVAwarePolicy(state)
    for i in range(4):
        d = choose(policy, state, req([i], rid=str(i)))
        state.on_routed(req([i], rid=str(i)), d.replica_id, NOW)
    assert sorted(r.load for r in state.replicas.values()) == [2, 2]


def test_rank_lists_every_candidate_once_choice_first():
    state = make_state({"running": 4}, {"cached": PREFIX}, {"running": 1})
    ranking = KVAwarePolicy(state).rank(req(PREFIX), list(state.replicas.values()), NOW)
    assert [d.replica_id for d in ranking] == ["r1", "r2", "r0"]


def test_config_and_factory_errors_name_the_field():
    with pytest.raises(ValueError, match="w_decode=-1"):
        KVAwareConfig(w_decode=-1)
    with pytest.raises(ValueError, match=r"imbalance_rel=0\.5"):
        KVAwareConfig(imbalance_rel=0.5)
    with pytest.raises(ValueError, match=r"router\.policy='fastest'"):
        make_policy("fastest", RouterState())
    for name in ("round_robin", "pow2", "prefix_affinity", "kv_aware"):
        assert make_policy(name, RouterState()).name == name


def test_a_policy_is_one_class() -> None:
    """Adding a routing policy is one new class: defining it registers it under its name, and
    make_policy builds it from the router's settings."""
    from msaserve.router.kv_aware import POLICIES, make_policy
    from msaserve.router.policies import POLICY_CLASSES, Policy, RoundRobinPolicy

    class FirstReplica(Policy):
        name = "first_replica_test"

        def choose(self, request, replicas, now):
            return RoundRobinPolicy(self.state, self.rng).choose(request, replicas[:1], now)

    try:
        assert isinstance(make_policy("first_replica_test", RouterState()), FirstReplica)
        assert "first_replica_test" not in POLICIES  # the product's names are fixed at import
    finally:
        POLICY_CLASSES.pop("first_replica_test")
    with pytest.raises(ValueError, match=r"router\.policy='nope' is invalid: allowed round_robin, pow2"):
        make_policy("nope", RouterState())


def test_family_home_is_stable_and_spreads_families():
    state = make_state({}, {}, {}, {})
    replicas = list(state.replicas.values())
    homes = [family_home(req([f, f + 1]), replicas) for f in range(400)]
    # The first page decides, whatever the order of the candidates.
    assert homes == [family_home(req([f, 99]), list(reversed(replicas))) for f in range(400)]
    counts = {rid: homes.count(rid) for rid in state.replicas}
    assert all(60 <= c <= 140 for c in counts.values()), counts
    assert family_home(req([]), replicas) is None


def test_family_credit_sends_a_miss_to_its_family_home_and_yields_to_a_holder():
    state = make_state({}, {}, {}, {})
    request = req(PREFIX)
    home = family_home(request, list(state.replicas.values()))
    credited = KVAwarePolicy(state, config=KVAwareConfig(family_credit=16.0))
    assert choose(credited, state, request).replica_id == home
    # Without the credit the tie breaks on replica id, whatever the family.
    plain = KVAwarePolicy(state, config=KVAwareConfig(family_credit=0.0))
    assert choose(plain, state, request).replica_id == "r0"
    # The credit is for families nobody holds: a replica holding even the first page (1 page saved,
    # less than 16 credited) gets the request, so a held prefix or a session is never pulled away.
    holder = next(rid for rid in state.replicas if rid != home)
    state.replicas[holder].cached = set(PREFIX[:1])
    assert choose(credited, state, request).replica_id == holder


def test_a_full_choice_spills_only_to_a_clearly_less_loaded_replica():
    """Past capacity every replica is full: spilling to an equally loaded one throws the prefix
    away without queueing less, so the ranking offers only replicas with at most half the load."""
    state = make_state({"cached": PREFIX, "running": 32, "waiting": 218},  # the holder: 250
                       {"running": 32, "waiting": 208},  # 240: as busy, no prefix
                       {"running": 32, "waiting": 68})  # 100: under half
    replicas = list(state.replicas.values())
    ranking = KVAwarePolicy(state).rank(req(PREFIX), replicas, NOW)
    assert [d.replica_id for d in ranking] == ["r0", "r2"]
    anywhere = KVAwarePolicy(state, config=KVAwareConfig(spill_load_ratio=1.0)).rank(req(PREFIX), replicas,
                                                                                     NOW)
    assert [d.replica_id for d in anywhere] == ["r0", "r2", "r1"]
    idle = make_state({"cached": PREFIX, "running": 1}, {}, {})  # idle replicas are always fallbacks
    assert len(KVAwarePolicy(idle).rank(req(PREFIX), list(idle.replicas.values()), NOW)) == 3
