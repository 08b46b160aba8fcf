"""Decode one image (Pillow) and turn it into Qwen2-VL patches.

Order: sniff → header (size limits, before any pixel is decoded) → decode (JPEGs at a reduced DCT
scale when the target is much smaller) → EXIF orientation → alpha onto white → RGB → bicubic
resize to the smart_resize target → patchify + normalise. Pillow's decompression-bomb guard stays
on; truncated files are errors (LOAD_TRUNCATED_IMAGES is never set).
"""

import io
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps

from msaserve.preprocess.config import PreprocessConfig
from msaserve.preprocess.errors import MediaError
from msaserve.preprocess.patchify import smart_resize

# EXIF orientations that swap width and height.
_TRANSPOSED_ORIENTATIONS = (5, 6, 7, 8)


@dataclass
class DecodedImage:
    """The resized RGB image, ready for patchify."""

    pixels: np.ndarray  # [H, W, 3] uint8, H and W multiples of patch × merge
    source_size: tuple[int, int]  # (width, height) as displayed, before resize


def open_image(data: bytes, config: PreprocessConfig, param: str | None = None) -> Image.Image:
    """Open (header only) and check the declared size."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:
        raise MediaError(
            413,
            "image_pixels_limit",
            f"image exceeds max_image_pixels={config.max_image_pixels} "
            f"(Pillow's decompression-bomb guard: {e})",
            param,
        ) from None
    except (OSError, SyntaxError, ValueError) as e:
        raise MediaError(400, "corrupt_media", f"cannot read the image header: {e}", param) from None
    width, height = image.size
    if width * height > config.max_image_pixels:
        raise MediaError(
            413,
            "image_pixels_limit",
            f"image is {width}×{height} = {width * height} pixels; "
            f"max_image_pixels={config.max_image_pixels}",
            param,
        )
    if width == 0 or height == 0:
        raise MediaError(400, "corrupt_media", f"image is {width}×{height}", param)
    return image


def decode_image(data: bytes, config: PreprocessConfig, param: str | None = None) -> DecodedImage:
    """Bytes of a PNG/JPEG/WebP/GIF/BMP → resized RGB pixels."""
    image = open_image(data, config, param)
    orientation = _orientation(image)
    width, height = image.size
    if orientation in _TRANSPOSED_ORIENTATIONS:
        width, height = height, width
    target_h, target_w = smart_resize(height, width, config.factor, config.min_pixels, config.max_pixels)
    try:
        if config.fast_jpeg_downscale and image.format == "JPEG":
            # libjpeg decodes at 1/2, 1/4, 1/8 scale while staying ≥ the requested size.
            stored = (target_h, target_w) if orientation in _TRANSPOSED_ORIENTATIONS else (target_w, target_h)
            image.draft("RGB", stored)
        image.seek(0)  # GIF/WebP: the first frame
        image.load()
        if orientation not in (None, 1):
            image = ImageOps.exif_transpose(image)
        image = _to_rgb(image)
        if image.size != (target_w, target_h):
            image = image.resize((target_w, target_h), Image.Resampling.BICUBIC)
        pixels = np.asarray(image)  # [H, W, 3] uint8
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise MediaError(400, "corrupt_media", f"the image is corrupt or truncated: {e}", param) from None
    return DecodedImage(pixels=pixels, source_size=(width, height))


def _orientation(image: Image.Image) -> int | None:
    try:
        return image.getexif().get(0x0112)
    except Exception:  # a malformed EXIF block is ignored, as browsers do
        return None


def _to_rgb(image: Image.Image) -> Image.Image:
    """Any mode → RGB; transparent pixels are composited onto white (not black, as convert() does)."""
    has_alpha = image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info)
    if has_alpha:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    if image.mode != "RGB":
        return image.convert("RGB")
    return image
