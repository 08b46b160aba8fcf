"""Sampler and sampling parameters: filters, seeds, logprobs, and rejected parameters."""

import math

import pytest
import torch
from engine_helpers import make_engine, random_prompt, run_to_completion

from msaserve.engine.sampler import Sampler, filter_top_k_top_p
from msaserve.engine.types import GenerateRequest, InvalidParameter, SamplingParams


def test_top_k_and_top_p_keep_exactly_the_allowed_tokens():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    assert torch.isfinite(filter_top_k_top_p(logits, 2, 1.0)).tolist() == [True, True, False, False, False]
    # Mass before token i: 0, .5, .7, .85, .95 → top_p=0.7 keeps the first two (mass .7 reached).
    assert torch.isfinite(filter_top_k_top_p(logits, 0, 0.7)).tolist() == [True, True, False, False, False]
    assert torch.isfinite(filter_top_k_top_p(logits, 0, 0.71)).tolist() == [True, True, True, False, False]
    assert torch.isfinite(filter_top_k_top_p(logits, 0, 0.01)).sum() == 1


def test_sampled_tokens_follow_the_filtered_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 1e-9]]))
    params = SamplingParams(temperature=1.0, top_k=2)
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    for _ in range(2000):
        counts[Sampler()(logits, [params], [generator]).token_ids[0]] += 1
    assert counts[2] == counts[3] == 0
    assert counts[0] / 2000 == pytest.approx(0.5 / 0.8, abs=0.04)


def test_logprobs_are_of_the_model_distribution_with_top_alternatives():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    params = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2)
    out = Sampler()(logits, [params], [None])
    expected = torch.log_softmax(logits[0], dim=-1)
    assert out.token_ids == [0]
    lp = out.logprobs[0]
    assert lp.logprob == pytest.approx(float(expected[0]))
    assert [t for t, _ in lp.top] == [0, 1]
    assert lp.top[1][1] == pytest.approx(float(expected[1]))
    assert math.isclose(sum(math.exp(v) for v in expected.tolist()), 1.0, rel_tol=1e-6)


def test_same_seed_gives_the_same_tokens_whatever_the_batch(tiny_model):
    prompt = random_prompt(40, seed=7)
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = run_to_completion(make_engine(tiny_model), [GenerateRequest("a", prompt, params)])["a"]
    others = [
        GenerateRequest(f"o{i}", random_prompt(30 + i, seed=i), SamplingParams(max_tokens=16, seed=i))
        for i in range(3)
    ]
    batched = run_to_completion(make_engine(tiny_model), [*others, GenerateRequest("a", prompt, params)])
    assert batched["a"] == alone
    other_seed = SamplingParams(**{**params.__dict__, "seed": 99})
    changed = run_to_completion(make_engine(tiny_model), [GenerateRequest("a", prompt, other_seed)])
    assert changed["a"] != alone


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_tokens", 0), ("temperature", -0.1), ("temperature", float("nan")), ("top_p", 0.0),
     ("top_p", 1.5), ("top_k", -1), ("seed", -5), ("top_logprobs", 21), ("stop", [""])],
)
def test_bad_sampling_parameters_are_rejected_by_name(tiny_model, field, value):
    engine = make_engine(tiny_model)
    params = SamplingParams(**{field: value})
    with pytest.raises(InvalidParameter, match=field) as error:
        engine.add_request(GenerateRequest("r", [5, 6, 7], params))
    assert error.value.param == field
    assert not engine.has_unfinished()


def test_bad_prompts_are_rejected_by_name(tiny_model):
    from msaserve.engine.types import ContextTooLong

    engine = make_engine(tiny_model, max_model_len=100)
    with pytest.raises(InvalidParameter, match="prompt_token_ids"):
        engine.add_request(GenerateRequest("r", [], SamplingParams()))
    with pytest.raises(InvalidParameter, match="prompt_token_ids"):
        engine.add_request(GenerateRequest("r", [5, 100_000], SamplingParams()))
    with pytest.raises(ContextTooLong, match="100 tokens"):
        engine.add_request(GenerateRequest("r", [5] * 90, SamplingParams(max_tokens=11)))


def test_a_top_p_below_fp32_range_keeps_the_top_token() -> None:
    """top_p = 2.58e-205 (found by the API fuzz) rounds to 0 in fp32: every token was dropped, the
    softmax was NaN and the engine step failed with a 500."""
    logits = torch.tensor([0.5, 2.0, -1.0, 1.0])
    filtered = filter_top_k_top_p(logits, 0, 2.579109304857392e-205)
    assert torch.isfinite(filtered).tolist() == [False, True, False, False]
