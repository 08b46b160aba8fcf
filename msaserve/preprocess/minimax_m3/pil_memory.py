"""A zero-copy numpy view of a decoded Pillow RGB image, through Pillow's Arrow export.

`np.asarray(image)` copies the pixels out through Pillow's chunked `tobytes` (about a third of the
time of a 12 MP JPEG on one core). Pillow keeps an RGB image as 4 bytes a pixel (RGBX) and, when
its rows lie in one memory block, exports them through the Arrow C data interface: a
fixed-size list of 4 uint8 per pixel whose child buffer is the pixel memory itself. The view is
[H, W, 4] (the 4th byte is padding); it stays valid while the returned capsule is referenced.
Pillow places an image in one block when it fits the block size, so the module raises Pillow's
block size to hold the largest image the preprocess limits admit.
"""

import ctypes

import numpy as np
from PIL import Image

# 256 MiB: an RGBX image of 64 M pixels; PreprocessConfig.max_image_pixels is at most 50 M by default.
_BLOCK_SIZE = 1 << 28


class _ArrowArray(ctypes.Structure):
    """The Arrow C data interface's ArrowArray (a stable ABI)."""


_ArrowArray._fields_ = [
    ("length", ctypes.c_int64),
    ("null_count", ctypes.c_int64),
    ("offset", ctypes.c_int64),
    ("n_buffers", ctypes.c_int64),
    ("n_children", ctypes.c_int64),
    ("buffers", ctypes.POINTER(ctypes.c_void_p)),
    ("children", ctypes.POINTER(ctypes.POINTER(_ArrowArray))),
    ("dictionary", ctypes.POINTER(_ArrowArray)),
    ("release", ctypes.CFUNCTYPE(None, ctypes.POINTER(_ArrowArray))),
    ("private_data", ctypes.c_void_p),
]

_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def use_single_block_images() -> None:
    """Let Pillow allocate each image (up to 256 MiB) as one block, so it can be exported."""
    if Image.core.get_block_size() < _BLOCK_SIZE:
        Image.core.set_block_size(_BLOCK_SIZE)


def rgbx_view(image: Image.Image) -> tuple[np.ndarray, object] | None:
    """(pixels [H, W, 4] uint8 sharing the image's memory, the capsule keeping it alive), or None
    when Pillow cannot export this image (another mode, rows in several blocks)."""
    if image.mode != "RGB":
        return None
    try:
        _, capsule = image.__arrow_c_array__()
    except (ValueError, AttributeError):
        return None
    array = _ArrowArray.from_address(_capsule_pointer(capsule, b"arrow_array"))
    width, height = image.size
    if array.n_children != 1 or array.length != width * height:
        return None
    child = array.children[0].contents
    if child.n_buffers != 2 or child.length != 4 * width * height or child.offset or array.offset:
        return None
    data = ctypes.cast(child.buffers[1], ctypes.POINTER(ctypes.c_uint8))
    return np.ctypeslib.as_array(data, shape=(height, width, 4)), capsule
