"""Images through the pipeline: formats, geometry, EXIF, alpha, hashes, and equality with
transformers' Qwen2-VL image processor."""

import dataclasses
import io

import numpy as np
import pytest
from PIL import Image
from preprocess_media import encode_image, image_part, make_image, photo_array, with_exif_orientation

from msaserve.preprocess.config import PreprocessConfig
from msaserve.preprocess.image import decode_image
from msaserve.preprocess.patchify import smart_resize
from msaserve.preprocess.pipeline import Preprocessor


@pytest.fixture(scope="module")
def pre() -> Preprocessor:
    return Preprocessor(PreprocessConfig())


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
@pytest.mark.parametrize("size", [(120, 90), (33, 301), (500, 28)])
def test_formats_grid_and_placeholders(pre, fmt, size):
    width, height = size
    item = pre.process([{"type": "text", "text": "look"}, image_part(make_image(width, height, fmt))]).media[
        0
    ]
    target_h, target_w = smart_resize(height, width, 28, pre.config.min_pixels, pre.config.max_pixels)
    assert item.kind == "image"
    assert item.grid_thw == (1, target_h // 14, target_w // 14)
    assert item.patches.shape == (target_h * target_w // 196, 3 * 2 * 14 * 14)
    assert item.patches.dtype == np.float32
    assert item.num_placeholder_tokens == target_h * target_w // (28 * 28)
    assert item.source_size == (width, height)


@pytest.mark.parametrize("height,width", [(90, 120), (3000, 4000), (10, 10), (28, 5000), (1080, 1920)])
def test_smart_resize_bounds(height, width):
    cfg = PreprocessConfig()
    h, w = smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    assert h % 28 == 0 and w % 28 == 0
    assert cfg.min_pixels <= h * w <= cfg.max_pixels
    assert abs(np.log((w / h) / (width / height))) < 0.5  # aspect kept (loosely, for tiny sides)


def test_gif_first_frame():
    frames = [Image.new("RGB", (56, 56), colour) for colour in ((255, 0, 0), (0, 0, 255))]
    buffer = io.BytesIO()
    frames[0].save(buffer, "GIF", save_all=True, append_images=frames[1:], duration=100)
    pixels = decode_image(buffer.getvalue(), PreprocessConfig()).pixels
    assert tuple(pixels[28, 28]) == (255, 0, 0)


@pytest.mark.parametrize(
    "orientation,expected_size", [(1, (80, 40)), (3, (80, 40)), (6, (40, 80)), (8, (40, 80))]
)
def test_exif_orientation(orientation, expected_size):
    # Stored 80×40: left half black, right half white. Orientation 6 = rotate 90° clockwise to display.
    array = np.zeros((40, 80, 3), np.uint8)
    array[:, 40:] = 255
    data = with_exif_orientation(Image.fromarray(array), orientation)
    cfg = PreprocessConfig(min_pixels=28 * 28, max_pixels=28 * 28 * 64)
    image = decode_image(data, cfg)
    assert image.source_size == expected_size
    pixels = image.pixels.astype(int)
    h, w, _ = pixels.shape
    assert (w > h) == (expected_size[0] > expected_size[1])
    if orientation == 1:
        assert pixels[:, : w // 4].mean() < 30 and pixels[:, -w // 4 :].mean() > 225
    if orientation == 3:  # rotated 180°: white on the left
        assert pixels[:, : w // 4].mean() > 225
    if orientation == 6:  # 90° clockwise: the stored left (black) ends up on top
        assert pixels[: h // 4].mean() < 30 and pixels[-h // 4 :].mean() > 225
    if orientation == 8:  # 90° counter-clockwise: black at the bottom
        assert pixels[: h // 4].mean() > 225 and pixels[-h // 4 :].mean() < 30


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P"])
def test_alpha_composited_on_white(mode):
    if mode == "P":  # palette image whose index 0 is transparent
        image = Image.new("P", (56, 56), 0)
        image.putpalette([0, 0, 0, 200, 0, 0] + [0] * 762)
        image.paste(1, (0, 0, 28, 56))
        image.info["transparency"] = 0
    else:
        rgba = Image.new("RGBA", (56, 56), (0, 0, 0, 0))  # fully transparent black
        rgba.paste((200, 0, 0, 255), (0, 0, 28, 56))  # opaque red left half
        image = rgba.convert(mode)
    pixels = decode_image(encode_image(image, "PNG"), PreprocessConfig()).pixels
    assert tuple(pixels[28, 50]) == (255, 255, 255)  # transparent → white, not black
    assert pixels[28, 5].mean() < 100  # the opaque half stays dark


def test_same_image_same_hash_any_container(pre):
    array = photo_array(160, 120, seed=3)
    png = encode_image(Image.fromarray(array), "PNG")
    bmp = encode_image(Image.fromarray(array), "BMP")
    other = encode_image(Image.fromarray(photo_array(160, 120, seed=4)), "PNG")
    items = pre.process([image_part(png), image_part(png), image_part(bmp), image_part(other)]).media
    assert items[0].content_hash == items[1].content_hash == items[2].content_hash  # same pixels
    assert items[0].content_hash != items[3].content_hash
    assert 0 <= items[0].content_hash < 2**64
    np.testing.assert_array_equal(items[0].patches, items[2].patches)


@pytest.mark.parametrize("size,fmt", [((640, 480), "JPEG"), ((1000, 700), "PNG"), ((2000, 1500), "JPEG")])
def test_matches_transformers_qwen2vl_processor(size, fmt):
    """Exact mode (full decode + Pillow bicubic) equals transformers' PIL Qwen2-VL processor to
    within 1e-6 (float32 rounding; observed: bit-identical)."""
    processing = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    data = make_image(*size, fmt=fmt, seed=7, **({"quality": 90} if fmt == "JPEG" else {}))
    cfg = PreprocessConfig(fast_jpeg_downscale=False)
    item = Preprocessor(cfg).process([image_part(data)]).media[0]
    reference = processing.Qwen2VLImageProcessorPil(min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels)
    out = reference(Image.open(io.BytesIO(data)).convert("RGB"), return_tensors="np")
    assert tuple(out["image_grid_thw"][0]) == item.grid_thw
    np.testing.assert_allclose(item.patches, out["pixel_values"], rtol=0, atol=1e-6)


def test_fast_jpeg_downscale_close_to_exact():
    """Reduced-scale JPEG decoding changes the resampling path, not the picture: same grid, and
    mean absolute difference below 0.02 in normalised units (≈ 1.3 grey levels of 255)."""
    data = make_image(2400, 1800, fmt="JPEG", seed=8, quality=90)
    exact = Preprocessor(PreprocessConfig(fast_jpeg_downscale=False)).process([image_part(data)]).media[0]
    fast = Preprocessor(PreprocessConfig(fast_jpeg_downscale=True)).process([image_part(data)]).media[0]
    assert exact.grid_thw == fast.grid_thw
    assert np.abs(exact.patches - fast.patches).mean() < 0.02


def test_exif_rotation_with_reduced_scale_jpeg_decoding():
    # Stored 1600×400 (black left, white right), shown rotated 90° clockwise: 400×1600 portrait.
    array = np.zeros((400, 1600, 3), np.uint8)
    array[:, 800:] = 255
    data = with_exif_orientation(Image.fromarray(array), 6)
    cfg = PreprocessConfig(min_pixels=28 * 28, max_pixels=28 * 28 * 16)  # target ≪ source: 1/8 decode
    fast, exact = (decode_image(data, dataclasses.replace(cfg, fast_jpeg_downscale=f)) for f in (True, False))
    assert fast.pixels.shape == exact.pixels.shape and fast.pixels.shape[0] > fast.pixels.shape[1]
    h = fast.pixels.shape[0]
    assert fast.pixels[: h // 4].mean() < 30 and fast.pixels[-h // 4 :].mean() > 225
    assert np.abs(fast.pixels.astype(int) - exact.pixels).mean() < 3
