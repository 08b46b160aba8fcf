"""The KV-aware router live: a local Ray Serve app (platform `build_app`) with 2 CPU replicas of the
`tiny` preset. Requests go through a handle to the Model deployment from this process, so the
router that places them (`serve_router.live_cores()`) is the real `MSARequestRouter` and its view
and decisions can be compared with what the replicas did: where a request ran comes from the
replica's own session table (`session_info`), cache hits from the engine's request stats, the
replica's page hashes from its `routing_snapshot`."""

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
from local_serve_app import start_live_app

from msaserve.engine.types import GenerateOutput, GenerateRequest, SamplingParams
from msaserve.kvcache.page_hash import page_hashes
from msaserve.platform.app import APP_NAME
from msaserve.router.core import ROUTING_TARGET, RouterCore
from msaserve.router.serve_router import live_cores
from msaserve.router.stats import parse_routing_stats

pytestmark = pytest.mark.slow

PAGE = 16  # the tiny preset's page size
SERVE_CONFIG = {
    "model": {"spec": "tiny"},
    "engine": {"max_num_seqs": 8, "max_waiting": 64, "max_model_len": 2048},
    "router": {"policy": "kv_aware", "stats_period_s": 0.25, "imbalance_ratio": 1.5, "imbalance_min_load": 2},
    "auth": {"api_keys": ["router-key"]},
    "deployments": {"model": {"num_replicas": 2, "max_ongoing_requests": 16,
                              "ray_actor_options": {"num_cpus": 0.5}}},
}


class Live:
    def __init__(self, app) -> None:
        self.handle = app.model_handle()
        self.stream = self.handle.options(stream=True)  # kept: its router lives as long as it does
        self.calls = 0
        self._core: RouterCore | None = None

    def generate(self, prompt: list[int], session: str | None, max_tokens: int = 4) -> GenerateOutput:
        self.calls += 1
        handle = self.stream
        if session:
            handle = handle.options(session_id=session)
        request = GenerateRequest(f"live-{self.calls}-{time.monotonic_ns()}", prompt,
                                  SamplingParams(max_tokens=max_tokens, temperature=0.0), session_id=session)
        last = None
        for out in handle.generate.remote(request):
            assert isinstance(out, GenerateOutput), out
            last = out
        assert last is not None and last.finished
        return last

    def replica_of(self, session: str) -> str:
        info = self.handle.options(session_id=session).session_info.remote(session).result(timeout_s=30)
        assert info is not None, session
        return info.replica_id

    def call_replica(self, method: str, replica_id: str, **extra):
        arg = {ROUTING_TARGET: replica_id, **extra}
        return getattr(self.handle, method).remote(arg).result(timeout_s=30)

    @property
    def core(self) -> RouterCore:
        """The router that places this test's generate calls (the first one made in this process;
        others route only snapshot and session calls)."""
        if self._core is None:
            cores = live_cores()
            assert cores, "no MSARequestRouter in the test process"
            self._core = max(cores, key=lambda c: len(c.placements))
        return self._core


def tokens(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]  # the tiny tokenizer has 259 ids


def wait_for(condition, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    with start_live_app(SERVE_CONFIG, timeout_s=180) as app:
        live = Live(app)
        seen: set[str] = set()
        deadline = time.monotonic() + 180
        for i in range(200):  # warm-up until both engines answer
            assert time.monotonic() < deadline, f"only replicas {seen} served in 180 s"
            live.generate(tokens(20, seed=i), f"warmup-{i}")
            seen.add(live.replica_of(f"warmup-{i}"))
            if len(seen) == 2:
                break
        yield live


def test_placement_is_the_decision_and_kv_events_drive_it(live):
    prefix = tokens(30 * PAGE, seed=7)  # a long shared system prompt
    live.generate(prefix + tokens(10, seed=8), "prefix-owner")
    core = live.core
    holder = live.replica_of("prefix-owner")
    hashes = page_hashes(prefix, PAGE)
    view = core.state.replicas[holder]
    wait_for(lambda: set(hashes) <= view.cached, "the holder's KV events reach the router", 5.0)
    for i in range(4):
        for replica in core.state.replicas.values():  # the router's own guesses gone: events alone
            replica.estimated.clear()
        # The router's count of requests it sent since the last report is load too: wait for the
        # reports to cover the previous request so that only the KV events tell the replicas apart.
        wait_for(lambda: not any(r.routed for r in core.state.replicas.values()), "reports arrive", 5.0)
        out = live.generate(prefix + tokens(10, seed=20 + i), f"prefix-new-{i}")
        _, decision, routed = core.placements[-1]
        where = (decision, routed, live.replica_of(f"prefix-new-{i}"), holder)
        assert decision.replica_id == routed == where[2] == holder, where
        assert decision.predicted_hit_pages >= len(hashes) - 1
        assert out.stats.num_cached_tokens >= len(prefix) - PAGE
    for _, decision, routed in core.placements:
        assert decision.replica_id == routed or core.log.decisions["spilled"] > 0


def test_no_kv_event_is_lost(live):
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: live.generate(tokens(6 * PAGE + i, seed=500 + i), f"burst-{i}", max_tokens=8),
                      range(48)))
    core = live.core
    time.sleep(1.0)  # idle: the replicas' hash sets stop changing; the last payloads arrive
    for replica_id, view in list(core.state.replicas.items()):
        snapshot = parse_routing_stats(live.call_replica("routing_snapshot", replica_id))
        assert snapshot is not None and snapshot.replica_id == replica_id
        wait_for(lambda v=view, s=snapshot: v.stats_seq >= s.seq and v.synced, "router caught up", 5.0)
        assert view.cached == set(snapshot.snapshot), replica_id
        assert view.mismatches == 0
        assert view.deltas_applied > 0


def test_a_session_follows_its_replica_and_moves_when_draining_or_overloaded(live):
    core = live.core
    prompt = tokens(50, seed=900)
    live.generate(prompt, "follow")
    home = live.replica_of("follow")
    for turn in range(2):
        prompt = prompt + tokens(12, seed=910 + turn)
        live.generate(prompt, "follow")
        _, decision, routed = core.placements[-1]
        assert routed == home and decision.reason == "session_affinity"
    live.call_replica("drain", home, draining=True)
    try:
        wait_for(lambda: core.state.replicas[home].draining, "the drain reaches the router", 5.0)
        live.generate(prompt + tokens(12, seed=920), "follow")
        _, decision, routed = core.placements[-1]
        assert routed != home and decision.reason == "session_moved"
        assert live.replica_of("follow") == routed
    finally:
        live.call_replica("drain", home, draining=False)
    wait_for(lambda: not core.state.replicas[home].draining, "the undrain reaches the router", 5.0)
    # Overload: 8 concurrent turns of one session; past the imbalance guard they spill over.
    start = len(core.placements)
    hot = tokens(40, seed=930)
    live.generate(hot, "hot")
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: live.generate(hot + tokens(4, seed=940 + i), "hot", max_tokens=64), range(8)))
    placed = [(d.reason, routed) for _, d, routed in list(core.placements)[start:]]
    assert len({routed for _, routed in placed}) == 2, placed
    assert any(reason == "session_moved" for reason, _ in placed), placed


def test_a_dead_replicas_sessions_are_placed_elsewhere(live):
    live.generate(tokens(50, seed=300), "doomed")
    victim = live.replica_of("doomed")
    ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#Model#{victim}", namespace="serve"), no_restart=True)
    for i in range(4):
        live.generate(tokens(30, seed=400 + i), f"after-kill-{i}")
        assert live.replica_of(f"after-kill-{i}") != victim
    live.generate([*tokens(50, seed=300), 7, 8, 9], "doomed")
    assert live.replica_of("doomed") != victim
    assert victim not in live.core.state.replicas
