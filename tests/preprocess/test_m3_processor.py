"""M3's image and video processors against transformers' (the oracle): the same pixel values (bit
for bit), grids, video chunks, placeholder counts, and the same prompt token ids after the markers
are expanded; settings read from a checkpoint's processor_config.json."""

import io

import numpy as np
import pytest
from m3_oracle import m3_tokenizer, processors
from PIL import Image
from preprocess_media import encode_image, make_video, photo_array

from msaserve.preprocess.config import PreprocessConfig
from msaserve.preprocess.errors import MediaError
from msaserve.preprocess.minimax_m3.config import M3ProcessorConfig, is_m3_processor
from msaserve.preprocess.minimax_m3.processor import M3Preprocessor
from msaserve.preprocess.minimax_m3.text import IMAGE_TOKEN, VIDEO_TOKEN


@pytest.fixture(scope="module")
def oracle():
    return processors()


def _reference_image(oracle, data: bytes, **kwargs):
    image_cls = oracle[0]
    out = image_cls(**kwargs)(images=[Image.open(io.BytesIO(data))], return_tensors="np")
    return out["pixel_values"], [tuple(g) for g in out["image_grid_thw"].tolist()]


@pytest.mark.parametrize(
    "width,height,fmt",
    [(120, 90, "PNG"), (112, 84, "PNG"), (451, 300, "JPEG"), (700, 1000, "PNG"), (30, 500, "PNG"),
     (57, 57, "JPEG"), (1600, 900, "JPEG")],
)  # fmt: skip
def test_image_pixels_and_grid_equal_transformers(oracle, width, height, fmt):
    data = encode_image(Image.fromarray(photo_array(width, height, seed=width)), fmt)
    item = M3Preprocessor().process_media(data, "image")
    pixels, grids = _reference_image(oracle, data)
    assert [item.grid_thw] == item.grids == grids
    assert item.patches.dtype == np.float32
    np.testing.assert_array_equal(item.patches, pixels)
    assert item.num_placeholder_tokens == item.patches.shape[0] // 4


def test_image_limits_from_the_checkpoint_config(oracle, tmp_path):
    """A processor saved with other pixel limits: the config read back gives the same result."""
    image_cls, video_cls, processor_cls, _ = oracle
    _, hf_tokenizer = m3_tokenizer()
    size = {"shortest_edge": 56 * 56, "longest_edge": 200 * 28 * 28}
    processor_cls(image_cls(size=size), hf_tokenizer, video_cls(max_pixels=64 * 28 * 28)).save_pretrained(
        tmp_path
    )
    assert is_m3_processor(tmp_path)
    config = M3ProcessorConfig.from_directory(tmp_path)
    assert (config.image_min_pixels, config.image_max_pixels, config.video_max_pixels) == (
        56 * 56, 200 * 28 * 28, 64 * 28 * 28,
    )  # fmt: skip
    data = encode_image(Image.fromarray(photo_array(900, 640)), "PNG")
    item = M3Preprocessor(config).process_media(data, "image")
    pixels, grids = _reference_image(oracle, data, size=size)
    assert [item.grid_thw] == grids
    np.testing.assert_array_equal(item.patches, pixels)


def _reference_video(oracle, data: bytes, tmp_path, **kwargs):
    _, video_cls, _, video_utils = oracle
    path = tmp_path / "clip.mp4"
    path.write_bytes(data)
    frames, metadata = video_utils.load_video(str(path), backend="pyav")
    out = video_cls(**kwargs)(
        videos=[frames], video_metadata=[metadata], return_tensors="np", return_metadata=True
    )
    return out, frames, metadata


VIDEOS = {
    # (width, height, seconds, fps, video processor settings)
    "all-frames-one-chunk": (112, 84, 0.6, 10, {}),
    "odd-size-sampled-2fps": (100, 70, 2.0, 15, {"do_sample_frames": True, "fps": 2.0}),
    "odd-frame-count-chunks": (64, 64, 1.8, 5, {}),  # 9 frames → 5 temporal patches → chunks 4 + 1
    "thirty-frames": (96, 60, 2.0, 15, {}),  # 15 temporal patches → 4 + 4 + 4 + 3
}


@pytest.mark.parametrize("case", VIDEOS, ids=list(VIDEOS))
def test_video_pixels_grids_and_chunks_equal_transformers(oracle, tmp_path, case):
    width, height, seconds, fps, settings = VIDEOS[case]
    data = make_video(width=width, height=height, seconds=seconds, fps=fps)
    reference, _, _ = _reference_video(oracle, data, tmp_path, **settings)
    config = M3ProcessorConfig(do_sample_frames=settings.get("do_sample_frames", False),
                               video_fps=settings.get("fps", 1.0))  # fmt: skip
    item = M3Preprocessor(config).process_media(data, "video")
    assert item.grids == [tuple(g) for g in reference["video_grid_thw"].tolist()]
    assert reference["num_chunks_per_video"] == [len(item.grids)]
    np.testing.assert_array_equal(item.patches, reference["pixel_values_videos"])
    assert item.num_frames == len(reference["video_metadata"][0].frames_indices)


def test_prompt_ids_equal_transformers_processor(oracle, tmp_path):
    """An image and a video in one prompt: the ids of the prompt with each marker replaced by the
    item's placeholder_text equal the processor's input_ids (timestamps, brackets, counts)."""
    image_cls, video_cls, processor_cls, video_utils = oracle
    ours, hf_tokenizer = m3_tokenizer()
    processor = processor_cls(image_cls(), hf_tokenizer, video_cls())
    image_data = encode_image(Image.fromarray(photo_array(200, 150)), "PNG")
    video_data = make_video(width=100, height=70, seconds=2.0, fps=15)
    path = tmp_path / "clip.mp4"
    path.write_bytes(video_data)
    frames, metadata = video_utils.load_video(str(path), backend="pyav")
    prompt = f"Look: {IMAGE_TOKEN} and then{VIDEO_TOKEN}\nWhat changed?"
    reference = processor(
        text=[prompt], images=[Image.open(io.BytesIO(image_data))], videos=[frames],
        video_metadata=[metadata], do_resize=True, do_sample_frames=True, fps=3.0, return_tensors="np",
    )  # fmt: skip
    preprocessor = M3Preprocessor(M3ProcessorConfig(do_sample_frames=True, video_fps=3.0))
    image = preprocessor.process_media(image_data, "image")
    video = preprocessor.process_media(video_data, "video", index=1)
    text = prompt.replace(IMAGE_TOKEN, image.placeholder_text).replace(VIDEO_TOKEN, video.placeholder_text)
    assert ours.encode(text) == reference["input_ids"][0].tolist()
    assert "]<]0.0 seconds[>[" in video.placeholder_text and video.placeholder_text.count("seconds") == 3
    image_id = hf_tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    video_id = hf_tokenizer.convert_tokens_to_ids(VIDEO_TOKEN)
    ids = reference["input_ids"][0]
    assert (ids == image_id).sum() == image.num_placeholder_tokens
    assert (ids == video_id).sum() == video.num_placeholder_tokens


def test_video_frames_capped_by_the_server_limit():
    """More sampled frames than video_max_frames: msaserve keeps max_frames, spread evenly."""
    data = make_video(width=64, height=64, seconds=2.0, fps=15)
    limits = PreprocessConfig(video_max_frames=8)
    item = M3Preprocessor(M3ProcessorConfig(), limits).process_media(data, "video")
    assert item.num_frames == 8 and item.grid_thw[0] == 4


def test_webm_without_a_frame_count_is_counted_from_its_duration():
    """WebM streams declare no frame count (the reference's reader would sample nothing): msaserve
    counts duration × frame rate, so the clip gives the same grid as its MP4 twin."""
    webm = make_video(codec="libvpx-vp9", fmt="webm", width=64, height=48, seconds=1.0, fps=10)
    mp4 = make_video(width=64, height=48, seconds=1.0, fps=10)
    a, b = (M3Preprocessor().process_media(d, "video") for d in (webm, mp4))
    assert (
        (a.grid_thw, a.grids, a.num_frames)
        == (b.grid_thw, b.grids, b.num_frames)
        == ((5, 4, 4), [(4, 4, 4), (1, 4, 4)], 10)
    )


def test_bad_media_are_4xx():
    pre = M3Preprocessor()
    with pytest.raises(MediaError) as error:
        pre.process_media(encode_image(Image.fromarray(photo_array(1000, 4)), "PNG"), "image")
    assert (error.value.status, error.value.code) == (400, "aspect_ratio_limit")
    with pytest.raises(MediaError) as error:
        pre.process_media(make_video()[:2000], "video", index=2)
    assert error.value.status == 400 and error.value.param == "content[2].video_url"


def test_pillow_memory_view_equals_asarray():
    """The zero-copy RGBX view of a decoded image holds the same RGB bytes as np.asarray; modes
    Pillow cannot export that way give None (the caller copies instead)."""
    from msaserve.preprocess.minimax_m3.pil_memory import rgbx_view, use_single_block_images

    use_single_block_images()
    image = Image.open(io.BytesIO(encode_image(Image.fromarray(photo_array(640, 480)), "JPEG")))
    image.load()
    view = rgbx_view(image)
    assert view is not None
    np.testing.assert_array_equal(view[0][..., :3], np.asarray(image))
    assert rgbx_view(image.convert("L")) is None
