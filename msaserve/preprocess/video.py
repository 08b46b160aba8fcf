"""Decode one video (PyAV) into sampled, resized RGB frames.

Frames are sampled at `video_fps` (at most `video_max_frames`, spread evenly) at the midpoints of
equal intervals. The sampler seeks to a keyframe when the next sample is further away than the
GOP it has observed, and otherwise decodes forward; while the next sample is still far ahead it
tells the decoder to skip non-reference frames (nothing depends on them), and only the sampled
frames are colour-converted and scaled (by swscale, in one step). A decode deadline and a cap on
decoded frames are checked between frames, so a worker never hangs on a hostile file.
"""

import io
import math
import time
from dataclasses import dataclass

import av
import numpy as np
from av.video.reformatter import VideoReformatter

from msaserve.preprocess.config import PreprocessConfig
from msaserve.preprocess.errors import MediaError
from msaserve.preprocess.patchify import smart_resize

# Decoder names PyAV reports per container (AV1 decodes through libdav1d).
ALLOWED_CODECS = {
    "mp4": {"h264", "hevc", "av1", "libdav1d"},
    "webm": {"vp8", "vp9", "av1", "libdav1d", "libvpx", "libvpx-vp9"},
}


@dataclass
class DecodedVideo:
    frames: np.ndarray  # [T, H, W, 3] uint8; T a multiple of temporal_patch_size
    sample_times: list[float]  # seconds of each sampled frame (before padding)
    duration_s: float
    decoded_frames: int  # frames the decoder produced (sampled or not)
    source_size: tuple[int, int]  # (width, height) of the stream


def sample_times(start: float, duration: float, config: PreprocessConfig) -> list[float]:
    """Midpoints of n equal intervals: n = duration × fps, in [temporal, max_frames], a multiple
    of the temporal patch size."""
    tp = config.temporal_patch_size
    n = min(config.video_max_frames, max(tp, round(duration * config.video_fps)))
    n -= n % tp
    return [start + (i + 0.5) * duration / n for i in range(n)]


def decode_video(data: bytes, fmt: str, config: PreprocessConfig, param: str | None = None) -> DecodedVideo:
    """Bytes of an MP4/WebM → sampled frames resized to the smart_resize target."""
    deadline = time.monotonic() + config.decode_time_limit_s
    container, stream, start, duration = open_video(data, fmt, config, param)
    try:
        width, height = stream.codec_context.width, stream.codec_context.height
        if width <= 0 or height <= 0:
            raise MediaError(400, "corrupt_media", f"video frame size is {width}×{height}", param)
        target = smart_resize(height, width, config.factor, config.video_min_pixels, config.video_max_pixels)
        times = sample_times(start, duration, config)
        sampler = _Sampler(container, stream, target, config, deadline, param)
        frames = sampler.sample(times)
    except av.error.FFmpegError as e:
        raise MediaError(400, "corrupt_media", f"the video is corrupt or truncated: {e}", param) from None
    finally:
        container.close()
    if not frames:
        raise MediaError(400, "corrupt_media", "no frame could be decoded from the video", param)
    sampled = len(frames)
    while len(frames) % config.temporal_patch_size:
        frames.append(frames[-1])  # pad the last temporal patch by repeating the last frame
    shown = (height, width) if sampler.quarter_turns % 2 else (width, height)
    return DecodedVideo(np.stack(frames), times[:sampled], duration, sampler.decoded, shown)


def open_video(
    data: bytes, fmt: str, config: PreprocessConfig, param: str | None = None
) -> tuple[av.container.InputContainer, av.video.stream.VideoStream, float, float]:
    """Open an MP4/WebM, check its first video stream's codec and its duration against the limits →
    (container, stream, start s, duration s). The caller closes the container; on an error it is
    closed here and a 4xx MediaError raised."""
    try:
        container = av.open(io.BytesIO(data), mode="r", metadata_errors="ignore")
    except (av.error.FFmpegError, ValueError, OSError) as e:
        raise MediaError(400, "corrupt_media", f"cannot open the video: {e}", param) from None
    try:
        if not container.streams.video:
            raise MediaError(400, "no_video_stream", "the file has no video stream", param)
        stream = container.streams.video[0]
        _check_codec(stream, fmt, param)
        stream.codec_context.thread_count = config.video_decoder_threads
        start, duration = _start_and_duration(stream, container, config, param)
    except BaseException:
        container.close()
        raise
    return container, stream, start, duration


def _check_codec(stream: av.video.stream.VideoStream, fmt: str, param: str | None) -> None:
    # A stream whose codec FFmpeg cannot identify (or a damaged header) has no decoder context.
    name = stream.codec_context.name if stream.codec_context is not None else "unknown"
    if name not in ALLOWED_CODECS[fmt]:
        allowed = "H.264, HEVC, AV1" if fmt == "mp4" else "VP8, VP9, AV1"
        raise MediaError(
            415, "unsupported_codec", f"{fmt} video codec {name!r} is not supported; {fmt}: {allowed}", param
        )


def _start_and_duration(
    stream, container, config: PreprocessConfig, param: str | None
) -> tuple[float, float]:
    """(start, duration) in seconds; WebM streams carry no duration, so fall back to the container's."""
    base = stream.time_base
    start = float(stream.start_time * base) if stream.start_time is not None and base else 0.0
    if stream.duration and base:
        duration = float(stream.duration * base)
    elif container.duration:
        duration = container.duration / av.time_base
    else:
        raise MediaError(400, "corrupt_media", "the video declares no duration", param)
    if not math.isfinite(duration) or duration <= 0:
        raise MediaError(400, "corrupt_media", f"the video declares a duration of {duration} s", param)
    if duration > config.video_max_duration_s:
        raise MediaError(
            413,
            "video_duration_limit",
            f"video is {duration:.1f} s long; video_max_duration_s={config.video_max_duration_s}",
            param,
        )
    return start, duration


class _Sampler:
    """Walks one stream once, seeking forward when that is cheaper than decoding forward."""

    def __init__(self, container, stream, target_hw: tuple[int, int], config, deadline: float, param) -> None:
        self.container = container
        self.stream = stream
        self.target_h, self.target_w = target_hw
        self.config = config
        self.deadline = deadline
        self.param = param
        rate = stream.average_rate or stream.guessed_rate
        self.frame_s = 1 / float(rate) if rate else 1 / 30
        self.gop_s = 0.0  # largest keyframe distance seen so far (a lower bound of the real GOP)
        self.decoded = 0
        self.frames_iter = None
        self.last = None  # last decoded frame (it may also serve the next sample)
        self.last_key_time: float | None = None
        self.after_seek: float | None = None  # the target of a seek whose landing is not seen yet
        self.reformatter = VideoReformatter()  # reused: its scaler context is cached across frames
        self.quarter_turns = 0  # display rotation of the sampled frames, in counter-clockwise 90° turns

    def sample(self, times: list[float]) -> list[np.ndarray]:
        frames: list[np.ndarray] = []
        for target in times:
            frame = self._frame_at(target)
            if frame is None:
                break  # the stream ended before this sample: the container overstated its length
            # Colour conversion and scaling in one swscale pass, only for the sampled frames.
            rgb = self.reformatter.reformat(
                frame, width=self.target_w, height=self.target_h, format="rgb24", interpolation="BICUBIC"
            )
            pixels = rgb.to_ndarray()  # [H, W, 3] uint8
            # Phone videos store a display rotation (counter-clockwise degrees); smart_resize is
            # symmetric in H and W, so rotating the resized frame keeps both sides multiples.
            self.quarter_turns = round((frame.rotation or 0) / 90) % 4
            frames.append(
                np.ascontiguousarray(np.rot90(pixels, self.quarter_turns)) if self.quarter_turns else pixels
            )
        return frames

    def _frame_at(self, target: float):
        tolerance = self.frame_s / 2
        if self.last is not None and self.last.time is not None and self.last.time >= target - tolerance:
            return self.last
        position = self.last.time if self.last is not None and self.last.time is not None else -math.inf
        if self.frames_iter is None or target - position > max(self.gop_s, 2 * self.frame_s):
            self._seek(target)
        context = self.stream.codec_context
        for frame in self.frames_iter:
            self._count(frame)
            if frame.time is None:
                continue
            if self.after_seek is not None:
                # How far back the seek landed bounds the GOP from below.
                self.gop_s = max(self.gop_s, target - frame.time)
                self.after_seek = None
            self.last = frame
            if frame.time >= target - tolerance:
                context.skip_frame = "DEFAULT"
                return frame
            # Far from the sample: frames no other frame references need not be decoded at all.
            # The margin covers the decoder's reordering delay (frames out lag packets in).
            far = target - frame.time > 8 * self.frame_s
            context.skip_frame = "NONREF" if far else "DEFAULT"
        return None

    def _seek(self, target: float) -> None:
        self.stream.codec_context.skip_frame = "DEFAULT"
        self.container.seek(
            int(target / self.stream.time_base), stream=self.stream, backward=True, any_frame=False
        )
        self.frames_iter = self.container.decode(self.stream)
        self.after_seek = target
        self.last_key_time = None  # keyframe distances are measured within one forward run

    def _count(self, frame) -> None:
        self.decoded += 1
        if frame.key_frame and frame.time is not None:
            if self.last_key_time is not None and frame.time > self.last_key_time:
                self.gop_s = max(self.gop_s, frame.time - self.last_key_time)
            self.last_key_time = frame.time
        if self.decoded > self.config.max_decoded_frames:
            raise MediaError(
                413,
                "video_frames_limit",
                f"sampling needed more than max_decoded_frames={self.config.max_decoded_frames} "
                "decoded frames",
                self.param,
            )
        if time.monotonic() > self.deadline:
            raise MediaError(
                422,
                "decode_time_limit",
                f"decoding took longer than decode_time_limit_s={self.config.decode_time_limit_s}",
                self.param,
            )
