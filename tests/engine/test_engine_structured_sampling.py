"""Sampling parity with OpenAI: presence / frequency penalties, logit_bias, min_p and the
repetition_penalty extension, checked against their definitions (msaserve.engine.logits_processing)."""

import pytest
import torch
from engine_helpers import make_engine, run_to_completion

from msaserve.engine.logits_processing import filter_min_p, penalize_row
from msaserve.engine.sampler import Sampler
from msaserve.engine.types import GenerateRequest, InvalidParameter, SamplingParams


def test_frequency_and_presence_follow_openai_definition():
    logits = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    # prompt [4, 4] is not counted; the output has token 1 twice and token 3 once
    out = penalize_row(logits, params, [4, 4, 1, 3, 1], num_prompt=2)
    expected = logits - torch.tensor([0.0, 2 * 0.5 + 0.25, 0.0, 0.5 + 0.25, 0.0])
    assert torch.allclose(out, expected)


def test_repetition_penalty_divides_positive_and_multiplies_negative_over_prompt_and_output():
    logits = torch.tensor([2.0, -2.0, 3.0, -1.0])
    out = penalize_row(logits, SamplingParams(repetition_penalty=2.0), [0, 1], num_prompt=1)
    assert torch.allclose(out, torch.tensor([1.0, -4.0, 3.0, -1.0]))


def test_logit_bias_and_min_p():
    logits = torch.tensor([0.0, 1.0, 2.0])
    assert torch.allclose(penalize_row(logits, SamplingParams(logit_bias={0: 5.0}), [], 0),
                          torch.tensor([5.0, 1.0, 2.0]))
    probs = torch.softmax(logits, -1)
    kept = torch.isfinite(filter_min_p(logits, 0.3))
    assert kept.tolist() == (probs >= 0.3 * probs.max()).tolist()


def test_sampler_logprobs_stay_the_models_own():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    params = [SamplingParams(temperature=0.0, logprobs=True, logit_bias={0: 100.0})]
    out = Sampler()(logits, params, [None], histories=[([], 0)])
    assert out.token_ids == [0]  # the bias wins the argmax
    assert out.logprobs[0].logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[0]))


def test_engine_applies_bias_and_penalties(tiny_model, tiny_tokenizer):
    engine = make_engine(tiny_model, tiny_tokenizer, decode_steps=4)
    prompt = list(range(10, 40))
    plain = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    biased = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logit_bias={77: 100.0})
    penalized = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, presence_penalty=2.0,
                               frequency_penalty=2.0, repetition_penalty=2.0)
    out = run_to_completion(engine, [GenerateRequest("plain", prompt, plain),
                                     GenerateRequest("biased", prompt, biased),
                                     GenerateRequest("penalized", prompt, penalized)])
    assert out["biased"] == [77] * 16
    assert len(set(out["penalized"])) > len(set(out["plain"]))


def test_logit_bias_token_outside_vocab_is_refused(tiny_model, tiny_tokenizer):
    engine = make_engine(tiny_model, tiny_tokenizer)
    bad = SamplingParams(logit_bias={10**6: 1.0})
    with pytest.raises(InvalidParameter, match="logit_bias"):
        engine.add_request(GenerateRequest("x", [5], bad))
    with pytest.raises(InvalidParameter, match="presence_penalty"):
        SamplingParams(presence_penalty=3.0).validate()
