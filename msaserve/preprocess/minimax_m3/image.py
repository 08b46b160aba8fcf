"""One image → M3 patches: full decode (Pillow), EXIF orientation, alpha onto white, RGB, then the
reference's resize, normalisation and layout (msaserve.preprocess.minimax_m3.pixels).

Unlike msaserve's Qwen2-VL path there is no reduced-scale JPEG decode: the pixels must equal the
reference's, which decodes at full size. Size limits are checked from the header first.
"""

from dataclasses import dataclass

import numpy as np
from PIL import ImageOps

from msaserve.preprocess.config import PreprocessConfig
from msaserve.preprocess.errors import MediaError
from msaserve.preprocess.image import _orientation, _to_rgb, open_image
from msaserve.preprocess.minimax_m3.config import M3ProcessorConfig
from msaserve.preprocess.minimax_m3.pil_memory import rgbx_view, use_single_block_images
from msaserve.preprocess.minimax_m3.pixels import resize_frames
from msaserve.preprocess.patchify import smart_resize


@dataclass
class M3Image:
    pixels: np.ndarray  # [1, 3, H, W] uint8 after resize; H, W multiples of patch × merge
    source_size: tuple[int, int]  # (width, height) as displayed, before resize


@dataclass
class DecodedRGB:
    pixels: np.ndarray  # [H, W, C] uint8 at full size, upright; C = 3, or 4 (RGBX: the 4th is padding)
    keepalive: object = None  # what keeps `pixels` valid when it is a view of Pillow's memory


def decode_rgb(data: bytes, limits: PreprocessConfig, param: str | None = None) -> DecodedRGB:
    """Bytes of a PNG/JPEG/WebP/GIF/BMP → RGB pixels at full size, upright (a zero-copy view of
    Pillow's memory where it can export it)."""
    use_single_block_images()
    image = open_image(data, limits, param)
    try:
        image.seek(0)  # GIF/WebP: the first frame
        image.load()
        orientation = _orientation(image)
        if orientation not in (None, 1):
            image = ImageOps.exif_transpose(image)
        image = _to_rgb(image)
        view = rgbx_view(image)
        if view is not None:
            return DecodedRGB(view[0], (image, view[1]))
        return DecodedRGB(np.asarray(image))
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise MediaError(400, "corrupt_media", f"the image is corrupt or truncated: {e}", param) from None


def resize_image(decoded: DecodedRGB, config: M3ProcessorConfig) -> M3Image:
    """Decoded pixels → the image at M3's target size for images (its own memory: a view of
    Pillow's is not kept past this call)."""
    height, width = decoded.pixels.shape[:2]
    target = smart_resize(height, width, config.factor, config.image_min_pixels, config.image_max_pixels)
    # Channels are resized independently: RGBX through torch's kernel gives RGB's bytes (tested).
    resized = resize_frames(decoded.pixels[None], *target)[:, :3]
    if decoded.keepalive is not None and (height, width) == target:
        resized = resized.copy()
    return M3Image(resized, (width, height))
