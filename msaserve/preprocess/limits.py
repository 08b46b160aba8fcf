"""What the media pipeline accepts, as the user sets it: the `preprocess:` section of `ServeConfig`
(pydantic at the edge). `PreprocessConfig` (config.py) adds the model's geometry and takes every
default it shares with these from here."""

from typing import Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

MiB = 1 << 20


class PreprocessLimits(BaseModel):
    """The `preprocess:` section of `ServeConfig`: what the media pipeline accepts. `PreprocessConfig`
    takes the defaults it shares with it from here."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    max_image_bytes: int = Field(20 * MiB, ge=1024, le=1 << 32, description="Largest encoded image accepted.")
    max_image_pixels: int = Field(
        50_000_000, ge=64, le=178_956_970, description="Largest decoded image (width × height) accepted."
    )
    min_pixels: int = Field(
        3136, ge=64, le=1 << 28, description="Images are upscaled to at least this many pixels."
    )
    max_pixels: int = Field(
        1_003_520, ge=64, le=1 << 28, description="Images are downscaled to at most this many pixels."
    )
    max_video_bytes: int = Field(
        200 * MiB, ge=1024, le=1 << 36, description="Largest encoded video accepted."
    )
    video_fps: float = Field(2.0, gt=0.0, le=60.0, description="Frames sampled per second of video.")
    video_max_frames: int = Field(64, ge=2, le=4096, description="Most frames sampled from one video.")
    video_max_duration_s: float = Field(
        600.0, gt=0.0, le=86_400.0, description="Longest video accepted, in seconds."
    )
    max_items_per_request: int = Field(8, ge=0, le=1024, description="Images + videos in one request.")
    allow_file_urls: bool = Field(False, description="Accept file:// URLs (local deployments only).")
    allow_http_urls: bool = Field(
        False, description="Fetch http(s):// URLs (data: URLs are always accepted)."
    )
    allowed_hosts: list[str] = Field(
        default_factory=list, description="Hosts http(s) URLs may name; empty = any public host."
    )
    allow_private_addresses: bool = Field(
        False, description="Allow fetching from private, loopback and link-local addresses."
    )
    fetch_timeout_s: float = Field(10.0, gt=0.0, le=600.0, description="Time limit of one media fetch.")
    max_redirects: int = Field(3, ge=0, le=20, description="Redirects followed by one media fetch.")

    @model_validator(mode="after")
    def _pixel_range(self) -> Self:
        if self.min_pixels > self.max_pixels:
            raise ValueError(
                f"preprocess.min_pixels={self.min_pixels} must be ≤ preprocess.max_pixels={self.max_pixels}"
            )
        return self


def limit_default(name: str):
    """The default of a `PreprocessLimits` field."""
    field = PreprocessLimits.model_fields[name]
    return tuple(field.default_factory()) if field.default_factory else field.default
