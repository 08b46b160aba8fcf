"""Limits and geometry of the media pipeline, checked once at construction.

Field names match the user-facing `PreprocessLimits` (limits.py), whose defaults these take, so the
platform builds this with `PreprocessConfig(**limits.model_dump())`; the geometry fields (patch,
merge, temporal patch, mean, std) are Qwen2-VL's and must match the vision tower the model was trained with.
"""

from dataclasses import dataclass

from PIL import Image

from msaserve.preprocess.limits import limit_default

MiB = 1 << 20

# Qwen2-VL uses OpenAI CLIP's normalisation.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class PreprocessConfig:
    # Geometry (Qwen2-VL).
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD
    # Images: target size after resize (smart_resize keeps it within [min_pixels, max_pixels]).
    min_pixels: int = limit_default("min_pixels")
    max_pixels: int = limit_default("max_pixels")
    max_image_bytes: int = limit_default("max_image_bytes")
    max_image_pixels: int = limit_default("max_image_pixels")  # decoded width × height, from the header
    # Decode JPEGs at 1/2, 1/4 or 1/8 scale (libjpeg's DCT scaling) when the target is that much
    # smaller; the result differs slightly from a full decode + bicubic (see docs/performance-preprocess.md).
    fast_jpeg_downscale: bool = True
    # Video.
    video_fps: float = limit_default("video_fps")
    video_max_frames: int = limit_default("video_max_frames")
    video_max_duration_s: float = limit_default("video_max_duration_s")
    video_min_pixels: int = 128 * 28 * 28  # per frame
    video_max_pixels: int = 768 * 28 * 28  # per frame
    max_video_bytes: int = limit_default("max_video_bytes")
    max_decoded_frames: int = 20_000  # frames the decoder may decode for one video (sampled or not)
    decode_time_limit_s: float = 30.0  # per medium; checked between packets / frames
    video_decoder_threads: int = 1  # FFmpeg decoder threads (0 = one per core); a replica has 1 CPU
    # Requests.
    max_items_per_request: int = limit_default("max_items_per_request")
    # Sources.
    allow_file_urls: bool = limit_default("allow_file_urls")
    file_roots: tuple[str, ...] = ()  # file:// paths must lie under one of these; empty = any path
    allow_http_urls: bool = limit_default("allow_http_urls")
    allowed_hosts: tuple[str, ...] = limit_default("allowed_hosts")  # exact, or ".example.com"; empty = any
    allow_private_addresses: bool = limit_default("allow_private_addresses")
    allowed_private_networks: tuple[str, ...] = ()  # CIDRs exempt from the private-address guard
    fetch_timeout_s: float = limit_default("fetch_timeout_s")
    max_redirects: int = limit_default("max_redirects")

    def __post_init__(self) -> None:
        object.__setattr__(self, "allowed_hosts", tuple(self.allowed_hosts))
        object.__setattr__(self, "file_roots", tuple(self.file_roots))
        object.__setattr__(self, "allowed_private_networks", tuple(self.allowed_private_networks))
        positive = (
            "patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_pixels",
            "max_image_bytes", "max_image_pixels", "video_max_frames", "video_min_pixels",
            "video_max_pixels", "max_video_bytes", "max_decoded_frames",
        )  # fmt: skip
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"PreprocessConfig.{name}={getattr(self, name)} must be > 0")
        for name in ("video_fps", "video_max_duration_s", "decode_time_limit_s", "fetch_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"PreprocessConfig.{name}={getattr(self, name)} must be > 0")
        for name in ("max_items_per_request", "max_redirects", "video_decoder_threads"):
            if getattr(self, name) < 0:
                raise ValueError(f"PreprocessConfig.{name}={getattr(self, name)} must be ≥ 0")
        if self.min_pixels > self.max_pixels or self.video_min_pixels > self.video_max_pixels:
            raise ValueError(
                f"PreprocessConfig: min_pixels={self.min_pixels} must be ≤ max_pixels={self.max_pixels} "
                f"and video_min_pixels={self.video_min_pixels} ≤ video_max_pixels={self.video_max_pixels}"
            )
        if self.video_max_frames % self.temporal_patch_size:
            raise ValueError(
                f"PreprocessConfig.video_max_frames={self.video_max_frames} must be a multiple of "
                f"temporal_patch_size={self.temporal_patch_size}"
            )
        if self.max_image_pixels > Image.MAX_IMAGE_PIXELS:
            # Above this Pillow's decompression-bomb guard (which stays on) refuses first.
            raise ValueError(
                f"PreprocessConfig.max_image_pixels={self.max_image_pixels} must be ≤ Pillow's "
                f"MAX_IMAGE_PIXELS={Image.MAX_IMAGE_PIXELS}"
            )
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or min(self.image_std) <= 0:
            raise ValueError("PreprocessConfig.image_mean/image_std must be 3 values, std > 0")

    @property
    def factor(self) -> int:
        """Both sides of a resized image are multiples of this (one merged token is factor × factor)."""
        return self.patch_size * self.merge_size
