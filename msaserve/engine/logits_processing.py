"""Changes to a row's logits before sampling: OpenAI's penalties and logit_bias, the
repetition_penalty extension, and min_p.

Definitions (what tests check):
- frequency / presence (OpenAI): `logit[t] -= count_out[t] * frequency + (count_out[t] > 0) * presence`,
  over the output tokens only.
- repetition (CTRL / HF / vLLM): for every token in the prompt or the output, a positive logit is
  divided by the penalty and a negative one multiplied by it.
- logit_bias (OpenAI): the bias is added to the token's logit.
- min_p: after the temperature, tokens whose probability is below `min_p × p_max` are dropped.
"""

import torch

from msaserve.engine.types import SamplingParams


def penalize_row(logits: torch.Tensor, params: SamplingParams, token_ids: list[int], num_prompt: int
                 ) -> torch.Tensor:
    """logits [V] fp32, token_ids the prompt then the output so far → the processed logits (new tensor)."""
    logits = logits.clone()
    vocab = logits.shape[-1]
    if params.repetition_penalty != 1.0 and token_ids:
        seen = torch.unique(torch.tensor(token_ids, device=logits.device))
        values = logits[seen]
        penalty = params.repetition_penalty
        logits[seen] = torch.where(values > 0, values / penalty, values * penalty)
    output = token_ids[num_prompt:]
    if (params.frequency_penalty or params.presence_penalty) and output:
        counts = torch.bincount(torch.tensor(output, device=logits.device), minlength=vocab)[:vocab]
        counts = counts.to(logits.dtype)
        logits -= counts * params.frequency_penalty + (counts > 0).to(logits.dtype) * params.presence_penalty
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), device=logits.device)
        bias = torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype, device=logits.device)
        logits[ids] += bias
    return logits


def filter_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """logits [V] fp32 (after the temperature) → tokens with p < min_p × p_max set to -inf."""
    if min_p <= 0.0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
