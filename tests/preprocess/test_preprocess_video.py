"""Videos through the pipeline: every accepted codec, sampling, seeking, limits on work."""

import io
import math

import av
import numpy as np
import pytest
from preprocess_media import make_video, video_part

from msaserve.preprocess.config import PreprocessConfig
from msaserve.preprocess.errors import MediaError
from msaserve.preprocess.pipeline import Preprocessor
from msaserve.preprocess.video import decode_video, sample_times

# 64×64 frames stay 56×56 (a 4×4 patch grid) with this floor instead of Qwen's 100k-pixel one.
SMALL = dict(video_min_pixels=28 * 28, video_max_pixels=28 * 28 * 16)

CODECS = [
    ("libx264", "mp4"),
    ("libx265", "mp4"),
    ("libsvtav1", "mp4"),
    ("libvpx", "webm"),
    ("libvpx-vp9", "webm"),
]


@pytest.mark.parametrize("codec,fmt", CODECS)
def test_codecs_grid_and_placeholders(codec, fmt):
    data = make_video(codec, fmt, seconds=2, fps=15)
    item = Preprocessor(PreprocessConfig(**SMALL)).process([video_part(data)]).media[0]
    # 2 s at 2 fps → 4 frames → 2 temporal patches of 4×4 patches → 2·4·4/4 = 8 tokens
    assert item.kind == "video" and item.num_frames == 4
    assert item.grid_thw == (2, 4, 4)
    assert item.patches.shape == (2 * 4 * 4, 3 * 2 * 14 * 14)
    assert item.num_placeholder_tokens == 8


def test_webm_duration_comes_from_the_container():
    data = make_video("libvpx-vp9", "webm", seconds=3, fps=10)
    with av.open(io.BytesIO(data)) as container:
        assert container.streams.video[0].duration is None  # the stream does not know it
    video = decode_video(data, "webm", PreprocessConfig(**SMALL))
    assert video.duration_s == pytest.approx(3.0, abs=0.15)
    assert len(video.sample_times) == 6


def test_samples_the_frames_at_the_sample_times():
    # Frame i (at i/10 s) has red level 8·i; the sampler takes the first frame at or after
    # t - half a frame interval, i.e. i = ceil(10·t - 0.5).
    data = make_video("libx264", "mp4", seconds=3, fps=10, gop=5)
    video = decode_video(data, "mp4", PreprocessConfig(**SMALL))
    assert video.sample_times == pytest.approx([0.25, 0.75, 1.25, 1.75, 2.25, 2.75])
    red = video.frames[:, 20:36, 20:36, 0].reshape(len(video.frames), -1).mean(axis=1)
    expected = [8 * math.ceil(10 * t - 0.5 - 1e-9) for t in video.sample_times]
    np.testing.assert_allclose(red, expected, atol=6)  # H.264 + YUV rounding


def test_max_frames_spreads_samples_and_seeks():
    """A 20 s clip capped at 8 frames: samples 2.5 s apart with keyframes every 0.5 s, so the
    sampler seeks instead of decoding everything (it decodes well under half the 300 frames)."""
    data = make_video("libx264", "mp4", seconds=20, fps=15, gop=8)
    cfg = PreprocessConfig(video_max_frames=8, **SMALL)
    video = decode_video(data, "mp4", cfg)
    assert len(video.sample_times) == 8
    assert np.diff(video.sample_times) == pytest.approx([2.5] * 7)
    assert video.decoded_frames < 300 / 2
    item = Preprocessor(cfg).process([video_part(data)]).media[0]
    assert item.grid_thw == (4, 4, 4)


@pytest.mark.parametrize("duration", [0.1, 1.6, 2.0, 7.3, 31.9, 32.0, 500.0])
def test_sample_count_is_whole_temporal_patches(duration):
    cfg = PreprocessConfig()
    times = sample_times(1.0, duration, cfg)
    assert len(times) % cfg.temporal_patch_size == 0
    assert 2 <= len(times) <= cfg.video_max_frames
    assert len(times) == min(64, max(2, round(duration * 2) // 2 * 2))
    assert times[0] > 1.0 and times[-1] < 1.0 + duration


def test_decode_time_limit_is_a_4xx():
    cfg = PreprocessConfig(decode_time_limit_s=1e-9, **SMALL)
    with pytest.raises(MediaError) as error:
        Preprocessor(cfg).process([video_part(make_video())])
    assert error.value.status == 422 and error.value.code == "decode_time_limit"
    assert "decode_time_limit_s=1e-09" in error.value.message


def test_decoded_frames_cap_is_a_4xx():
    cfg = PreprocessConfig(max_decoded_frames=5, **SMALL)
    with pytest.raises(MediaError) as error:
        Preprocessor(cfg).process([video_part(make_video(seconds=2, fps=15))])
    assert error.value.status == 413 and error.value.code == "video_frames_limit"
    assert "max_decoded_frames=5" in error.value.message


def test_same_video_same_hash():
    data = make_video("libvpx-vp9", "webm")
    pre = Preprocessor(PreprocessConfig(**SMALL))
    a, b = pre.process([video_part(data), video_part(data, "video/webm")]).media
    other = pre.process([video_part(make_video("libvpx-vp9", "webm", seconds=3))]).media[0]
    assert a.content_hash == b.content_hash != other.content_hash


@pytest.mark.parametrize("rotation", [0, 90, -90])
def test_display_rotation_is_applied(rotation):
    # Stored 128×64 with the left half green (frame i > 0 paints columns < 3i green; use the last
    # frames, where the green bar covers the left ~40 columns): displayed portrait when rotated.
    data = make_video("libx264", "mp4", width=128, height=64, seconds=1, fps=10, display_rotation=rotation)
    cfg = PreprocessConfig(video_min_pixels=28 * 28, video_max_pixels=28 * 28 * 8, video_fps=2.0)
    video = decode_video(data, "mp4", cfg)
    frame = video.frames[-1].astype(int)  # [H, W, 3]
    h, w, _ = frame.shape
    green = frame[..., 1] > 128
    if rotation == 0:
        assert w > h and video.source_size == (128, 64)
        assert green[:, : w // 8].mean() > 0.9 and green[:, -w // 8 :].mean() < 0.1
    else:
        assert h > w and video.source_size == (64, 128)
        # 90° counter-clockwise moves the stored left edge to the bottom; -90° to the top
        bottom, top = green[-h // 8 :].mean(), green[: h // 8].mean()
        assert (bottom > 0.9 and top < 0.1) if rotation == 90 else (top > 0.9 and bottom < 0.1)
