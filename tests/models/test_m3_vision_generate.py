"""MiniMax-M3 with an image and with a short video through msaserve's whole path (M3 processor →
placeholder text → paged engine with chunked prefill → vision tower merged into the chunks →
decode) gives transformers' greedy tokens: 64 new tokens, compared with `generate` of
MiniMaxM3SparseForConditionalGeneration on the same pixel values (which the processor tests show
equal transformers' processors' own)."""

import sys
from pathlib import Path

import pytest
import torch
from m3_checkpoint import one_cpu_thread, write_m3_checkpoint
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "preprocess"))
from preprocess_media import encode_image, make_video, photo_array

from msaserve.engine.config import EngineConfig
from msaserve.engine.llm_engine import LLMEngine
from msaserve.engine.types import GenerateRequest, SamplingParams
from msaserve.models.loader import load_model
from msaserve.preprocess.minimax_m3.processor import M3Preprocessor

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures(one_cpu_thread.__name__)

NEW_TOKENS = 64


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory, oracle = write_m3_checkpoint(tmp_path_factory.mktemp("m3") / "vl", vl=True, seed=2)
    loaded = load_model(str(directory), attention_backend="msa", progress=False)
    return directory, oracle, loaded


MEDIA = {
    # an 84×112 image: grid 6×8 → 12 placeholders
    "image": lambda: encode_image(Image.fromarray(photo_array(112, 84, seed=3)), "PNG"),
    # 10 frames of 56×84 at 10 fps: 5 temporal patches of 4×6 (attention chunks 4 + 1) → 30
    # placeholders in 5 bracketed runs with timestamps between them
    "video": lambda: make_video(width=84, height=56, seconds=1.0, fps=10),
}


@pytest.mark.parametrize("kind", MEDIA)
def test_engine_greedy_tokens_with_media_match_transformers(checkpoint, kind) -> None:
    directory, oracle, loaded = checkpoint
    item = M3Preprocessor().process_media(MEDIA[kind](), kind)
    prompt = f"]~!b[]~b]user\nWhat is in this {kind}?{item.placeholder_text} Be brief.[e~[\n]~b]ai\n"
    ids = loaded.tokenizer.encode(prompt)
    placeholder = (
        loaded.model.config.image_token_id if kind == "image" else loaded.model.config.video_token_id
    )
    assert ids.count(placeholder) == item.num_placeholder_tokens
    assert len(item.grids) == (1 if kind == "image" else 2)
    config = EngineConfig(model=str(directory), num_pages=64, max_num_seqs=2, max_num_batched_tokens=16)
    engine = LLMEngine(config, model=loaded.model, tokenizer=loaded.tokenizer)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    engine.add_request(GenerateRequest("r", ids, params, media=[item]))
    tokens: list[int] = []
    while engine.has_unfinished():
        for output in engine.step():
            tokens.extend(output.token_ids)
    pixels = torch.from_numpy(item.patches)
    grids = torch.tensor(item.grids)
    media = {"pixel_values": pixels, "image_grid_thw": grids} if kind == "image" else {
        "pixel_values_videos": pixels, "video_grid_thw": grids}  # fmt: skip
    # EOS is an ordinary token on both sides: the engine ignores it, and transformers is given an
    # end id no token has (min_new_tokens would instead forbid EOS, which this random model picks).
    with torch.inference_mode():
        expected = oracle.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), **media,
            max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1,
        )  # fmt: skip
    assert expected.shape[1] == len(ids) + NEW_TOKENS
    assert tokens == expected[0, len(ids) :].tolist()


def test_tower_rows_depend_on_the_image(checkpoint) -> None:
    """The loaded tower is not a constant: two images give two different sets of rows."""
    loaded = checkpoint[2]
    pre = M3Preprocessor()
    a = pre.process_media(encode_image(Image.fromarray(photo_array(112, 84, seed=3)), "PNG"), "image")
    b = pre.process_media(encode_image(Image.fromarray(photo_array(112, 84, seed=4)), "PNG"), "image")
    with torch.inference_mode():
        rows_a = loaded.model.visual.embed_media([a])
        rows_b = loaded.model.visual.embed_media([b])
    assert rows_a.shape == (12, loaded.model.config.hidden_size)
    assert not torch.allclose(rows_a, rows_b)
