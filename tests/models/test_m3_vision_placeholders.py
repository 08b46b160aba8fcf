"""M3 prompts hold every placeholder already (the processor's text: bracketed runs, timestamps
between a video's frames): the engine takes them as they are, checks their kinds, and hashes every
page a medium's placeholders touch; the gateway tokenizes the placeholder text whole."""

import json
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from msaserve.kvcache.page_hash import expand_placeholders, media_hashes_per_page, placeholder_spans
from msaserve.models.tokenizer import Tokenizer
from msaserve.platform.media import MEDIA_MARKER, encode_prompt
from msaserve.preprocess.config import PreprocessConfig
from msaserve.preprocess.minimax_m3.processor import M3Preprocessor
from msaserve.preprocess.pipeline import Preprocessor
from msaserve.preprocess.select import preprocessor_for

IMAGE, VIDEO = 300, 301


@dataclass
class Item:
    kind: str
    num_placeholder_tokens: int
    content_hash: int = 7
    placeholder_text: str | None = None


def test_expanded_prompt_is_taken_as_it_is():
    ids = [1, IMAGE, IMAGE, 2, 5, VIDEO, VIDEO, 6, VIDEO, VIDEO, 3]
    media = [Item("image", 2), Item("video", 4)]
    assert expand_placeholders(ids, media, IMAGE, VIDEO) == ids


def test_one_token_per_medium_is_still_expanded():
    assert expand_placeholders([1, IMAGE, 2], [Item("image", 3)], IMAGE, VIDEO) == [1, IMAGE, IMAGE, IMAGE, 2]


def test_expanded_prompt_with_a_kind_swapped_is_refused():
    ids = [IMAGE, IMAGE, VIDEO, VIDEO, VIDEO]
    with pytest.raises(ValueError, match="medium 0 \\(image\\) has placeholders of another kind"):
        expand_placeholders(ids, [Item("image", 3), Item("video", 2)], IMAGE, VIDEO)


def test_a_video_span_runs_from_its_first_to_its_last_placeholder():
    ids = [VIDEO, VIDEO, 9, 9, 9, 9, VIDEO, VIDEO]  # two frames, separators between them
    media = [Item("video", 4, content_hash=42)]
    assert placeholder_spans(ids, media, IMAGE, VIDEO) == [(0, 8)]
    # Page 1 (positions 4–7) holds the second frame's placeholders: its hash must include the video.
    assert media_hashes_per_page(ids, media, IMAGE, VIDEO, page_size=4) == [[42], [42]]


def test_gateway_tokenizes_placeholder_text_whole():
    tokenizer = Tokenizer.byte_level(300)
    from tokenizers import AddedToken

    tokenizer.backend.add_special_tokens([AddedToken("]<]image[>[", special=True, normalized=False)])
    image_id = tokenizer.backend.token_to_id("]<]image[>[")
    info = SimpleNamespace(image_token_id=image_id, video_token_id=image_id + 1)
    item = Item("image", 2, placeholder_text="]<]start[>[]<]image[>[]<]image[>[]<]end[>[")
    prompt = f"look{MEDIA_MARKER}!"
    ids, length = encode_prompt(tokenizer, prompt, [item], info)
    assert ids == tokenizer.encode("look" + item.placeholder_text + "!")
    assert length == len(ids) and ids.count(image_id) == 2


def test_processor_follows_the_checkpoint(tmp_path):
    config = PreprocessConfig()
    assert type(preprocessor_for("tiny", config)) is Preprocessor
    assert type(preprocessor_for(None, config)) is Preprocessor
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert type(preprocessor_for(str(tmp_path), config)) is Preprocessor
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "minimax_m3_vl"}))
    assert type(preprocessor_for(str(tmp_path), config)) is M3Preprocessor
    processor = {"image_processor": {"image_processor_type": "MiniMaxM3VLImageProcessor",
                                     "size": {"shortest_edge": 3136, "longest_edge": 100352}},
                 "video_processor": {"fps": 2.0, "do_sample_frames": True}}  # fmt: skip
    (tmp_path / "processor_config.json").write_text(json.dumps(processor))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "other"}))
    chosen = preprocessor_for(str(tmp_path), config)
    assert isinstance(chosen, M3Preprocessor)
    assert (chosen.m3.image_max_pixels, chosen.m3.video_fps, chosen.m3.do_sample_frames) == (
        100352,
        2.0,
        True,
    )
