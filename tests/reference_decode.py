"""Single-sequence reference decoding: the invariant baseline the tests (and two benchmarks) compare against.

One sequence, a contiguous identity block table (logical page i = physical page i), optional
chunked prefill, then one token per decode step. No batching, no scheduler.
"""

from collections.abc import Callable, Iterable

import torch

from msaserve.models.cache import LayerKVCache, allocate_caches
from msaserve.models.metadata import AttentionMetadata
from msaserve.models.transformer import MSATransformer


def step_metadata(start: int, num_tokens: int, max_pages: int, page_size: int, decode: bool,
                  device: torch.device) -> AttentionMetadata:
    """Metadata for tokens start..start+num_tokens-1 of the one sequence."""
    positions = torch.arange(start, start + num_tokens, device=device)
    return AttentionMetadata(
        positions=positions,
        slot_mapping=positions.clone(),  # identity block table: slot = position
        block_tables=torch.arange(max_pages, device=device, dtype=torch.int32)[None, :],
        seq_lens=torch.tensor([start + num_tokens], device=device, dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, num_tokens], device=device, dtype=torch.int32),
        max_query_len=num_tokens,
        decode_query_len=num_tokens if decode else None,
        logits_indices=torch.tensor([num_tokens - 1], device=device),
        selections=[],
    )


class SequenceState:
    """The caches of one sequence, sized for `capacity` tokens."""

    def __init__(self, model: MSATransformer, capacity: int, cache_dtype: torch.dtype | None = None,
                 index_dtype: torch.dtype | None = None):
        """index_dtype: of the index-K cache (fp8 adds per-key scales); default the K/V dtype."""
        self.model = model
        param = next(model.parameters())
        page_size = model.config.page_size
        self.max_pages = (capacity + page_size - 1) // page_size
        self.caches: list[LayerKVCache] = allocate_caches(
            model.config, self.max_pages, param.device, cache_dtype or param.dtype, index_dtype
        )

    def forward(self, token_ids: list[int] | torch.Tensor, start: int, decode: bool = False) -> torch.Tensor:
        """Run tokens at positions start.. → hidden [n, H]."""
        device = next(self.model.parameters()).device
        ids = torch.as_tensor(token_ids, dtype=torch.int64, device=device)
        meta = step_metadata(start, ids.shape[0], self.max_pages, self.model.config.page_size, decode, device)
        return self.model(ids, meta, self.caches)

    def prefill(self, token_ids: list[int], start: int = 0, chunk_size: int | None = None) -> torch.Tensor:
        """Prefill in chunks of `chunk_size` (None = one chunk) → hidden [n, H]."""
        chunk = chunk_size or len(token_ids)
        hidden = [self.forward(token_ids[i : i + chunk], start + i) for i in range(0, len(token_ids), chunk)]
        return torch.cat(hidden)


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """logits [V] fp32 → one token id: greedy at temperature 0, else temperature + nucleus."""
    if temperature <= 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / temperature, dim=-1)
    sorted_probs, order = torch.sort(probs, descending=True)
    # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
    keep = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) < top_p
    sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
    choice = torch.multinomial(sorted_probs.cpu(), 1, generator=generator)
    return int(order[choice.to(order.device)])


@torch.inference_mode()
def generate(
    model: MSATransformer,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    chunk_size: int | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    eos_token_ids: Iterable[int] = (),
    cache_dtype: torch.dtype | None = None,
    on_token: Callable[[int], None] | None = None,
) -> list[int]:
    """Generate up to `max_new_tokens` after `prompt_ids`; stops after an eos id (included)."""
    if not prompt_ids:
        raise ValueError("prompt_ids is empty: at least one token is needed")
    state = SequenceState(model, len(prompt_ids) + max_new_tokens, cache_dtype)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    stop = set(eos_token_ids)
    hidden = state.prefill(prompt_ids, chunk_size=chunk_size)[-1:]
    output: list[int] = []
    while True:
        token = sample(model.compute_logits(hidden)[0], temperature, top_p, generator)
        output.append(token)
        if on_token is not None:
            on_token(token)
        if token in stop or len(output) >= max_new_tokens:
            return output
        hidden = state.forward([token], len(prompt_ids) + len(output) - 1, decode=True)
