"""Resize, normalisation and patch layout, bit for bit as transformers' torchvision backend does.

Resize: torch's antialiased bicubic on uint8 (what `torchvision.transforms.v2.functional.resize`
runs for uint8 on the CPU). Pillow's BICUBIC is one level off on ~0.5 % of pixels, so it is not
used. Normalisation: the reference fuses rescale into normalise; the same float32 operations run
here on the patches after they are rearranged as uint8 (4× less memory to move than floats). The
target size rule (`smart_resize`) and the patch layout are Qwen2-VL's (msaserve.preprocess.patchify).
"""

import warnings

import numpy as np
import torch
import torch.nn.functional as F

from msaserve.preprocess.minimax_m3.config import M3ProcessorConfig


def resize_frames(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """frames [T, H, W, C] uint8 → [T, C, height, width] uint8 (antialiased bicubic; a strided
    view of the input when it already has that size).

    The NHWC array goes to torch as a channels-last NCHW view: the same result, bit for bit, as the
    reference's contiguous NCHW copy (tested), without the copy and on torch's fast uint8 path."""
    nchw = frames.transpose(0, 3, 1, 2)
    if frames.shape[1:3] == (height, width):
        return nchw
    with warnings.catch_warnings():  # a read-only array (np.asarray of a PIL image) is only read here
        warnings.simplefilter("ignore", UserWarning)
        tensor = torch.from_numpy(frames).permute(0, 3, 1, 2)  # channels-last strides
    return F.interpolate(
        tensor, size=[height, width], mode="bicubic", align_corners=False, antialias=True
    ).numpy()


class Normaliser:
    """The reference's fused rescale + normalise, `(x - mean/r) / (std/r)` in float32, with the
    same float32 constants it builds (`torch.tensor(mean) * (1 / r)`), so values match bit for bit."""

    def __init__(self, config: M3ProcessorConfig) -> None:
        self.config = config
        self.mean = (torch.tensor(config.image_mean) * (1.0 / config.rescale_factor))[
            None, :, None
        ]  # [1, C, 1]
        self.std = (torch.tensor(config.image_std) * (1.0 / config.rescale_factor))[None, :, None]

    def patchify(self, frames: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int], np.ndarray]:
        """frames [T, C, H, W] uint8 (any strides), T = 1 (an image, repeated over the temporal patch) or a
        multiple of it; H, W multiples of patch × merge. Returns (patches [grid_t·grid_h·grid_w,
        C·tp·p·p] float32 in the order (t, h/m, w/m, m, m), rows laid out (C, tp, p, p); the grid;
        the same patches as contiguous uint8 before normalising, for the content hash)."""
        t, c, h, w = frames.shape
        p, m, tp = self.config.patch_size, self.config.merge_size, self.config.temporal_patch_size
        repeat = tp if t == 1 else 1
        if (t * repeat) % tp or h % (p * m) or w % (p * m):
            raise ValueError(
                f"patchify: frames {frames.shape} do not fit temporal {tp}, patch {p}, merge {m}"
            )
        source_tp = tp // repeat
        grid = (t * repeat // tp, h // p, w // p)
        n = grid[0] * grid[1] * grid[2]
        x = frames.reshape(grid[0], source_tp, c, grid[1] // m, m, p, grid[2] // m, m, p)
        # -> [grid_t, h/m, w/m, m, m, C, source_tp, p, p], rearranged on uint8 (4× less to move than fp32)
        raw = np.ascontiguousarray(x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)).reshape(n, c, source_tp * p * p)
        values = torch.from_numpy(raw).float().sub_(self.mean).div_(self.std)  # [n, C, source_tp·p·p]
        out = values[:, :, None].expand(n, c, repeat, source_tp * p * p).contiguous()
        return out.reshape(n, c * tp * p * p).numpy(), grid, raw
