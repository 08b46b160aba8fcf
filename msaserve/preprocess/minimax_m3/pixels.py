"""Resize, normalisation and patch layout, bit for bit as transformers' torchvision backend does.

Resize: torch's antialiased bicubic on uint8 NCHW (what `torchvision.transforms.v2.functional.resize`
runs for uint8 on the CPU). Pillow's BICUBIC is one level off on ~0.5 % of pixels, so it is not
used. Normalisation: the reference fuses rescale into normalise, `(x - mean/r) / (std/r)` in
float32 with `r` the rescale factor; a [C, 256] table holds that value for every uint8 level and
normalising is a lookup on the rearranged uint8 patches (4× less memory traffic than floats).
"""

import warnings

import numpy as np
import torch
import torch.nn.functional as F

from msaserve.preprocess.minimax_m3.config import M3ProcessorConfig


def resize_frames(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """frames [T, H, W, 3] uint8 → [T, height, width, 3] uint8 (antialiased bicubic)."""
    if frames.shape[1:3] == (height, width):
        return frames
    with warnings.catch_warnings():  # a read-only array (np.asarray of a PIL image) is only read here
        warnings.simplefilter("ignore", UserWarning)
        nchw = torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous()
    out = F.interpolate(nchw, size=[height, width], mode="bicubic", align_corners=False, antialias=True)
    return out.permute(0, 2, 3, 1).numpy()


def normalise_table(config: M3ProcessorConfig) -> np.ndarray:
    """[C, 256] float32: the reference's fused normalised value of each uint8 level per channel."""
    mean = torch.tensor(config.image_mean) * (1.0 / config.rescale_factor)
    std = torch.tensor(config.image_std) * (1.0 / config.rescale_factor)
    levels = torch.arange(256, dtype=torch.float32)[None, :].expand(3, 256)
    return levels.sub(mean[:, None]).div(std[:, None]).numpy()
