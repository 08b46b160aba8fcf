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
from msaserve.preprocess.minimax_m3.pixels import resize_frames
from msaserve.preprocess.patchify import smart_resize


@dataclass
class M3Image:
    pixels: np.ndarray  # [1, 3, H, W] uint8 after resize; H, W multiples of patch × merge
    source_size: tuple[int, int]  # (width, height) as displayed, before resize


def decode_rgb(data: bytes, limits: PreprocessConfig, param: str | None = None) -> np.ndarray:
    """Bytes of a PNG/JPEG/WebP/GIF/BMP → [H, W, 3] uint8 at full size, upright."""
    image = open_image(data, limits, param)
    try:
        image.seek(0)  # GIF/WebP: the first frame
        image.load()
        orientation = _orientation(image)
        if orientation not in (None, 1):
            image = ImageOps.exif_transpose(image)
        return np.asarray(_to_rgb(image))
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise MediaError(400, "corrupt_media", f"the image is corrupt or truncated: {e}", param) from None


def resize_image(rgb: np.ndarray, config: M3ProcessorConfig) -> M3Image:
    """[H, W, 3] uint8 → the image at M3's target size for images."""
    height, width = rgb.shape[:2]
    target = smart_resize(height, width, config.factor, config.image_min_pixels, config.image_max_pixels)
    return M3Image(resize_frames(rgb[None], *target), (width, height))
