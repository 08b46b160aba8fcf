"""Evicted prefix-cache pages leave with their contents (for the KV cache service): the K/V and
index-K handed to the sink are what the reference computes for those tokens."""

import torch
from engine_helpers import greedy, make_engine, random_prompt, run_to_completion
from reference_decode import SequenceState

from msaserve.engine.kv.swap import PageData
from msaserve.engine.types import GenerateRequest
from msaserve.kvcache.page_hash import page_hashes


class RecordingSink:
    def __init__(self) -> None:
        self.pages: dict[int, dict[str, torch.Tensor]] = {}

    def store_evicted(self, hashes: list[int], data: PageData) -> None:
        for i, page_hash in enumerate(hashes):
            self.pages[page_hash] = {name: tensor[:, i].clone() for name, tensor in data.items()}


def test_evicted_pages_carry_their_kv_and_index_keys(tiny_model):
    sink = RecordingSink()
    engine = make_engine(tiny_model, num_pages=12, evicted_page_sink=sink)
    first = random_prompt(64, seed=11)  # 4 full pages, cached after it finishes
    run_to_completion(engine, [GenerateRequest("a", first, greedy(2))])
    # Unrelated prompts that need the whole pool evict the first prompt's pages.
    run_to_completion(engine, [GenerateRequest(f"b{i}", random_prompt(90, seed=20 + i), greedy(2))
                               for i in range(2)])
    removed = [h for e in engine.drain_kv_events() if e.kind == "removed" for h in e.page_hashes]
    assert set(removed) == set(sink.pages)
    first_hashes = page_hashes(first, 16)
    assert first_hashes[0] in sink.pages
    reference = SequenceState(tiny_model, 64)
    reference.prefill(first)
    for page, page_hash in enumerate(first_hashes):
        if page_hash not in sink.pages:
            continue
        got = sink.pages[page_hash]
        for layer, cache in enumerate(reference.caches):
            torch.testing.assert_close(got["k"][layer], cache.k_cache[page], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(got["v"][layer], cache.v_cache[page], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(got["index"][layer], cache.index_cache[page], rtol=1e-4, atol=1e-5)
