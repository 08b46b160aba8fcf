"""A batched step over scattered physical pages gives each sequence the logits it gets alone."""

import pytest
import torch
from reference_decode import SequenceState

from msaserve.models.cache import allocate_caches
from msaserve.models.metadata import AttentionMetadata
from msaserve.models.presets import get_preset
from msaserve.models.transformer import MSATransformer, init_random_weights

P = 16  # tiny's page size


def _batched_meta(
    starts: list[int], counts: list[int], tables: torch.Tensor, decode: bool
) -> AttentionMetadata:
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, counts, strict=True)])
    seq_index = torch.cat([torch.full((n,), b) for b, n in enumerate(counts)])
    slots = tables[seq_index, positions // P].long() * P + positions % P
    cu = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    return AttentionMetadata(
        positions=positions, slot_mapping=slots, block_tables=tables,
        seq_lens=torch.tensor([s + n for s, n in zip(starts, counts, strict=True)], dtype=torch.int32),
        cu_seqlens_q=cu, max_query_len=max(counts), decode_query_len=counts[0] if decode else None,
    )


@pytest.mark.parametrize("backend", ["msa", "dense"])
def test_batched_scattered_pages_match_single_sequences(backend: str) -> None:
    model = init_random_weights(MSATransformer(get_preset("tiny"), backend), seed=9, std=0.2).eval()
    gen = torch.Generator().manual_seed(9)
    seqs = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (150, 77)]
    # Physical pages shuffled across both sequences; -1 beyond each one's pages.
    pages = torch.randperm(20, generator=gen).to(torch.int32)
    tables = torch.full((2, 12), -1, dtype=torch.int32)
    tables[0, :10], tables[1, :6] = pages[:10], pages[10:16]
    caches = allocate_caches(model.config, 20, "cpu", torch.float32)
    prompt_lens = [140, 70]
    with torch.inference_mode():
        meta = _batched_meta([0, 0], prompt_lens, tables, decode=False)
        ids = torch.tensor(seqs[0][:140] + seqs[1][:70])
        prefill = model.compute_logits(model(ids, meta, caches))
        # One decode step for both sequences at once (Q = 1), then each alone for reference.
        meta = _batched_meta(prompt_lens, [1, 1], tables, decode=True)
        decode = model.compute_logits(model(torch.tensor([seqs[0][140], seqs[1][70]]), meta, caches))
        for b, seq in enumerate(seqs):
            n = prompt_lens[b]
            state = SequenceState(model, n + 1)
            alone = model.compute_logits(state.prefill(seq[: n + 1]))
            mine = prefill[:140] if b == 0 else prefill[140:]
            torch.testing.assert_close(mine, alone[:n], atol=2e-4, rtol=1e-4)
            torch.testing.assert_close(decode[b], alone[n], atol=2e-4, rtol=1e-4)
