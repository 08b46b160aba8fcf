"""The vision tower on real preprocessed media, and the placeholder bookkeeping."""

import numpy as np
import pytest
import torch
from preprocess_media import image_part, make_image, make_video, video_part

from msaserve.kvcache.page_hash import (
    expand_placeholders,
    media_hashes_per_page,
    page_hashes,
    placeholder_spans,
)
from msaserve.models.vision import VISION_PRESETS, VisionConfig, VisionTower, merge_media_embeddings
from msaserve.preprocess.config import PreprocessConfig
from msaserve.preprocess.pipeline import Preprocessor

IMAGE, VIDEO = 500, 501
CONFIG = PreprocessConfig(
    min_pixels=28 * 28, max_pixels=28 * 28 * 12, video_min_pixels=28 * 28, video_max_pixels=28 * 28 * 4
)


@pytest.fixture(scope="module")
def media():
    parts = [
        image_part(make_image(90, 60, seed=1)),
        video_part(make_video(seconds=2)),
        image_part(make_image(40, 70, seed=2)),
    ]
    return Preprocessor(CONFIG).process(parts).media


@pytest.fixture(scope="module")
def tower() -> VisionTower:
    torch.manual_seed(0)
    return VisionTower(VISION_PRESETS["tiny"]).eval()


def test_output_rows_equal_placeholder_count(tower, media):
    with torch.no_grad():
        embeds = tower.embed_media(media)
    assert embeds.shape == (sum(m.num_placeholder_tokens for m in media), 64)
    assert torch.isfinite(embeds).all()


def test_media_do_not_attend_to_each_other(tower, media):
    with torch.no_grad():
        together = tower.embed_media(media)
        alone = torch.cat([tower.embed_media([m]) for m in media])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)


def test_patch_embedding_equals_conv3d(tower, media):
    cfg = tower.config
    conv = torch.nn.Conv3d(3, cfg.hidden_size, (2, 14, 14), stride=(2, 14, 14), bias=False)
    with torch.no_grad():
        conv.weight.copy_(tower.patch_embed.proj.weight.view(cfg.hidden_size, 3, 2, 14, 14))
        patches = torch.from_numpy(media[0].patches)  # [N, C·T·P·P]
        by_conv = conv(patches.view(-1, 3, 2, 14, 14)).flatten(1)
        torch.testing.assert_close(tower.patch_embed.proj(patches), by_conv, rtol=1e-4, atol=1e-4)


def test_position_matters(tower, media):
    """Rotary positions: shuffling merge groups within an image changes more than the order."""
    item = media[0]
    groups = item.patches.reshape(-1, 4, item.patches.shape[1])
    shuffled = groups[np.random.default_rng(0).permutation(len(groups))].reshape(item.patches.shape)
    with torch.no_grad():
        a = tower(torch.from_numpy(item.patches), [item.grid_thw])
        b = tower(torch.from_numpy(shuffled), [item.grid_thw])
    assert not torch.allclose(a.sort(dim=0).values, b.sort(dim=0).values, atol=1e-4)


def test_shape_mismatch_is_an_error(tower, media):
    with pytest.raises(ValueError, match="do not match grids"):
        tower(torch.from_numpy(media[0].patches), [media[1].grid_thw])


def test_expand_and_spans(media):
    prompt = [1, IMAGE, 7, 8, VIDEO, 9, IMAGE, 2]
    expanded = expand_placeholders(prompt, media, IMAGE, VIDEO)
    counts = [m.num_placeholder_tokens for m in media]
    assert len(expanded) == len(prompt) - 3 + sum(counts)
    assert expanded.count(IMAGE) == counts[0] + counts[2] and expanded.count(VIDEO) == counts[1]
    spans = placeholder_spans(expanded, media, IMAGE, VIDEO)
    assert spans[0] == (1, counts[0])
    assert spans[1] == (1 + counts[0] + 2, counts[1])
    assert spans[2] == (1 + counts[0] + 2 + counts[1] + 1, counts[2])


@pytest.mark.parametrize(
    "prompt,message",
    [
        ([1, IMAGE, 2], "have no placeholder"),
        ([IMAGE, VIDEO, IMAGE, IMAGE], "only 3 media"),
        ([VIDEO, VIDEO, IMAGE], "different kind"),
    ],
)
def test_expand_mismatch(media, prompt, message):
    with pytest.raises(ValueError, match=message):
        expand_placeholders(prompt, media, IMAGE, VIDEO)


def test_media_hashes_fold_into_page_hashes(media):
    page = 8
    prompt = [3] * 10 + [IMAGE] + [4] * 5 + [VIDEO] + [IMAGE] + [5] * 9
    expanded = expand_placeholders(prompt, media, IMAGE, VIDEO)
    per_page = media_hashes_per_page(expanded, media, IMAGE, VIDEO, page)
    assert len(per_page) == -(-len(expanded) // page)
    for (start, length), item in zip(placeholder_spans(expanded, media, IMAGE, VIDEO), media, strict=True):
        for p in range(len(per_page)):
            overlaps = start < (p + 1) * page and start + length > p * page
            assert (item.content_hash in per_page[p]) == overlaps
    # Same tokens, another first image: the pages from the image on hash differently; before, the same.
    other = Preprocessor(CONFIG).process([image_part(make_image(90, 60, seed=9))]).media[0]
    swapped = [other, *media[1:]]
    assert other.num_placeholder_tokens == media[0].num_placeholder_tokens
    a = page_hashes(expanded, page, media_hashes_per_page(expanded, media, IMAGE, VIDEO, page))
    b = page_hashes(expanded, page, media_hashes_per_page(expanded, swapped, IMAGE, VIDEO, page))
    first_image_page = 10 // page
    assert a[:first_image_page] == b[:first_image_page]
    assert all(x != y for x, y in zip(a[first_image_page:], b[first_image_page:], strict=True))
    again = page_hashes(expanded, page, media_hashes_per_page(expanded, list(media), IMAGE, VIDEO, page))
    assert a == again  # the same media again → a prefix-cache hit


def test_merge_embeddings_whole_and_chunked(tower, media):
    prompt = [1, IMAGE, 7, VIDEO, IMAGE, 2]
    ids = torch.tensor(expand_placeholders(prompt, media, IMAGE, VIDEO))
    with torch.no_grad():
        media_embeds = tower.embed_media(media)
    text = torch.randn(len(ids), 64)
    whole = merge_media_embeddings(text, ids, media_embeds, IMAGE, VIDEO)
    placeholder = (ids == IMAGE) | (ids == VIDEO)
    torch.testing.assert_close(whole[placeholder], media_embeds)
    torch.testing.assert_close(whole[~placeholder], text[~placeholder])
    chunks, before = [], 0
    for start in range(0, len(ids), 5):  # chunked prefill: 5 tokens at a time
        chunk = slice(start, start + 5)
        chunks.append(merge_media_embeddings(text[chunk], ids[chunk], media_embeds, IMAGE, VIDEO, before))
        before += int(placeholder[chunk].sum())
    torch.testing.assert_close(torch.cat(chunks), whole)


def test_vision_config_from_hf_names():
    hf = {
        "depth": 32, "embed_dim": 1280, "hidden_size": 3584, "num_heads": 16, "spatial_merge_size": 2,
        "patch_size": 14, "temporal_patch_size": 2, "in_chans": 3, "mlp_ratio": 4, "model_type": "qwen2_vl",
    }  # fmt: skip
    cfg = VisionConfig.from_dict(hf)
    assert (cfg.hidden_size, cfg.out_hidden_size, cfg.merge_size, cfg.depth) == (1280, 3584, 2, 32)
    assert VisionConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="multiple of 4"):
        VisionConfig(hidden_size=30, num_heads=2)


def test_tower_equals_transformers_qwen2vl_vision_model(media):
    """Same weights → same embeddings as transformers' Qwen2VisionTransformerPretrainedModel
    (a tiny config), on real preprocessed image and video patches. Tolerance 1e-4 (fp32)."""
    modeling = pytest.importorskip("transformers.models.qwen2_vl.modeling_qwen2_vl")
    configuration = pytest.importorskip("transformers.models.qwen2_vl.configuration_qwen2_vl")
    hf_config = configuration.Qwen2VLVisionConfig(
        depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2
    )
    hf_config._attn_implementation = "sdpa"
    torch.manual_seed(1)
    reference = modeling.Qwen2VisionTransformerPretrainedModel(hf_config).eval()
    ours = VisionTower(VisionConfig.from_dict(hf_config.to_dict())).eval()
    ours.load_hf_state_dict(reference.state_dict())
    patches = torch.cat([torch.from_numpy(m.patches) for m in media])
    grids = [m.grid_thw for m in media]
    with torch.no_grad():
        expected = reference(patches, grid_thw=torch.tensor(grids)).pooler_output
        got = ours(patches, grids)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
