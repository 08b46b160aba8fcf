"""Images in the engine: placeholder expansion, the vision embeddings merged at prefill (any
chunking gives the same tokens), and media hashes in the prefix cache."""

import base64
import io

import numpy as np
import pytest
import torch
from engine_helpers import greedy, make_engine, run_to_completion
from PIL import Image

from msaserve.engine.types import GenerateRequest, InvalidParameter
from msaserve.models.loader import attach_random_vision_tower
from msaserve.models.presets import get_preset
from msaserve.models.transformer import MSATransformer, init_random_weights
from msaserve.preprocess.pipeline import Preprocessor

IMAGE, VIDEO = 500, 501
P = 16  # tiny's page size


@pytest.fixture(scope="module")
def vision_model() -> MSATransformer:
    model = init_random_weights(MSATransformer(get_preset("tiny"), "naive"), seed=0).eval()
    attach_random_vision_tower(model, seed=0, device="cpu", dtype=torch.float32)
    return model


def image_item(seed: int, size: tuple[int, int] = (120, 90)):
    """One preprocessed photo-like PNG (120×90 → a 112×84 resize: grid 1×8×6, 12 placeholders)."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    return Preprocessor().process([{"type": "image_url", "image_url": {"url": url}}]).media[0]


def prompt_with_image(before: int = 20, after: int = 9) -> list[int]:
    """Text, one image token, text: the image's placeholders cross page boundaries."""
    return [*range(10, 10 + before), IMAGE, *range(40, 40 + after)]


def test_placeholders_are_expanded_to_the_patch_grid(vision_model) -> None:
    item = image_item(1)
    t, h, w = item.grid_thw
    assert item.num_placeholder_tokens == t * h * w // 4
    engine = make_engine(vision_model)
    engine.add_request(GenerateRequest("a", prompt_with_image(), greedy(2), media=[item]))
    seq = engine.trackers["a"].seq
    assert seq.num_prompt_tokens == 29 + item.num_placeholder_tokens
    assert seq.token_ids.count(IMAGE) == item.num_placeholder_tokens
    outputs: list = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert outputs[-1].stats.num_prompt_tokens == 29 + item.num_placeholder_tokens


@pytest.mark.parametrize("chunk", [5, 7, 13])
def test_chunked_prefill_across_an_image_gives_the_same_tokens(vision_model, chunk: int) -> None:
    item = image_item(2, size=(200, 150))  # 30+ placeholders: every chunk size splits the image
    request = lambda: GenerateRequest("a", prompt_with_image(), greedy(8), media=[item])  # noqa: E731
    whole = run_to_completion(make_engine(vision_model, max_num_batched_tokens=256), [request()])["a"]
    engine = make_engine(vision_model, max_num_batched_tokens=chunk)
    assert run_to_completion(engine, [request()])["a"] == whole
    assert engine.trackers == {}


def test_the_image_changes_the_output(vision_model) -> None:
    """The merge really feeds the tower's rows in: two images, same text, different logits."""
    prompt = prompt_with_image()
    engine = make_engine(vision_model, max_num_batched_tokens=256)
    logits = []
    for seed in (3, 4):
        engine.add_request(GenerateRequest(f"r{seed}", prompt, greedy(1), media=[image_item(seed)]))
        batch = engine.scheduler.schedule()
        _, step_logits = engine.runner.execute(batch)
        engine.scheduler.postprocess(batch)
        logits.append(step_logits[0])
        engine.abort(f"r{seed}")
    assert not torch.allclose(logits[0], logits[1], atol=1e-4)


def test_a_repeated_image_hits_the_prefix_cache_and_another_image_does_not(vision_model) -> None:
    engine = make_engine(vision_model, max_num_batched_tokens=256)
    prompt = prompt_with_image(before=20, after=40)
    first, same, other = image_item(5), image_item(5), image_item(6)
    outputs = {}

    def run(name: str, item) -> int:
        engine.add_request(GenerateRequest(name, prompt, greedy(4), media=[item]))
        stats = None
        while engine.has_unfinished():
            for out in engine.step():
                outputs.setdefault(name, []).extend(out.token_ids)
                stats = out.stats or stats
        return stats.num_cached_tokens

    assert run("first", first) == 0
    total = len(prompt) - 1 + first.num_placeholder_tokens
    assert run("same", same) == (total // P) * P  # every full page, the image's included
    assert outputs["same"] == outputs["first"]
    # Only the page before the image is shared: the page holding the image start differs.
    assert run("other", other) == (20 // P) * P


def test_bad_media_requests_are_invalid_parameters(vision_model, tiny_model) -> None:
    engine = make_engine(vision_model)
    item = image_item(7)
    cases = [
        (GenerateRequest("a", [10, 11, 12], greedy(1), media=[item]), "no placeholder"),
        (GenerateRequest("b", [10, IMAGE, IMAGE], greedy(1), media=[item]), "only 1 media"),
        (GenerateRequest("c", [10, VIDEO], greedy(1), media=[item]), "different kind"),
        (GenerateRequest("d", [10, IMAGE], greedy(1)), "placeholders only with media"),
    ]
    for request, fragment in cases:
        with pytest.raises(InvalidParameter, match=fragment):
            engine.add_request(request)
    text_only = make_engine(tiny_model)
    with pytest.raises(InvalidParameter, match="no vision tower"):
        text_only.add_request(GenerateRequest("e", [10, IMAGE], greedy(1), media=[item]))
    assert not engine.has_unfinished() and not text_only.has_unfinished()
