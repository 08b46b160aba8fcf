"""Image prompts: the router hashes them with the engine's function (`prompt_page_hashes`, media
content hashes included), so a prompt with the same image follows the replica that cached it and a
prompt with another image behind the same token ids does not."""

import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image

from msaserve.engine.config import EngineConfig
from msaserve.engine.llm_engine import LLMEngine
from msaserve.engine.types import GenerateRequest, SamplingParams
from msaserve.kvcache.page_hash import page_hashes, prompt_page_hashes
from msaserve.models.loader import attach_random_vision_tower
from msaserve.models.presets import get_preset
from msaserve.models.transformer import MSATransformer, init_random_weights
from msaserve.preprocess.pipeline import Preprocessor
from msaserve.router.core import RouterCore
from msaserve.router.stats import RoutingStatsRecorder, routing_stats_payload

IMAGE, VIDEO = 500, 501  # the tiny preset's placeholder ids
P = 16


def image_item(seed: int):
    """A preprocessed 120×90 PNG: grid 1×8×6, 12 placeholder tokens."""
    pixels = np.random.default_rng(seed).integers(0, 256, (90, 120, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    return Preprocessor().process([{"type": "image_url", "image_url": {"url": url}}]).media[0]


PROMPT = [*range(10, 30), IMAGE, *range(40, 80)]  # the image's 12 placeholders span pages 1 and 2


@pytest.fixture(scope="module")
def model() -> MSATransformer:
    model = init_random_weights(MSATransformer(get_preset("tiny"), "naive"), seed=0).eval()
    attach_random_vision_tower(model, seed=0, device="cpu", dtype=torch.float32)
    return model


@pytest.fixture
def engine(model) -> LLMEngine:
    """A fresh engine per test: its KV events start from an empty cache."""
    config = EngineConfig(model="tiny", num_pages=128, max_num_seqs=8, max_num_batched_tokens=64)
    return LLMEngine(config, model=model)


def run(engine: LLMEngine, request: GenerateRequest) -> None:
    engine.add_request(request)
    while engine.has_unfinished():
        engine.step()


def test_the_router_hashes_an_image_prompt_like_the_engine(engine):
    item = image_item(1)
    run(engine, GenerateRequest("a", PROMPT, SamplingParams(max_tokens=1, temperature=0.0), media=[item]))
    stored = {h for e in engine.drain_kv_events() if e.kind == "stored" for h in e.page_hashes}
    hashes = prompt_page_hashes(PROMPT, P, [item], (IMAGE, VIDEO))
    assert len(hashes) == (len(PROMPT) - 1 + item.num_placeholder_tokens) // P == 4
    assert set(hashes) <= stored
    assert not set(page_hashes(PROMPT, P)[1:]) & stored  # without the media the pages never match


def test_a_prompt_with_the_same_image_goes_where_it_is_cached(engine):
    item, other = image_item(2), image_item(3)
    sampling = SamplingParams(max_tokens=1, temperature=0.0)
    run(engine, GenerateRequest("b", PROMPT, sampling, media=[item]))
    events = engine.drain_kv_events()
    core = RouterCore("kv_aware", clock=lambda: 10.0)
    holder, idle = RoutingStatsRecorder(page_size=P), RoutingStatsRecorder(page_size=P)
    holder.media_token_ids = idle.media_token_ids = (IMAGE, VIDEO)  # what ModelDeployment sets
    stats = engine.stats()
    core.refresh([("holder", routing_stats_payload(stats, events, holder)),
                  ("idle", routing_stats_payload(stats, [], idle))])
    core.state.replicas["holder"].num_running = 1  # busier, but it holds the image's pages
    same = core.rank([GenerateRequest("c", PROMPT, sampling, media=[item])], {}, "c", ["holder", "idle"])
    assert same[0].replica_id == "holder" and same[0].predicted_hit_pages == 4
    swapped = core.rank([GenerateRequest("d", PROMPT, sampling, media=[other])], {}, "d", ["holder", "idle"])
    holder_view = next(d for d in swapped if d.replica_id == "holder")
    assert holder_view.predicted_hit_pages == 1  # page 0 is text only; the image's pages differ
