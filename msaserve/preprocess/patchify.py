"""Qwen2-VL's geometry: the target size rule (`smart_resize`), normalisation and the patch layout.

Layout (what the vision tower expects): frames `[T, H, W, C]` uint8 become
`[grid_t * grid_h * grid_w, C * temporal * patch * patch]` float32, patches ordered
(t, h-block, w-block, h-in-merge, w-in-merge) so that each run of `merge²` consecutive rows is
one 2×2 group the merger fuses into one LM token.
"""

import math

import numpy as np

from msaserve.preprocess.config import PreprocessConfig
from msaserve.preprocess.errors import MediaError

MAX_ASPECT_RATIO = 200


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's rule: both sides multiples of `factor`, area within [min_pixels, max_pixels],
    aspect ratio kept as closely as possible. Same arithmetic as transformers' `smart_resize`."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise MediaError(
            400,
            "aspect_ratio_limit",
            f"image is {width}×{height}; aspect ratio must be ≤ {MAX_ASPECT_RATIO}",
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def normalise_table(config: PreprocessConfig) -> np.ndarray:
    """[C, 256] float32: the normalised value of each uint8 level per channel, so normalising
    is a table lookup on uint8 patches instead of float arithmetic on the whole frame."""
    levels = (np.arange(256, dtype=np.float64) * (1 / 255)).astype(np.float32)  # as transformers rescales
    mean = np.asarray(config.image_mean, dtype=np.float32)[:, None]
    std = np.asarray(config.image_std, dtype=np.float32)[:, None]
    return ((levels[None, :] - mean) / std).astype(np.float32)


def patchify(
    frames: np.ndarray, config: PreprocessConfig, table: np.ndarray
) -> tuple[np.ndarray, tuple[int, int, int]]:
    """frames: [T, H, W, C] uint8, T = 1 (a still image, repeated over the temporal patch, as
    Qwen2-VL does) or a multiple of temporal_patch_size; H, W multiples of patch × merge.
    Returns (patches [grid_t*grid_h*grid_w, C*temporal*patch*patch] float32, grid_thw)."""
    t, h, w, c = frames.shape
    p, m, tp = config.patch_size, config.merge_size, config.temporal_patch_size
    repeat = tp if t == 1 else 1
    if (t * repeat) % tp or h % (p * m) or w % (p * m):
        raise ValueError(f"patchify: frames {frames.shape} do not fit temporal {tp}, patch {p}, merge {m}")
    source_tp = tp // repeat
    grid_t, grid_h, grid_w = t * repeat // tp, h // p, w // p
    n = grid_t * grid_h * grid_w
    x = frames.reshape(grid_t, source_tp, grid_h // m, m, p, grid_w // m, m, p, c)
    # -> [grid_t, gh/m, gw/m, m, m, C, source_tp, p, p], rearranged on uint8 (4× less to move than fp32)
    x = x.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)
    x = np.ascontiguousarray(x).reshape(n, c, source_tp * p * p)
    out = np.empty((n, c, repeat, source_tp * p * p), dtype=np.float32)
    values = np.empty((n, source_tp * p * p), dtype=np.float32)
    for channel in range(c):
        np.take(table[channel], x[:, channel], out=values)  # normalise by table lookup
        for r in range(repeat):
            out[:, channel, r] = values
    return out.reshape(n, c * tp * p * p), (grid_t, grid_h, grid_w)


def num_placeholder_tokens(grid_thw: tuple[int, int, int], merge_size: int) -> int:
    """LM tokens a medium becomes: each merge × merge group of patches is one token."""
    t, h, w = grid_thw
    return t * h * w // (merge_size * merge_size)
