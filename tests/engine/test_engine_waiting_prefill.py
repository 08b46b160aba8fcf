"""The engine reports the prefill still ahead of a new request (`EngineStats.waiting_prefill_pages`),
which the router prices as queued work; without it the router guessed waiting × mean miss size and
did not see the rest of running prefills (issue 29)."""

from engine_helpers import greedy, make_engine, random_prompt

from msaserve.engine.types import GenerateRequest

P = 16  # the tiny preset's page size


def test_waiting_prefill_pages_count_queued_prompts_and_running_prefill_rests(tiny_model):
    engine = make_engine(tiny_model, max_num_batched_tokens=64)
    assert engine.stats().waiting_prefill_pages == 0
    for i, length in enumerate((100, 40, 9)):
        engine.add_request(GenerateRequest(f"r{i}", random_prompt(length, seed=i), greedy(3)))
    assert engine.stats().waiting_prefill_pages == -(-149 // P)  # all three wait: 149 tokens
    engine.step()  # 64 tokens of r0 computed; r1 and r2 wait
    stats = engine.stats()
    assert stats.num_running == 1 and stats.num_waiting == 2
    assert stats.waiting_prefill_pages == -(-(149 - 64) // P)
    engine.step()  # r0's last 36 tokens and 28 of r1
    assert engine.stats().waiting_prefill_pages == -(-(149 - 128) // P)
    while engine.has_unfinished():
        engine.step()
    assert engine.stats().waiting_prefill_pages == 0


def test_a_decoding_sequence_is_not_prefill(tiny_model):
    engine = make_engine(tiny_model, max_num_batched_tokens=64)
    engine.add_request(GenerateRequest("r0", random_prompt(20, seed=5), greedy(8)))
    engine.step()  # prefilled in one step; decoding from now on
    engine.step()
    stats = engine.stats()
    assert stats.num_running == 1 and stats.waiting_prefill_pages == 0
