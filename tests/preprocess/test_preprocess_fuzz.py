"""Damaged media never escape as anything but MediaError: seeded truncations and byte flips of
valid PNG, JPEG, WebP, GIF, MP4 and WebM files either decode or raise a 4xx MediaError."""

import random
import zlib

import pytest
from preprocess_media import make_image, make_video

from msaserve.preprocess.config import PreprocessConfig
from msaserve.preprocess.errors import MediaError
from msaserve.preprocess.pipeline import Preprocessor

PRE = Preprocessor(
    PreprocessConfig(video_min_pixels=28 * 28, video_max_pixels=28 * 28 * 16, decode_time_limit_s=5)
)
SOURCES = {
    "png": ("image", lambda: make_image(64, 48, "PNG")),
    "jpeg": ("image", lambda: make_image(64, 48, "JPEG")),
    "webp": ("image", lambda: make_image(64, 48, "WEBP")),
    "gif": ("image", lambda: make_image(64, 48, "GIF")),
    "mp4": ("video", lambda: make_video("libx264", "mp4", seconds=1)),
    "webm": ("video", lambda: make_video("libvpx-vp9", "webm", seconds=1)),
}


def mutations(data: bytes, seed: int, count: int) -> list[bytes]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        damaged = bytearray(data)
        if rng.random() < 0.4:
            damaged = damaged[: rng.randrange(1, len(data))]  # truncated
        for _ in range(rng.randrange(1, 8)):  # flipped bytes, the magic bytes kept
            position = rng.randrange(min(16, len(damaged) - 1), len(damaged)) if len(damaged) > 16 else 0
            damaged[position] ^= 1 << rng.randrange(8)
        out.append(bytes(damaged))
    return out


@pytest.mark.parametrize("name", list(SOURCES))
def test_damaged_media_give_media_error_or_a_result(name):
    kind, make = SOURCES[name]
    outcomes = {"ok": 0, "error": 0}
    for index, damaged in enumerate(mutations(make(), seed=zlib.crc32(name.encode()), count=25)):
        try:
            item = PRE.process_media(damaged, kind, index)
            assert item.patches.shape[0] == item.grid_thw[0] * item.grid_thw[1] * item.grid_thw[2]
            outcomes["ok"] += 1
        except MediaError as error:
            assert 400 <= error.status < 500 and error.param == f"content[{index}].{kind}_url"
            outcomes["error"] += 1
    assert outcomes["error"] > 0  # the corpus did damage something
