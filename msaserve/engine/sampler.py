"""Token choice from logits: greedy, or temperature → top-k → top-p, with per-request generators.

Each sampled request draws from its own `torch.Generator`, seeded from its `seed`, so the same
seed gives the same tokens whatever else shares the batch. Logprobs are of the model's own
distribution (log-softmax of the raw logits), as the OpenAI API reports them.
"""

from dataclasses import dataclass

import torch

from msaserve.engine.types import SamplingParams, TokenLogprob


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] fp32 (already divided by the temperature) → logits with the tokens outside the
    top-k and outside the smallest set of mass ≥ top_p set to -inf. The top token always stays."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits [V] fp32 → one token id."""
    if params.greedy:
        return int(torch.argmax(logits))
    filtered = filter_top_k_top_p(logits / params.temperature, params.top_k, params.top_p)
    probs = torch.softmax(filtered, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprobs(logprobs: torch.Tensor, token_ids: list[int], num_top: list[int]) -> list[TokenLogprob]:
    """logprobs [N, V] fp32 → each row's chosen token's logprob and its `num_top` best tokens."""
    chosen = logprobs.gather(1, torch.tensor(token_ids, device=logprobs.device)[:, None])[:, 0].tolist()
    width = max(num_top)
    top_values, top_ids = (torch.topk(logprobs, width) if width else (None, None))
    out = []
    for row, token in enumerate(token_ids):
        top: list[tuple[int, float]] = []
        if num_top[row]:
            ids = top_ids[row, : num_top[row]].tolist()
            values = top_values[row, : num_top[row]].tolist()
            top = list(zip(ids, values, strict=True))
        out.append(TokenLogprob(token, chosen[row], top))
    return out


class Sampler:
    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> SamplerOutput:
        """logits [N, V] fp32, one row per sequence → N token ids (and logprobs where asked)."""
        greedy = [i for i, p in enumerate(params) if p.greedy]
        token_ids = [0] * len(params)
        if len(greedy) == len(params) and not any(p.logprobs for p in params):
            return SamplerOutput(torch.argmax(logits, dim=-1).tolist(), [None] * len(params))
        if greedy:  # one argmax for all greedy rows
            index = torch.tensor(greedy, device=logits.device)
            for i, token in zip(greedy, torch.argmax(logits[index], dim=-1).tolist(), strict=True):
                token_ids[i] = token
        for i, p in enumerate(params):
            if not p.greedy:
                token_ids[i] = sample_row(logits[i], p, generators[i])
        logprobs: list[TokenLogprob | None] = [None] * len(params)
        wanted = [i for i, p in enumerate(params) if p.logprobs]
        if wanted:
            index = torch.tensor(wanted, device=logits.device)
            rows = torch.log_softmax(logits[index], dim=-1)
            computed = token_logprobs(
                rows, [token_ids[i] for i in wanted], [params[i].top_logprobs for i in wanted]
            )
            for i, value in zip(wanted, computed, strict=True):
                logprobs[i] = value
        return SamplerOutput(token_ids, logprobs)
