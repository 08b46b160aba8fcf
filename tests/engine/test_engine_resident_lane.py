"""The engine's sparse-resident lane (engine/kv/resident_lane.py): long decoding requests leave the
page pool and decode with their whole index and a small working set of K/V on the device. Their
tokens are the pool's, greedy or sampled, alone or beside a batch; their pool pages are given back;
a finished or aborted request's host tier is reused.

tiny: P=16, K=4, Hkv=2, n_local=1: one step selects at most 8 pages per layer and the working set
is the least one, 10 pages (ring 2 + 8), against 19-37 pages per request here."""

from collections import Counter

import pytest
import torch
from engine_helpers import collect, greedy, make_engine, random_prompt, run_to_completion
from parallel.m3_tiny import random_m3

from msaserve.engine.config import EngineConfig
from msaserve.engine.kv.host_tier import HostKV
from msaserve.engine.kv.resident_session import ResidentSession
from msaserve.engine.llm_engine import LLMEngine
from msaserve.engine.sequence import SequenceStatus
from msaserve.engine.types import GenerateRequest, SamplingParams
from msaserve.models.presets import get_preset
from msaserve.models.transformer import MSATransformer, init_random_weights

LENGTHS = [300, 420, 560]
MAX_TOKENS = 24  # every request crosses a page boundary while resident: write-back and ring reuse
LANE = dict(sparse_residency_sessions=2, sparse_residency_min_tokens=256, sparse_residency_budget=0.01,
            max_model_len=640)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return [random_prompt(n, seed=10 + i) for i, n in enumerate(LENGTHS)]


def requests(prompts, sampling) -> list[GenerateRequest]:
    return [GenerateRequest(f"r{i}", p, sampling(i)) for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def pooled(tiny_model, prompts) -> dict[str, list[int]]:
    """Greedy tokens with every request in the pool."""
    return run_to_completion(make_engine(tiny_model, max_model_len=640),
                             requests(prompts, lambda i: greedy(MAX_TOKENS)))


def test_long_requests_decode_sparse_resident_with_the_pools_greedy_tokens(tiny_model, prompts, pooled):
    engine = make_engine(tiny_model, **LANE)
    lane = engine.resident
    assert lane.budget_pages == 10
    for request in requests(prompts, lambda i: greedy(MAX_TOKENS)):
        engine.add_request(request)
    outputs: dict[str, list[int]] = {}
    most = 0
    while engine.has_unfinished():
        for output in engine.step():
            outputs.setdefault(output.request_id, []).extend(output.token_ids)
        most = max(most, len(lane))
    assert outputs == pooled
    # each moved once its context reached 256 tokens and the lane (2 sessions) had room
    assert lane.stats.moved_in == 3 and lane.stats.finished == 3 and most == 2 and not lane
    assert lane.stats.steps > 2 * MAX_TOKENS and lane.stats.graph_steps == lane.stats.steps
    assert lane.stats.replays == 0  # (no CUDA graphs on the CPU)
    assert lane.stats.pages_freed >= 19 + 27 + 35
    # the selection moved over more pages than the working set holds: pages came and went
    assert lane.stats.pages_fetched > 0 and lane.stats.evictions > 0
    engine.block_manager.check_consistency()
    assert engine.block_manager.num_free_pages == engine.block_manager.num_pages


def test_the_lane_decodes_beside_the_pools_streamed_decode_rounds(tiny_model, prompts, pooled):
    """decode_steps=4 with room for one session in the lane: the pool's requests decode in rounds,
    one step handed out per engine step, while the lane's request steps once per engine step
    beside them; requests move to the lane only between rounds. Every token is the pool's."""
    engine = make_engine(tiny_model, **{**LANE, "sparse_residency_sessions": 1}, decode_steps=4)
    rounds = []
    original = engine.runner.execute_decode_round
    engine.runner.execute_decode_round = lambda batch, steps: rounds.append(steps) or original(batch, steps)
    for request in requests(prompts, lambda i: greedy(MAX_TOKENS)):
        engine.add_request(request)
    outputs: dict[str, list[int]] = {}
    beside = 0
    while engine.has_unfinished():
        moved = engine.resident.stats.moved_in
        step = engine.step()
        if engine._round is not None:
            assert engine.resident.stats.moved_in == moved  # none moved while a round runs
            beside += bool(engine.resident)
        counts = Counter(output.request_id for output in step)  # one output per token
        assert all(n == 1 for n in counts.values())  # a round's tokens one step at a time
        for output in step:
            outputs.setdefault(output.request_id, []).extend(output.token_ids)
    assert outputs == pooled
    assert rounds and max(rounds) == 4 and beside > 0
    assert engine.resident.stats.moved_in == 3 and not engine.resident
    engine.block_manager.check_consistency()
    assert engine.block_manager.num_free_pages == engine.block_manager.num_pages


def test_the_lane_frees_the_requests_pool_pages_and_counts_it_as_running(tiny_model, prompts):
    engine = make_engine(tiny_model, **LANE)
    engine.add_request(GenerateRequest("long", prompts[2], greedy(MAX_TOKENS)))
    while not engine.resident:
        engine.step()
    seq = engine.trackers["long"].seq
    assert seq.status is SequenceStatus.RESIDENT and seq.block_table == []
    stats = engine.stats()
    assert stats.num_running == stats.num_sparse_resident == 1
    assert stats.num_free_pages == engine.block_manager.num_pages
    session = engine.resident.session_of(seq)
    assert session.budget_pages == 10 and session.max_pages == 40
    output = engine.abort("long")
    assert output.finished and seq.status is SequenceStatus.FINISHED and not engine.has_unfinished()


def test_sampled_logprob_and_penalized_requests_sample_from_the_same_logits(tiny_model, prompts):
    """Requests that are not plain greedy decode eagerly and go through the engine's sampler."""

    def sampling(i: int) -> SamplingParams:
        return [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=7, ignore_eos=True),
                SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=True, top_logprobs=2,
                               ignore_eos=True),
                SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, repetition_penalty=1.3,
                               ignore_eos=True)][i]

    want = run_to_completion(make_engine(tiny_model, max_model_len=640), requests(prompts, sampling))
    engine = make_engine(tiny_model, **{**LANE, "sparse_residency_sessions": 3})
    got = run_to_completion(engine, requests(prompts, sampling))
    assert got == want
    assert engine.resident.stats.moved_in == 3 and engine.resident.stats.graph_steps == 0


def test_a_finished_requests_host_tier_is_reused_and_the_tokens_stay(tiny_model, prompts, pooled):
    engine = make_engine(tiny_model, **{**LANE, "sparse_residency_sessions": 1})
    lane = engine.resident
    got: dict[str, list[int]] = {}
    for request in requests(prompts, lambda i: greedy(MAX_TOKENS)):  # one after the other
        engine.add_request(request)
        collect(engine, got)
    assert got == pooled
    # sessions of 300 and 420 tokens (+24) hold 32 pages, of 560 the lane's 40: the second takes over
    # the first one's session (device memory, host tier and graph), the third allocates its own
    assert lane.stats.moved_in == 3 and lane.stats.host_tiers_allocated == 2 and len(lane._free_hosts) == 1
    assert lane.stats.sessions_reused == 1 and len(lane._free_sessions) == 1
    assert lane._free_sessions[0][0].max_pages == 40
    # the other way round, a larger kept tier serves the smaller sessions: one tier in all
    engine = make_engine(tiny_model, **{**LANE, "sparse_residency_sessions": 1})
    got = {}
    for request in reversed(requests(prompts, lambda i: greedy(MAX_TOKENS))):
        engine.add_request(request)
        collect(engine, got)
    assert got == pooled and engine.resident.stats.moved_in == 3
    assert engine.resident.stats.host_tiers_allocated == 1 and engine.resident.stats.sessions_reused == 1


def test_a_kept_session_is_given_up_for_a_member_and_its_graph_follows_the_next_one(tiny_model, prompts,
                                                                                    pooled):
    """Kept sessions and members together stay within the lane's reservation (max_sessions): a
    kept one is given up (its host tier kept) when a new member of another size needs room; a
    session taken over keeps its graph, which steps the new request from its first token."""
    engine = make_engine(tiny_model, **LANE)
    lane = engine.resident
    got: dict[str, list[int]] = {}
    reqs = requests(prompts, lambda i: greedy(MAX_TOKENS))
    engine.add_request(reqs[0])
    collect(engine, got)
    (session, graph), = lane._free_sessions
    engine.add_request(reqs[2])  # 40 pages: allocates (room for one more beside the kept one)
    collect(engine, got)
    assert len(lane._free_sessions) == 2 and lane.stats.host_tiers_allocated == 2
    engine.add_request(reqs[1])  # 32 pages: takes over r0's session and graph
    steps = graph.steps
    collect(engine, got)
    assert got == pooled and lane.stats.sessions_reused == 1 and session.generation == 1
    assert graph.steps > steps + MAX_TOKENS // 2
    assert len(lane._free_sessions) == 2
    # a member of a third size: a kept session is given up for it, its host tier taken
    lane.max_sessions = 2
    seq_pages = lane.session_pages
    lane.session_pages = lambda seq: 36
    engine.add_request(GenerateRequest("r3", prompts[1], greedy(MAX_TOKENS)))
    collect(engine, got)
    lane.session_pages = seq_pages
    assert got["r3"] == pooled["r1"] and lane.stats.host_tiers_allocated == 2
    kept = [s.max_pages for s, _ in lane._free_sessions]
    assert kept == [32, 36] and not lane._free_hosts  # r2's session given up, its 40-page tier r3's


def test_requests_below_the_threshold_stay_in_the_pool(tiny_model, prompts, pooled):
    engine = make_engine(tiny_model, **{**LANE, "sparse_residency_min_tokens": 600})
    assert run_to_completion(engine, requests(prompts, lambda i: greedy(MAX_TOKENS))) == pooled
    assert engine.resident.stats.moved_in == 0


@pytest.mark.parametrize("kind", ["msa", "m3"])
def test_layers_that_attend_densely_keep_their_kv_and_the_tokens_stay(kind):
    """A layer without an index branch reads every page: a moved request keeps all of its K/V on the
    device (written at the logical slot), while its MSA layers decode from a working set. msa: the
    tiny preset with layer 0 dense; m3: the tiny MiniMax-M3 (layer 1 full_attention, MoE MLPs)."""
    if kind == "m3":
        model, dense, vocab = random_m3(seed=0), (1,), 250
    else:
        config = get_preset("tiny").model_copy(update={"dense_layers": (0,)})
        model, dense, vocab = init_random_weights(MSATransformer(config, "naive"), seed=0).eval(), (0,), 512
    prompts = [random_prompt(n, seed=20 + i, vocab=vocab) for i, n in enumerate(LENGTHS[:2])]
    sampling = lambda i: greedy(MAX_TOKENS)  # noqa: E731
    want = run_to_completion(make_engine(model, max_model_len=640), requests(prompts, sampling))
    engine = make_engine(model, **LANE)
    got = run_to_completion(engine, requests(prompts, sampling))
    assert got == want
    lane = engine.resident
    assert lane.dense_layers == dense and lane.stats.moved_in == 2
    assert lane.stats.pages_fetched > 0 and lane.stats.evictions > 0


def test_a_session_with_a_dense_layer_holds_that_layers_pages_whole(tiny_model):
    config = get_preset("tiny").model_copy(update={"dense_layers": (1,)})
    session = ResidentSession(config, max_pages=40, budget_pages=10,
                              host=HostKV(2, 40, (16, 2, 16), torch.float32, pin=False),
                              device=torch.device("cpu"), dtype=torch.float32)
    assert session.dense_layers == (1,) and session.sparse_layers == (0,)
    assert session.caches[0].k_cache.shape[0] == 10 and session.caches[1].k_cache.shape[0] == 40
    assert session.caches[1].index_cache.shape[0] == 40 and not session.can_speculate


def test_a_model_that_cannot_decode_sparse_resident_is_refused_with_the_field():
    dense = init_random_weights(MSATransformer(get_preset("tiny"), "dense"), seed=0).eval()
    with pytest.raises(ValueError, match=r"sparse_residency_sessions=1 is invalid here: .*'dense'"):
        LLMEngine(EngineConfig(model="tiny", num_pages=64, attention_backend="dense",
                               sparse_residency_sessions=1), model=dense)
    config = get_preset("tiny").model_copy(update={"dense_layers": (0, 1)})
    every = init_random_weights(MSATransformer(config, "naive"), seed=0).eval()
    with pytest.raises(ValueError, match=r"every layer of the model attends densely"):
        LLMEngine(EngineConfig(model="tiny", num_pages=64, attention_backend="naive",
                               sparse_residency_sessions=1), model=every)


@pytest.mark.parametrize("field, value", [
    ("sparse_residency_sessions", -1), ("sparse_residency_min_tokens", 0), ("sparse_residency_budget", 0.0),
    ("sparse_residency_budget", 1.5)])
def test_bad_lane_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"EngineConfig.{field}={value!r} is invalid: allowed"):
        EngineConfig(**{field: value})


def test_a_multi_rank_replica_is_refused_a_lane():
    with pytest.raises(ValueError, match=r"sparse_residency_sessions=2 is invalid with 4 ranks per replica"):
        EngineConfig(sparse_residency_sessions=2, tensor_parallel_size=2, expert_parallel_size=2)


def test_lane_benchmark_runs_and_reports_equal_tokens(tmp_path):
    """benchmarks/kvcache/resident_lane.py at a small size: every key written from runs whose tokens
    equal the pool's: every request moved, and both stored sessions adopted into the lane."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "lane.json"
    script = root / "benchmarks" / "kvcache" / "resident_lane.py"
    subprocess.run([sys.executable, str(script), "--context", "384", "--requests", "2", "--max-tokens", "6",
                    "--layers", "2", "--chunk", "128", "--output", str(out)],
                   check=True, cwd=root, capture_output=True, timeout=600)
    results = json.loads(out.read_text())
    run = results["resident_lane"]
    assert run["tokens_equal"] and run["lane"]["lane"]["moved_in"] == 2 and run["lane"]["most_decoding"] == 2
    assert run["pool"]["most_decoding"] == 1
    for key in ("kvcache.resident_lane_request_bytes_ratio_cpu", "kvcache.resident_lane_total_speedup_cpu"):
        assert results[key]["value"] > 0 and "tokens equal: True" in results[key]["note"], key
    assert results["kvcache.resident_lane_request_bytes_ratio_cpu"]["value"] > 1
    adopt = results["resident_lane_adopt"]
    assert adopt["tokens_equal"] and adopt["lane_stats"]["adopted"] == 2
    key = results["kvcache.engine_lane_adopt_vs_reprefill_cpu"]
    assert key["value"] == pytest.approx(adopt["reprefill"]["ttft_s"] / adopt["lane_adopt"]["ttft_s"])


@pytest.mark.parametrize("kind", ["msa", "m3"])
def test_a_session_persisted_from_the_lane_stores_the_pools_bytes(tiny_model, prompts, kind):
    """A request with a session_id keeps persisting from the lane (its K/V from the host tier, the
    page being written from its ring slot, its index from the session): every stored page, tail
    included, holds exactly the bytes the pool would have stored. m3: the tiny MiniMax-M3, whose
    full_attention layer exports the zero index a pool's page of it holds."""
    import numpy as np

    from msaserve.engine.kv.pages import identity_for
    from msaserve.kvcache.client import KVCacheClient
    from msaserve.kvcache.config import ServiceConfig

    model = random_m3(seed=0) if kind == "m3" else tiny_model
    prompt = prompts[1] if kind == "msa" else random_prompt(LENGTHS[1], seed=30, vocab=250)
    records = {}
    for lane in (False, True):
        client = KVCacheClient.in_process(ServiceConfig(num_shards=2, memory_bytes=64 << 20),
                                          identity_for(model.config, "lane-test", torch.float32))
        settings = LANE if lane else dict(max_model_len=640)
        config = EngineConfig(model="tiny", num_pages=128, max_num_seqs=8, max_num_batched_tokens=64,
                              **settings)
        engine = LLMEngine(config, model=model, kv_client=client)
        engine.sessions.sync_every = 5
        # 420 + 27 tokens: the last sync stores 28 full pages and a tail of 14 tokens
        request = GenerateRequest("r", prompt, greedy(MAX_TOKENS + 3), session_id="s")
        out = run_to_completion(engine, [request])
        assert engine.resident is None or engine.resident.stats.moved_in == 1
        record = client.get_session("s")
        layers = range(model.config.num_layers)
        keys = [*record.page_hashes, record.tail_hash]
        kv = client.get_kv([(h, layer) for h in keys for layer in layers])
        index = client.get_index(keys)
        records[lane] = (out["r"], record.token_ids, keys, record.tail_tokens,
                         [bytes(np.asarray(p)) for p in kv], [bytes(np.asarray(p)) for p in index])
    pool, lane = records[False], records[True]
    assert lane[0] == pool[0] and lane[1] == pool[1] and lane[3] == pool[3] == 14
    assert lane[2][:-1] == pool[2][:-1]  # the full pages' hashes (the tail's key names its writer)
    assert lane[4] == pool[4] and lane[5] == pool[5]


def stored_session(model, prompt, max_tokens: int):
    """A KV cache service holding session "s" after a first turn of `prompt` on a pool-only engine
    → (client, the turn's tokens)."""
    from msaserve.engine.kv.pages import identity_for
    from msaserve.kvcache.client import KVCacheClient
    from msaserve.kvcache.config import ServiceConfig

    client = KVCacheClient.in_process(ServiceConfig(num_shards=2, memory_bytes=64 << 20),
                                      identity_for(model.config, "lane-test", torch.float32))
    first = LLMEngine(EngineConfig(model="tiny", num_pages=128, max_num_batched_tokens=64, max_model_len=640),
                      model=model, kv_client=client)
    out = run_to_completion(first, [GenerateRequest("t1", prompt, greedy(max_tokens), session_id="s")])
    return client, out["t1"]


@pytest.mark.parametrize("kind", ["msa", "m3"])
def test_a_stored_session_of_a_model_with_dense_layers_is_adopted_into_the_lane(tiny_model, prompts, kind):
    """The tiny M3's full_attention layer (and a tiny MSA model's dense layer) get all of their stored
    K/V at the adoption, on the device; the MSA layers theirs as selected. Tokens equal a run from
    scratch, and the background reads never ask for the dense layer's pages."""
    if kind == "m3":
        model, dense, prompt = random_m3(seed=0), 1, random_prompt(LENGTHS[1], seed=31, vocab=250)
    else:
        config = get_preset("tiny").model_copy(update={"dense_layers": (0,)})
        model = init_random_weights(MSATransformer(config, "naive"), seed=0).eval()
        dense, prompt = 0, prompts[1]
    client, turn = stored_session(model, prompt, 8)
    follow_up = [*prompt, *turn, 7, 8, 9]
    want = run_to_completion(make_engine(model, max_model_len=640),
                             [GenerateRequest("t2", follow_up, greedy(MAX_TOKENS))])
    config = EngineConfig(model="tiny", num_pages=128, max_num_batched_tokens=64,
                          **{**LANE, "sparse_residency_min_tokens": 400})
    engine = LLMEngine(config, model=model, kv_client=client)
    engine.add_request(GenerateRequest("t2", follow_up, greedy(MAX_TOKENS), session_id="s"))
    lane = engine.resident
    assert lane.stats.adopted == 1
    session = lane.session_of(engine.trackers["t2"].seq)
    assert session.dense_layers == (dense,)
    # the dense layer's every stored page is on the device, at its logical page, as the service holds it
    from msaserve.engine.kv.pages import PageCodec

    record = client.get_session("s")
    stored = PageCodec(client.model).decode_kv(client.get_kv([(h, dense) for h in record.page_hashes]))
    assert torch.equal(session.pools[dense][: len(record.page_hashes)], stored)
    got = collect(engine)
    assert got == want
    assert lane.stats.catch_up_steps == 3
    reads = [item for kind_, items in session.host.service_log for item in items]
    assert reads and all(layer != dense for _, layer in reads)


@pytest.mark.parametrize("new_tokens, busy, where", [
    (5, False, "lane"),   # a few new tokens: caught up in the lane
    (100, False, "pool"),  # a long new turn that the pool can take: prefilled there
    (100, True, "lane"),   # ... that it cannot take now (its one slot busy): caught up in the lane
])
def test_a_stored_session_is_adopted_into_the_lane_or_the_pool(tiny_model, prompts, new_tokens, busy, where):
    prompt = prompts[1]
    client, turn = stored_session(tiny_model, prompt, 8)  # 427 tokens stored
    follow_up = [*prompt, *turn, *random_prompt(new_tokens, seed=99)]
    want = run_to_completion(make_engine(tiny_model, max_model_len=640),
                             [GenerateRequest("t2", follow_up, greedy(MAX_TOKENS))])
    config = EngineConfig(model="tiny", num_pages=128, max_num_batched_tokens=64, max_num_seqs=1,
                          **{**LANE, "sparse_residency_min_tokens": 400})
    engine = LLMEngine(config, model=tiny_model, kv_client=client)
    if busy:
        engine.add_request(GenerateRequest("other", prompts[0][:100], greedy(4)))
        engine.step()
    got = run_to_completion(engine, [GenerateRequest("t2", follow_up, greedy(MAX_TOKENS), session_id="s")])
    assert got["t2"] == want["t2"]
    lane = engine.resident
    assert engine.sessions.stats.adopted == 1
    # in the lane, each token after the stored ones but the last is a step that samples nothing
    assert lane.stats.adopted == (where == "lane")
    assert lane.stats.catch_up_steps == (new_tokens if where == "lane" else 0)


def test_a_lane_session_ending_at_its_first_step_releases_its_index_leases(tiny_model, prompts):
    """An adopted session's index leases are released from its second step on (off its first token);
    one that ends at its first step (here aborted) starts their releases when the lane lets it go."""
    client, turn = stored_session(tiny_model, prompts[1], 8)
    calls: list[str] = []
    submit = client.transport.submit

    def recording(shard, method, *args):
        calls.append(method)
        return submit(shard, method, *args)

    client.transport.submit = recording
    engine = LLMEngine(EngineConfig(model="tiny", num_pages=128, max_num_batched_tokens=64, **LANE),
                       model=tiny_model, kv_client=client)
    engine.add_request(GenerateRequest("t2", [*prompts[1], *turn, *random_prompt(20, seed=98)],
                                       greedy(MAX_TOKENS), session_id="s"))
    assert engine.resident.stats.adopted == 1 and "lease_index" in calls
    assert engine.step() == [] and "release_lease" not in calls  # the first step: leases held
    engine.abort("t2")
    assert calls.count("release_lease") == calls.count("lease_index"), calls


def test_a_lane_session_whose_pages_the_service_lost_is_recomputed(tiny_model, prompts):
    prompt = prompts[2]
    client, turn = stored_session(tiny_model, prompt, 4)
    follow_up = [*prompt, *turn]
    want = run_to_completion(make_engine(tiny_model, max_model_len=640),
                             [GenerateRequest("t2", follow_up, greedy(MAX_TOKENS))])
    engine = LLMEngine(EngineConfig(model="tiny", num_pages=128, max_num_batched_tokens=64, **LANE),
                       model=tiny_model, kv_client=client)
    engine.add_request(GenerateRequest("t2", follow_up, greedy(MAX_TOKENS), session_id="s"))
    assert engine.resident.stats.adopted == 1
    record = client.get_session("s")
    client.delete_pages(record.page_hashes[:-2])  # gone before the session reads its K/V
    got = collect(engine)
    assert got == want
    assert engine.resident.stats.lost == 1 and engine.sessions.stats.recomputed_after_loss == 1


def test_a_request_the_pool_would_preempt_moves_to_the_lane_instead(tiny_model, prompts, pooled):
    """A pool of 84 pages holds the three prompts (81 pages) but not their growth: the pool alone
    preempts; with a lane, the victims leave for it (whatever their length) and nothing is
    preempted. Tokens are the same."""
    alone = make_engine(tiny_model, num_pages=84, max_model_len=640)
    assert run_to_completion(alone, requests(prompts, lambda i: greedy(MAX_TOKENS))) == pooled
    assert alone.scheduler.num_preemptions > 0
    engine = make_engine(tiny_model, num_pages=84, **{**LANE, "sparse_residency_min_tokens": 100_000})
    assert run_to_completion(engine, requests(prompts, lambda i: greedy(MAX_TOKENS))) == pooled
    stats = engine.resident.stats
    assert engine.scheduler.num_preemptions == 0
    assert stats.moved_under_pressure == stats.moved_in > 0


def test_a_constrained_request_beside_a_free_one_in_the_lane(tiny_model, tiny_tokenizer, prompts):
    """The grammar's mask reaches the right row of the lane's logits: a schema-constrained sampled
    request and a free greedy one, both moved to the lane, give the pool's tokens, and the JSON holds."""
    import json

    import jsonschema

    from msaserve.engine.types import GrammarSpec

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    constrained = SamplingParams(max_tokens=40, temperature=1.0, seed=5,
                                 grammar=GrammarSpec("json_schema", json.dumps(schema)))

    def sampling(i: int) -> SamplingParams:
        return greedy(MAX_TOKENS) if i == 0 else constrained

    want = run_to_completion(make_engine(tiny_model, tiny_tokenizer, max_model_len=640),
                             requests(prompts[:2], sampling))
    engine = make_engine(tiny_model, tiny_tokenizer, **LANE)
    got = run_to_completion(engine, requests(prompts[:2], sampling))
    assert got == want and engine.resident.stats.moved_in == 2
    jsonschema.validate(json.loads(tiny_tokenizer.decode(got["r1"])), schema)


def test_an_adopted_lane_request_aborted_mid_catch_up_frees_its_session(tiny_model, prompts):
    client, turn = stored_session(tiny_model, prompts[1], 8)
    follow_up = [*prompts[1], *turn, *random_prompt(20, seed=98)]
    config = EngineConfig(model="tiny", num_pages=128, max_num_batched_tokens=64, **LANE)
    engine = LLMEngine(config, model=tiny_model, kv_client=client)
    engine.add_request(GenerateRequest("t2", follow_up, greedy(MAX_TOKENS), session_id="s"))
    lane = engine.resident
    assert lane.stats.adopted == 1
    for _ in range(3):
        assert engine.step() == []  # catching up: no token yet
    output = engine.abort("t2")
    assert output.finished and output.finish_reason == "abort"
    assert not lane and not engine.has_unfinished() and lane.stats.catch_up_steps == 3
    # the next session of the same size reuses the kept host tier, and decodes as from scratch
    follow_up[-1] = 5
    want = run_to_completion(make_engine(tiny_model, max_model_len=640),
                             [GenerateRequest("t3", follow_up, greedy(MAX_TOKENS))])
    got = run_to_completion(engine, [GenerateRequest("t3", follow_up, greedy(MAX_TOKENS), session_id="s")])
    assert got == want and lane.stats.adopted == 2 and lane.stats.host_tiers_allocated == 1


@pytest.mark.parametrize("kv_dtype, index_dtype", [("fp8", "auto"), ("auto", "fp8"), ("fp8", "fp8")])
def test_the_lane_with_fp8_caches_gives_the_pools_tokens(tiny_model, prompts, kv_dtype, index_dtype):
    """fp8 K/V (the host tier and working set in float8 too) and fp8 index keys with their scales."""
    dtypes = dict(kv_cache_dtype=kv_dtype, index_cache_dtype=index_dtype)
    want = run_to_completion(make_engine(tiny_model, max_model_len=640, **dtypes),
                             requests(prompts[:2], lambda i: greedy(MAX_TOKENS)))
    engine = make_engine(tiny_model, **LANE, **dtypes)
    assert run_to_completion(engine, requests(prompts[:2], lambda i: greedy(MAX_TOKENS))) == want
    assert engine.resident.stats.moved_in == 2 and engine.resident.stats.evictions > 0


def test_a_session_adopted_into_the_lane_persists_the_bytes_the_pool_would(tiny_model, prompts):
    """Adopted into the lane (pages before its write page never in its host tier), a session
    persists only what it wrote itself, from its write-backs: the stored pages and tail equal, byte for
    byte, what the same turn adopted into the pool stores."""
    import numpy as np

    stored = {}
    for lane in (False, True):
        client, turn = stored_session(tiny_model, prompts[2], 8)  # 567 tokens stored: a tail of 7
        settings = {**LANE, "sparse_residency_min_tokens": 400} if lane else dict(max_model_len=640)
        config = EngineConfig(model="tiny", num_pages=128, max_num_batched_tokens=64, **settings)
        engine = LLMEngine(config, model=tiny_model, kv_client=client)
        request = GenerateRequest("t2", [*prompts[2], *turn], greedy(MAX_TOKENS), session_id="s")
        out = run_to_completion(engine, [request])
        assert (engine.resident is not None and engine.resident.stats.adopted == 1) == lane
        record = client.get_session("s")
        keys = [*record.page_hashes, record.tail_hash]
        kv = client.get_kv([(h, layer) for h in keys for layer in range(tiny_model.config.num_layers)])
        stored[lane] = (out["t2"], record.token_ids, record.page_hashes, record.tail_tokens,
                        [bytes(np.asarray(p)) for p in kv],
                        [bytes(np.asarray(p)) for p in client.get_index(keys)])
    assert stored[True] == stored[False]
    assert len(stored[True][2]) == (560 + 8 + MAX_TOKENS - 1) // 16  # pages written in the lane too
