"""Adoption without the stall (engine/kv/adoption.py): after the first step of an adopted
session, background reads go in predicted order — the pages the previous step selected, for the
layers still missing them — not page order, and the tokens stay those of the unmoved session.

tiny: P=16, K=4; the 600-token session has 38 pages per layer."""

import torch
from reference_decode import SequenceState, step_metadata

from msaserve.engine.kv.adoption import LazyPageFetcher
from msaserve.engine.kv.pages import identity_for
from msaserve.engine.kv.persist import SessionWriter
from msaserve.kernels import get_ops
from msaserve.kvcache.client import KVCacheClient
from msaserve.kvcache.config import ServiceConfig
from msaserve.models.presets import get_preset
from msaserve.models.transformer import MSATransformer, init_random_weights

PROMPT_LEN, STEPS, PREFETCH = 600, 12, 6


def test_background_reads_follow_the_predicted_selection_and_tokens_match(tmp_path):
    model = init_random_weights(MSATransformer(get_preset("tiny"), "msa"), seed=0).eval()
    prompt = torch.randint(3, 512, (PROMPT_LEN,), generator=torch.Generator().manual_seed(5)).tolist()
    identity = identity_for(model.config, "tiny@seed0", torch.float32)
    client = KVCacheClient.in_process(ServiceConfig(num_shards=2, memory_bytes=64 << 20), identity)
    with torch.inference_mode():
        home = SequenceState(model, PROMPT_LEN + STEPS + 1)
        want = [int(torch.argmax(model.compute_logits(home.prefill(prompt, chunk_size=128)[-1:])[0]))]
        SessionWriter(client, "s").sync([*prompt, want[0]], home.caches, range(home.max_pages), PROMPT_LEN,
                                        tail=True)
        for step in range(STEPS):
            want.append(int(torch.argmax(model.compute_logits(home.forward([want[-1]], PROMPT_LEN + step,
                                                                           decode=True))[0])))

        adopter = SequenceState(model, PROMPT_LEN + STEPS + 1)
        fetcher = LazyPageFetcher(client, client.get_session("s"), adopter.caches, range(adopter.max_pages))
        assert fetcher.load_index() == PROMPT_LEN
        model_ops = fetcher.wrap_ops(get_ops("msa", "cpu"))
        got, predictions = [want[0]], []
        for step in range(STEPS):
            meta = step_metadata(PROMPT_LEN + step, 1, adopter.max_pages, model.config.page_size, True, "cpu")
            hidden = model(torch.tensor([got[-1]]), meta, adopter.caches, ops=model_ops)
            got.append(int(torch.argmax(model.compute_logits(hidden)[0])))
            fetcher.poll(wait=True)
            expected = [item for item in fetcher.predicted() if not fetcher.resident[item[1], item[0]]]
            started = len(fetcher.prefetch_log)
            fetcher.prefetch(PREFETCH)
            if len(fetcher.prefetch_log) > started:
                predictions.append((fetcher.prefetch_log[-1], expected[:PREFETCH]))
    assert got == want
    # Each background read started with the items predicted by the step before it, in that order
    # (then the newest pages fill the rest).
    for read, predicted in predictions:
        assert read[: len(predicted)] == predicted
    assert sum(len(predicted) for _, predicted in predictions) >= PREFETCH  # predictions were made
    assert fetcher.stats.kv_pages_on_demand > 0
