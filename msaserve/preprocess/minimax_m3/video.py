"""One video → M3 frames, as transformers' PyAV reader + MiniMaxM3VLVideoProcessor produce them.

Frames are numbered in decode order (`stream.frames` of them); with `do_sample_frames` the
reference keeps `n = max(1, int(total / fps_video · fps))` indices `i · total // n`, else every
frame. msaserve caps n at `video_max_frames` (a server limit; the reference has none) with the same
uniform rule. The kept frames are converted to RGB by PyAV (`to_ndarray("rgb24")`, as the
reference), resized to the smart_resize target for videos, and the last frame is repeated up to a
whole temporal patch. The decode deadline and the decoded-frame cap of msaserve's video path apply.
"""

import time
from dataclasses import dataclass

import av
import numpy as np

from msaserve.preprocess.config import PreprocessConfig
from msaserve.preprocess.errors import MediaError
from msaserve.preprocess.minimax_m3.config import M3ProcessorConfig
from msaserve.preprocess.minimax_m3.pixels import resize_frames
from msaserve.preprocess.patchify import smart_resize
from msaserve.preprocess.video import open_video


@dataclass
class M3Video:
    frames: np.ndarray  # [T, 3, H, W] uint8 resized; T a multiple of the temporal patch
    frame_indices: list[int]  # decode-order index of each kept frame (before padding)
    fps: float | None  # the stream's average frame rate (timestamps = index / fps)
    source_size: tuple[int, int]  # (width, height) of the stream


def sample_indices(
    total: int, video_fps: float | None, config: M3ProcessorConfig, max_frames: int
) -> np.ndarray:
    """The reference's `default_sample_indices_fn`, capped at max_frames."""
    count = total
    if config.do_sample_frames and video_fps:
        count = min(total, max(1, int(total / video_fps * config.video_fps)))
    count = min(count, max_frames)
    return np.arange(count, dtype=np.int64) * total // count


def decode_video(
    data: bytes, fmt: str, config: M3ProcessorConfig, limits: PreprocessConfig, param: str | None = None
) -> M3Video:
    deadline = time.monotonic() + limits.decode_time_limit_s
    container, stream, _, duration = open_video(data, fmt, limits, param)
    try:
        fps = float(stream.average_rate) if stream.average_rate else None
        total = stream.frames or (round(duration * fps) if fps else 0)
        if total <= 0:
            raise MediaError(400, "corrupt_media", "the video declares no frames", param)
        indices = sample_indices(total, fps, config, limits.video_max_frames)
        frames = _decode_indices(container, stream, indices, limits, deadline, param)
    except av.error.FFmpegError as e:
        raise MediaError(400, "corrupt_media", f"the video is corrupt or truncated: {e}", param) from None
    finally:
        container.close()
    if not frames:
        raise MediaError(400, "corrupt_media", "no frame could be decoded from the video", param)
    raw = np.stack(frames)  # [T, H, W, 3]
    height, width = raw.shape[1:3]
    target = smart_resize(height, width, config.factor, config.video_min_pixels, config.video_max_pixels)
    resized = resize_frames(raw, *target)
    if pad := -len(resized) % config.temporal_patch_size:
        resized = np.concatenate([resized, np.repeat(resized[-1:], pad, axis=0)])
    return M3Video(resized, indices[: len(frames)].tolist(), fps, (width, height))


def _decode_indices(
    container, stream, indices: np.ndarray, limits, deadline: float, param
) -> list[np.ndarray]:
    """RGB frames at the given decode-order indices (ascending); fewer when the stream ends early."""
    wanted = set(indices.tolist())
    last = int(indices[-1])
    frames: list[np.ndarray] = []
    container.seek(0)
    for decoded, frame in enumerate(container.decode(stream)):
        if decoded > last:
            break
        if decoded >= limits.max_decoded_frames:
            raise MediaError(
                413, "video_frames_limit",
                f"sampling needed more than max_decoded_frames={limits.max_decoded_frames} decoded frames",
                param,
            )  # fmt: skip
        if time.monotonic() > deadline:
            raise MediaError(
                422, "decode_time_limit",
                f"decoding took longer than decode_time_limit_s={limits.decode_time_limit_s}", param,
            )  # fmt: skip
        if decoded in wanted:
            frames.append(frame.to_ndarray(format="rgb24"))
    return frames
