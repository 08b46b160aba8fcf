"""Model-level MSA properties on the tiny preset (docs/design.md §2): MSA = dense when T ≤ K·P, and any
split into prefill chunks and decode steps gives the same result."""

import pytest
import torch
from reference_decode import SequenceState, generate, step_metadata

from msaserve.models.cache import allocate_caches
from msaserve.models.presets import get_preset
from msaserve.models.transformer import MSATransformer, init_random_weights

# fp32 throughout; differences come only from summation order.
ATOL, RTOL = 2e-4, 1e-4


def _model(backend: str, seed: int = 0, **overrides) -> MSATransformer:
    # std 0.2 makes attention far from uniform, so a wrong selection changes the logits.
    model = MSATransformer(get_preset("tiny", **overrides), backend)
    return init_random_weights(model, seed=seed, std=0.2).eval()


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _all_logits(model: MSATransformer, ids: list[int], chunk_size: int | None = None) -> torch.Tensor:
    state = SequenceState(model, len(ids))
    with torch.inference_mode():
        return model.compute_logits(state.prefill(ids, chunk_size=chunk_size))


@pytest.mark.parametrize("overrides", [{}, {"num_index_heads": 2},
                                       {"index_source": "keys", "num_index_heads": 2}])
@pytest.mark.parametrize("backend", ["naive", "msa"])
@pytest.mark.parametrize("length", [1, 37, 64])  # K·P = 64
def test_msa_equals_dense_within_budget(backend: str, length: int, overrides: dict) -> None:
    ids = _prompt(length, seed=length)
    msa = _all_logits(_model(backend, **overrides), ids)
    dense = _all_logits(_model("dense", **overrides), ids)
    torch.testing.assert_close(msa, dense, atol=ATOL, rtol=RTOL)


def test_msa_differs_from_dense_beyond_budget() -> None:
    """Beyond K·P tokens some blocks are dropped: the test above could fail."""
    ids = _prompt(200, seed=1)
    msa = _all_logits(_model("naive"), ids)
    dense = _all_logits(_model("dense"), ids)
    torch.testing.assert_close(msa[:64], dense[:64], atol=ATOL, rtol=RTOL)
    assert (msa[64:] - dense[64:]).abs().max() > 1e-2


def test_selections_are_recorded_and_sparse() -> None:
    model = _model("naive")
    state = SequenceState(model, 150)
    meta = step_metadata(0, 150, state.max_pages, 16, decode=False, device=torch.device("cpu"))
    with torch.inference_mode():
        model(torch.tensor(_prompt(150, 2)), meta, state.caches)
    assert len(meta.selections) == model.config.num_layers
    last = meta.selections[0][-1]  # [Hkv, K] of position 149: local block 9, 10 blocks exist
    assert last.shape == (2, 4) and (last >= 0).all()
    assert int(last.max()) == 9 and int(last.min()) == 0  # forced local and init blocks


@pytest.mark.parametrize("chunk_size", [17, 64, 100])
def test_chunked_prefill_and_decode_match_one_prefill(chunk_size: int) -> None:
    """T = 150 > K·P = 64, so the selection is really sparse."""
    model = _model("msa", seed=3)
    ids = _prompt(150, seed=3)
    whole = _all_logits(model, ids)
    chunked = _all_logits(model, ids, chunk_size=chunk_size)
    torch.testing.assert_close(chunked, whole, atol=ATOL, rtol=RTOL)
    # Decoding token by token from position 100 on gives the logits of the one prefill too.
    state = SequenceState(model, len(ids))
    with torch.inference_mode():
        state.prefill(ids[:100], chunk_size=chunk_size)
        steps = [state.forward([token], 100 + i, decode=True) for i, token in enumerate(ids[100:])]
        torch.testing.assert_close(model.compute_logits(torch.cat(steps)), whole[100:], atol=ATOL, rtol=RTOL)
    one = generate(model, ids, 24)
    assert generate(model, ids, 24, chunk_size=chunk_size) == one


def test_sampling_is_seeded() -> None:
    model = _model("msa")
    ids = _prompt(20, seed=5)
    first = generate(model, ids, 12, temperature=1.0, top_p=0.9, seed=7)
    assert generate(model, ids, 12, temperature=1.0, top_p=0.9, seed=7) == first
    assert generate(model, ids, 12, temperature=1.0, top_p=0.9, seed=8) != first


def test_input_embeds_replace_token_embeddings() -> None:
    model = _model("msa")
    ids = torch.tensor(_prompt(10, seed=6))
    state = SequenceState(model, 10)
    meta = step_metadata(0, 10, state.max_pages, 16, decode=False, device=torch.device("cpu"))
    with torch.inference_mode():
        via_ids = model(ids, meta, allocate_caches(model.config, state.max_pages, "cpu", torch.float32))
        meta.selections = []
        embeds = model.embed_tokens(ids)
        via_embeds = model(ids * 0, meta, state.caches, input_embeds=embeds)
    torch.testing.assert_close(via_embeds, via_ids)


def test_fp8_index_cache_allocates_scales() -> None:
    caches = allocate_caches(get_preset("tiny"), 3, "cpu", torch.bfloat16, torch.float8_e4m3fn)
    assert len(caches) == 2 and caches[0].index_scale is not None
    assert caches[0].index_cache.shape == (3, 16, 1, 16) and caches[0].k_cache.dtype == torch.bfloat16
    assert allocate_caches(get_preset("tiny"), 3, "cpu", torch.float32)[0].index_scale is None
