"""Greedy tokens do not depend on how the engine gets them (docs/design.md §2, property 2): chunk size,
batch composition, prefix-cache hit or miss, preemption by swap or by recompute. Prompts are
longer than K·P = 64 tokens of the tiny preset, so the MSA selection is really sparse."""

from collections import Counter

import pytest
import reference_decode
import torch
from engine_helpers import collect, greedy, make_engine, random_prompt, run_to_completion

from msaserve.engine.config import EngineConfig
from msaserve.engine.types import GenerateRequest, SamplingParams

LENGTHS = [150, 71, 97, 20, 130, 66]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return [random_prompt(n, seed=i) for i, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def expected(tiny_model, prompts) -> list[list[int]]:
    """The single-sequence reference decoder, prompt in one chunk."""
    return [reference_decode.generate(tiny_model, p, MAX_TOKENS) for p in prompts]


def requests(prompts: list[list[int]], prefix: str = "r") -> list[GenerateRequest]:
    return [GenerateRequest(f"{prefix}{i}", p, greedy(MAX_TOKENS)) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("budget", [5, 16, 33, 1024])
def test_any_chunk_size_gives_the_reference_tokens(tiny_model, prompts, expected, budget):
    engine = make_engine(tiny_model, max_num_batched_tokens=budget, max_num_seqs=1)
    outputs = run_to_completion(engine, requests(prompts[:3]))
    assert [outputs[f"r{i}"] for i in range(3)] == expected[:3]


def test_batched_requests_match_each_run_alone(tiny_model, prompts, expected):
    engine = make_engine(tiny_model, max_num_batched_tokens=48, max_num_seqs=6)
    outputs = run_to_completion(engine, requests(prompts))
    assert [outputs[f"r{i}"] for i in range(len(prompts))] == expected


def test_requests_joining_a_running_batch_match(tiny_model, prompts, expected):
    engine = make_engine(tiny_model, max_num_batched_tokens=40)
    reqs = requests(prompts)
    outputs: dict[str, list[int]] = {}
    for request in reqs:  # one new request per step while earlier ones decode
        engine.add_request(request)
        for output in engine.step():
            outputs.setdefault(output.request_id, []).extend(output.token_ids)
    while engine.has_unfinished():
        for output in engine.step():
            outputs.setdefault(output.request_id, []).extend(output.token_ids)
    assert [outputs[f"r{i}"] for i in range(len(prompts))] == expected


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_prefix_cache_hit_or_miss_gives_the_same_tokens(tiny_model, prefix_caching):
    shared = random_prompt(96, seed=100)
    first, second = shared + random_prompt(9, seed=101), shared + random_prompt(23, seed=102)
    want = [reference_decode.generate(tiny_model, p, MAX_TOKENS) for p in (first, second)]
    engine = make_engine(tiny_model, enable_prefix_caching=prefix_caching)
    got_first = run_to_completion(engine, [GenerateRequest("a", first, greedy(MAX_TOKENS))])["a"]
    engine.add_request(GenerateRequest("b", second, greedy(MAX_TOKENS)))
    got_second = []
    stats = None
    while engine.has_unfinished():
        for output in engine.step():
            got_second += output.token_ids
            stats = output.stats or stats
    assert [got_first, got_second] == want
    assert stats.num_cached_tokens == (96 if prefix_caching else 0)


@pytest.mark.parametrize("swap_space_bytes", [1 << 30, 0], ids=["swap", "recompute"])
def test_preemption_and_resume_give_the_same_tokens(tiny_model, swap_space_bytes):
    # Four 80-token prompts fill 4 × 5 of the 21 pages; their first decode steps need a sixth
    # page each, so the newest sequences are preempted and resumed.
    prompts = [random_prompt(80, seed=200 + i) for i in range(4)]
    want = [reference_decode.generate(tiny_model, p, MAX_TOKENS) for p in prompts]
    engine = make_engine(
        tiny_model, num_pages=21, max_num_batched_tokens=400, swap_space_bytes=swap_space_bytes
    )
    outputs = run_to_completion(engine, requests(prompts))
    assert engine.scheduler.num_preemptions > 0
    assert [outputs[f"r{i}"] for i in range(len(prompts))] == want
    assert engine.block_manager.num_free_pages == 21
    assert len(engine.swapper.store) == 0


def test_fp8_caches_survive_swapping_unchanged(tiny_model):
    """fp8 K/V and index pages: swapped out and back, they give the tokens of an unpreempted run."""
    prompts = [random_prompt(80, seed=300 + i) for i in range(4)]
    fp8 = dict(kv_cache_dtype="fp8", index_cache_dtype="fp8", max_num_batched_tokens=400)
    roomy = make_engine(tiny_model, num_pages=64, **fp8)
    cache = roomy.runner.caches[0]
    assert cache.k_cache.dtype == cache.index_cache.dtype == torch.float8_e4m3fn
    want = run_to_completion(roomy, requests(prompts))
    tight = make_engine(tiny_model, num_pages=21, **fp8)
    got = run_to_completion(tight, requests(prompts))
    assert tight.scheduler.num_preemptions > 0 and roomy.scheduler.num_preemptions == 0
    assert got == want


@pytest.mark.parametrize("decode_steps", [2, 5, 64])
def test_decode_rounds_give_the_reference_tokens(tiny_model, prompts, expected, decode_steps):
    """Several decode steps per scheduling round (tokens fed back on the device): the same greedy
    tokens, rounds cut short by max_tokens, joins between rounds, and every page free after."""
    engine = make_engine(tiny_model, max_num_batched_tokens=48, decode_steps=decode_steps)
    reqs = requests(prompts)
    rounds = []
    original = engine.runner.execute_decode_round

    def counted(batch, steps):
        rounds.append(steps)
        return original(batch, steps)

    engine.runner.execute_decode_round = counted
    outputs: dict[str, list[int]] = {}
    for request in reqs[:3]:
        engine.add_request(request)
    for request in reqs[3:]:  # the others join while the first ones decode
        for output in engine.step():
            outputs.setdefault(output.request_id, []).extend(output.token_ids)
        engine.add_request(request)
    while engine.has_unfinished():
        for output in engine.step():
            outputs.setdefault(output.request_id, []).extend(output.token_ids)
    assert [outputs[f"r{i}"] for i in range(len(prompts))] == expected
    assert rounds and 1 < max(rounds) <= decode_steps
    assert engine.block_manager.num_free_pages == engine.block_manager.num_pages
    engine.block_manager.check_consistency()


def test_a_stop_token_inside_a_round_ends_the_request_there(tiny_model, prompts, expected):
    """A request whose stop token comes mid-round gets exactly the tokens up to it (the round's
    later tokens are dropped) and its pages back; the others in the round are unaffected."""
    stop_at = expected[0][5]
    stop = expected[0].index(stop_at)  # its first occurrence ends the request
    engine = make_engine(tiny_model, max_num_batched_tokens=1024, decode_steps=8)
    rounds = []
    original = engine.runner.execute_decode_round
    engine.runner.execute_decode_round = lambda batch, steps: rounds.append(steps) or original(batch, steps)
    engine.add_request(GenerateRequest("r0", prompts[0], SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_at])))
    engine.add_request(GenerateRequest("r1", prompts[1], greedy(MAX_TOKENS)))
    outputs = collect(engine)
    assert outputs["r0"] == expected[0][: stop + 1] and outputs["r1"] == expected[1]
    assert rounds[0] == 8 and 1 <= stop <= 5  # both prefilled in one step; the stop falls in round 1
    assert engine.block_manager.num_free_pages == engine.block_manager.num_pages


def test_a_round_hands_out_one_token_per_request_per_step(tiny_model, prompts, expected):
    """A decode round streams: each `step()` while it runs gives every request one token (its
    step's), not the round's tokens in one burst; a request added meanwhile waits for the round's
    end and then gets its reference tokens too."""
    engine = make_engine(tiny_model, max_num_batched_tokens=1024, decode_steps=8)
    rounds = []
    original = engine.runner.execute_decode_round
    engine.runner.execute_decode_round = lambda batch, steps: rounds.append(steps) or original(batch, steps)
    for request in requests(prompts[:2]):
        engine.add_request(request)
    outputs: dict[str, list[int]] = {}
    per_step = []
    while engine.has_unfinished():
        step = engine.step()  # one output per token: a burst would be several outputs of one request
        per_step.append(Counter(o.request_id for o in step))
        for output in step:
            outputs.setdefault(output.request_id, []).extend(output.token_ids)
        if len(per_step) == 3:  # inside the first round: joins at its end
            engine.add_request(GenerateRequest("late", prompts[2], greedy(MAX_TOKENS)))
            assert engine._round is not None and rounds == [8]
    assert all(n == 1 for step in per_step for n in step.values())
    assert [outputs["r0"], outputs["r1"], outputs["late"]] == expected[:3]
    assert per_step[1] == {"r0": 1, "r1": 1} and not any(step["late"] for step in per_step[:8])
    assert engine.block_manager.num_free_pages == engine.block_manager.num_pages


def test_a_request_aborted_inside_a_round_gets_no_more_tokens(tiny_model, prompts, expected):
    """Aborted while its round runs: no token of the round's later steps reaches it, its pages
    come back, and the others in the round keep their reference tokens."""
    engine = make_engine(tiny_model, max_num_batched_tokens=1024, decode_steps=8)
    for request in requests(prompts[:2]):
        engine.add_request(request)
    outputs: dict[str, list[int]] = {}
    aborted = None
    while engine.has_unfinished():
        for output in engine.step():
            outputs.setdefault(output.request_id, []).extend(output.token_ids)
        if aborted is None and len(outputs.get("r0", ())) == 3:
            assert engine._round is not None
            aborted = engine.abort("r0")
    assert aborted is not None and aborted.finished and aborted.finish_reason == "abort"
    assert outputs["r0"] == expected[0][:3] and outputs["r1"] == expected[1]
    assert engine.block_manager.num_free_pages == engine.block_manager.num_pages
    engine.block_manager.check_consistency()


def test_decode_steps_is_checked():
    with pytest.raises(ValueError, match="decode_steps=0 is invalid: allowed an integer from 1 to 64"):
        EngineConfig(decode_steps=0)
