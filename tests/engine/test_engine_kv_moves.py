"""Proactive session moves (engine/kv/moves.py + router/moves.py) between in-process engines
sharing one KV cache service: a draining replica's sessions move mid-turn to the least-loaded
replicas and finish with exactly the tokens of a run that never moved; a replica that dies loses
no session — the new home continues from the record (at most sync_every tokens behind) plus the
tokens the client already received.

tiny: P=16, K=4: these 200-token sessions attend sparsely."""

import pytest
import torch
from engine_helpers import collect, greedy, random_prompt

from msaserve.engine.config import EngineConfig
from msaserve.engine.kv.moves import move_in, move_out, persist_lag_tokens
from msaserve.engine.kv.pages import identity_for
from msaserve.engine.llm_engine import LLMEngine
from msaserve.engine.types import GenerateRequest
from msaserve.kvcache.client import KVCacheClient
from msaserve.kvcache.config import ServiceConfig
from msaserve.models.presets import get_preset
from msaserve.models.transformer import MSATransformer, init_random_weights
from msaserve.router.moves import plan_moves
from msaserve.router.state import RouterState

PROMPT_LEN, TOKENS, SESSIONS, SYNC_EVERY = 200, 10, 3, 4


@pytest.fixture(scope="module")
def model() -> MSATransformer:
    return init_random_weights(MSATransformer(get_preset("tiny"), "msa"), seed=0).eval()


def engine(model, client=None, lane: bool = False) -> LLMEngine:
    """lane: sessions decode sparse-resident once their prefill is done (persisted from there)."""
    residency = dict(sparse_residency_sessions=SESSIONS, sparse_residency_min_tokens=PROMPT_LEN,
                     sparse_residency_budget=0.01) if lane else {}
    config = EngineConfig(model="tiny", attention_backend="msa", num_pages=128, max_num_seqs=4,
                          max_num_batched_tokens=64, max_model_len=1024, **residency)
    e = LLMEngine(config, model=model, kv_client=client)
    if e.sessions is not None:
        e.sessions.sync_every = SYNC_EVERY
    return e


@pytest.fixture(scope="module")
def reference(model):
    """Every session's tokens on one replica that never moves (no service)."""
    prompts = {f"s{i}": random_prompt(PROMPT_LEN + 7 * i, seed=20 + i) for i in range(SESSIONS)}
    ref = engine(model)
    for sid, prompt in prompts.items():
        ref.add_request(GenerateRequest(f"ref-{sid}", prompt, greedy(TOKENS)))
    out = collect(ref)
    return prompts, {sid: out[f"ref-{sid}"] for sid in prompts}


def start(home: LLMEngine, prompts: dict[str, list[int]], steps: int) -> dict[str, list[int]]:
    """Start every session on `home` and step it `steps` times → tokens streamed per session."""
    for sid, prompt in prompts.items():
        home.add_request(GenerateRequest(f"{sid}-turn", prompt, greedy(TOKENS), session_id=sid))
    streamed: dict[str, list[int]] = {sid: [] for sid in prompts}
    for _ in range(steps):
        for output in home.step():
            streamed[output.request_id.removesuffix("-turn")].extend(output.token_ids)
    return streamed


def router_with(sessions: list[str], home: str, replicas: list[str]) -> RouterState:
    """The router's view: every session at `home` (gone from `replicas` if it died)."""
    state = RouterState()
    state.sync_replicas(replicas)
    for sid in sessions:
        state.sessions[sid] = home
    if home in replicas:
        state.replica(home).num_running = len(sessions)
    return state


def finish(engines: dict[str, LLMEngine]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for e in engines.values():
        collect(e, out)
    return {request_id.split("-turn")[0]: tokens for request_id, tokens in out.items()}


@pytest.mark.parametrize("lane", [False, True])
def test_draining_replica_moves_its_sessions_mid_turn_with_identical_tokens(model, reference, lane):
    """lane: the sessions decode sparse-resident on the draining replica, persisted from there, and
    the replicas they move to adopt them straight into their lanes (index first, K/V as selected)."""
    prompts, want = reference
    client = KVCacheClient.in_process(ServiceConfig(num_shards=2, memory_bytes=64 << 20),
                                      identity_for(model.config, "tiny@seed0", torch.float32))
    engines = {name: engine(model, client, lane=lane) for name in ("a", "b", "c")}
    streamed = start(engines["a"], prompts, steps=11)  # each session has 2..8 tokens
    assert all(0 < len(tokens) < TOKENS for tokens in streamed.values())
    if lane:
        assert len(engines["a"].resident) == SESSIONS  # every session decodes off the pool

    router = router_with(list(prompts), "a", list(engines))
    router.replica("a").draining = True  # Helm drain / scale-down
    plan = plan_moves(router)
    assert {m.session_id for m in plan} == set(prompts) and {m.to_replica for m in plan} == {"b", "c"}
    moves = {m.session_id: m for m in move_out(engines["a"])}
    assert not engines["a"].has_unfinished()
    for planned in plan:
        moved = moves[planned.session_id]
        assert moved.persisted_tokens == len(moved.token_ids)  # made current before letting go
        move_in(engines[planned.to_replica], moved, request_id=f"{planned.session_id}-turn/moved")
    rest = finish({k: v for k, v in engines.items() if k != "a"})
    lost = [sid for sid in prompts if streamed[sid] + rest.get(sid, []) != want[sid]]
    assert lost == []
    assert sum(engines[k].sessions.stats.adopted for k in ("b", "c")) == SESSIONS  # adopted, not prefilled
    if lane:
        assert sum(engines[k].resident.stats.adopted for k in ("b", "c")) == SESSIONS


@pytest.mark.parametrize("lane", [False, True])
def test_a_failed_replica_loses_no_session_that_reached_the_service(model, reference, lane):
    prompts, want = reference
    client = KVCacheClient.in_process(ServiceConfig(num_shards=2, memory_bytes=64 << 20),
                                      identity_for(model.config, "tiny@seed0", torch.float32))
    dying, heir = engine(model, client, lane=lane), engine(model, client, lane=lane)
    streamed = start(dying, prompts, steps=11)
    assert len(dying.resident or ()) == (SESSIONS if lane else 0)
    lag = persist_lag_tokens(dying)
    assert 0 < lag < SYNC_EVERY  # write-behind: bounded, and the record really is behind
    # The replica dies here: no move_out. The router re-homes its sessions; each continues from
    # its record plus the tokens the client already received.
    router = router_with(list(prompts), "dying", ["heir"])
    plan = plan_moves(router)
    assert {(m.from_replica, m.to_replica, m.reason) for m in plan} == {("dying", "heir", "dead")}
    for sid, prompt in prompts.items():
        received = streamed[sid]
        retry = GenerateRequest(f"{sid}-turn/retry", prompt + received, greedy(TOKENS - len(received)),
                                session_id=sid)
        heir.add_request(retry)
    rest = finish({"heir": heir})
    assert [sid for sid in prompts if streamed[sid] + rest[sid] != want[sid]] == []
    assert heir.sessions.stats.adopted == SESSIONS
    if lane:  # each retry's prompt holds the tokens the record lacks (< SYNC_EVERY): caught up in the lane
        assert heir.resident.stats.adopted == SESSIONS and heir.resident.stats.catch_up_steps > 0


def test_overloaded_replica_sheds_its_newest_sessions_to_the_least_loaded():
    state = RouterState()
    state.sync_replicas(["hot", "warm", "cold"])
    for i in range(8):
        state.sessions[f"s{i}"] = "hot"
    state.replica("hot").num_running, state.replica("warm").num_running = 8, 2
    plan = plan_moves(state, overload_factor=1.5)
    assert [m.session_id for m in plan] == ["s7", "s6", "s5", "s4", "s3"]  # down to the mean (10/3 → 3)
    assert [m.to_replica for m in plan] == ["cold", "cold", "cold", "warm", "cold"]
    assert all(m.reason == "overloaded" for m in plan) and state.sessions["s7"] == "cold"
    for rid, load in (("hot", 3), ("warm", 3), ("cold", 4)):  # the replicas' next reports
        state.replica(rid).num_running = load
    assert plan_moves(state) == []  # balanced now
    with pytest.raises(ValueError, match=r"overload_factor=0\.5 is invalid"):
        plan_moves(state, overload_factor=0.5)
