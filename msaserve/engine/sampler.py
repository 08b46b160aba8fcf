"""Token choice from logits: penalties, logit_bias and the grammar mask first
(`logits_processing`, `structured.bitmask`), then greedy, or temperature → min-p → top-k → top-p,
with per-request generators.

Each sampled request draws from its own `torch.Generator`, seeded from its `seed`, so the same
seed gives the same tokens whatever else shares the batch. Logprobs are of the model's own
distribution (log-softmax of the raw logits), as the OpenAI API reports them.
"""

from dataclasses import dataclass

import torch

from msaserve.engine.logits_processing import filter_min_p, penalize_row
from msaserve.engine.structured.bitmask import apply_bitmask
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
        drop_sorted[0] = False  # a top_p below fp32's range (1e-300) rounds to 0 and would drop it too
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits [V] fp32 → one token id."""
    if params.greedy:
        return int(torch.argmax(logits))
    scaled = filter_min_p(logits / params.temperature, params.min_p)
    filtered = filter_top_k_top_p(scaled, params.top_k, params.top_p)
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


@dataclass
class GrammarMask:
    """The step's token bitmask (`structured.bitmask`): int32 [len(rows), W] for the listed rows."""

    bitmask: torch.Tensor
    rows: list[int]


def process_logits(
    logits: torch.Tensor,
    params: list[SamplingParams],
    histories: list[tuple[list[int], int]] | None,
    mask: GrammarMask | None,
) -> torch.Tensor:
    """logits [N, V] → the logits sampling sees: penalties and bias per row, then the grammar mask.
    histories[i] is row i's (prompt + output token ids, prompt length). Unchanged rows are shared."""
    rows = [i for i, p in enumerate(params) if p.penalized]
    if not rows and (mask is None or not mask.rows):
        return logits
    logits = logits.clone()
    for i in rows:
        if histories is None:
            raise ValueError("penalties and logit_bias need each row's token history")
        token_ids, num_prompt = histories[i]
        logits[i] = penalize_row(logits[i], params[i], token_ids, num_prompt)
    if mask is not None:
        apply_bitmask(logits, mask.bitmask, mask.rows)
    return logits


class Sampler:
    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        histories: list[tuple[list[int], int]] | None = None,
        mask: GrammarMask | None = None,
    ) -> SamplerOutput:
        """logits [N, V] fp32, one row per sequence → N token ids (and logprobs where asked).
        Logprobs are of the raw logits (the model's distribution), as OpenAI reports them."""
        raw = logits
        logits = process_logits(logits, params, histories, mask)
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
            rows = torch.log_softmax(raw[index], dim=-1)
            computed = token_logprobs(
                rows, [token_ids[i] for i in wanted], [params[i].top_logprobs for i in wanted]
            )
            for i, value in zip(wanted, computed, strict=True):
                logprobs[i] = value
        return SamplerOutput(token_ids, logprobs)
