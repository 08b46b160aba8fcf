"""Streaming text: incremental detokenization and stop strings held back until decided."""

import pytest
from engine_helpers import make_engine, random_prompt

from msaserve.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from msaserve.engine.types import GenerateRequest, SamplingParams


def stream(detokenizer: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detokenizer.add(i) for i in ids] + [detokenizer.flush()]


def test_multibyte_characters_are_released_whole(tiny_tokenizer):
    text = "héllo 世界, ok 🙂!"
    ids = tiny_tokenizer.encode(text)
    deltas = stream(IncrementalDetokenizer(tiny_tokenizer, tiny_tokenizer.encode("prompt: ")), ids)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    assert "世" in deltas  # released as soon as its third byte arrived


def test_stop_string_prefix_is_held_back_then_released_or_cut():
    matcher = StopStringMatcher(["STOP", "\n\n"])
    assert matcher.feed("abc S") == ("abc ", False)  # "S" may start "STOP"
    assert matcher.feed("T") == ("", False)
    assert matcher.feed("x") == ("STx", False)  # cannot be STOP any more
    assert matcher.feed("y\n") == ("y", False)
    assert matcher.feed("\nzzz") == ("", True)  # "\n\n" completes: nothing after it
    assert matcher.text[: matcher.released] == "abc STxy"


def test_earliest_stop_string_wins_and_flush_returns_the_held_text():
    matcher = StopStringMatcher(["bc", "abcd"])
    assert matcher.feed("xabcd") == ("x", True)  # "abcd" starts before "bc"
    held = StopStringMatcher(["END"])
    assert held.feed("the EN") == ("the ", False)
    assert held.flush() == "EN"


def test_engine_stops_at_a_stop_string_and_never_streams_it(tiny_model, tiny_tokenizer):
    prompt = random_prompt(30, seed=3, vocab=259)
    params = dict(max_tokens=40, temperature=0.0, ignore_eos=True)
    engine = make_engine(tiny_model, tiny_tokenizer)
    engine.add_request(GenerateRequest("free", prompt, SamplingParams(**params)))
    full = "".join(o.text for o in _drain(engine))
    assert len(full) >= 8, "the tiny model produced too little text for this test"
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    engine.add_request(GenerateRequest("cut", prompt, SamplingParams(**params, stop=[stop])))
    outputs = _drain(engine)
    streamed = "".join(o.text for o in outputs)
    assert streamed == full[: full.index(stop)]
    assert outputs[-1].finish_reason == "stop"
    assert stop not in streamed


def test_eos_token_ends_the_request_without_its_text(tiny_model, tiny_tokenizer):
    engine = make_engine(tiny_model, tiny_tokenizer)
    prompt = random_prompt(20, seed=4, vocab=259)
    engine.add_request(GenerateRequest("a", prompt, SamplingParams(max_tokens=6, temperature=0.0)))
    first = [t for o in _drain(engine) for t in o.token_ids]
    stop_id = first[2]
    engine.add_request(
        GenerateRequest("b", prompt, SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=[stop_id]))
    )
    outputs = _drain(engine)
    assert [t for o in outputs for t in o.token_ids] == first[: first.index(stop_id) + 1]
    assert outputs[-1].finish_reason == "stop"
    assert outputs[-1].stats.num_output_tokens == first.index(stop_id) + 1


@pytest.mark.parametrize("max_tokens", [1, 5])
def test_length_finish_reports_stats(tiny_model, tiny_tokenizer, max_tokens):
    engine = make_engine(tiny_model, tiny_tokenizer)
    engine.add_request(GenerateRequest("a", random_prompt(70, seed=5), SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True)))
    outputs = _drain(engine)
    last = outputs[-1]
    assert last.finished and last.finish_reason == "length" and len(outputs) == max_tokens
    assert last.stats.num_prompt_tokens == 70 and last.stats.num_output_tokens == max_tokens
    assert last.stats.ttft_s > 0 and last.stats.num_pages == 5
    assert (last.stats.tpot_s is None) == (max_tokens == 1)


def _drain(engine):
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    return outputs
