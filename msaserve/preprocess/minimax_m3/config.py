"""M3's processor settings, read from a checkpoint directory.

`processor_config.json` (what transformers' `MiniMaxM3VLProcessor.save_pretrained` writes: an
`image_processor` and a `video_processor` object) or the older pair `preprocessor_config.json` +
`video_preprocessor_config.json`. Missing keys take the reference classes' defaults.
"""

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGE_PROCESSOR_TYPE = "MiniMaxM3VLImageProcessor"
VIDEO_PROCESSOR_TYPE = "MiniMaxM3VLVideoProcessor"


@dataclass(frozen=True)
class M3ProcessorConfig:
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD
    rescale_factor: float = 1 / 255
    image_min_pixels: int = 4 * 28 * 28  # the image processor's size.shortest_edge
    image_max_pixels: int = 451584  # size.longest_edge (576 · 28²)
    video_min_pixels: int = 4 * 28 * 28  # per frame
    video_max_pixels: int = 768 * 28 * 28
    video_fps: float = 1.0  # frames sampled per second of video when do_sample_frames
    do_sample_frames: bool = False
    vision_segment_max_frames: int | None = 4  # temporal patches per attention chunk (None: one)

    def __post_init__(self) -> None:
        for name in ("patch_size", "merge_size", "temporal_patch_size", "image_min_pixels",
                     "image_max_pixels", "video_min_pixels", "video_max_pixels"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ValueError(f"M3ProcessorConfig.{name}={getattr(self, name)} must be > 0")
        if not self.video_fps > 0 or not self.rescale_factor > 0:
            raise ValueError(
                f"M3ProcessorConfig.video_fps={self.video_fps} and rescale_factor={self.rescale_factor} "
                "must be > 0"
            )
        if self.vision_segment_max_frames is not None and self.vision_segment_max_frames <= 0:
            raise ValueError(
                f"M3ProcessorConfig.vision_segment_max_frames={self.vision_segment_max_frames} must be > 0 "
                "or None"
            )
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or min(self.image_std) <= 0:
            raise ValueError("M3ProcessorConfig.image_mean/image_std must be 3 values, std > 0")

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_processor_dicts(cls, image: dict[str, Any], video: dict[str, Any]) -> "M3ProcessorConfig":
        size = image.get("size") or {}
        values: dict[str, Any] = {
            "patch_size": image.get("patch_size"),
            "merge_size": image.get("merge_size"),
            "temporal_patch_size": image.get("temporal_patch_size"),
            "image_mean": tuple(image["image_mean"]) if "image_mean" in image else None,
            "image_std": tuple(image["image_std"]) if "image_std" in image else None,
            "rescale_factor": image.get("rescale_factor"),
            "image_min_pixels": image.get("min_pixels", size.get("shortest_edge")),
            "image_max_pixels": image.get("max_pixels", size.get("longest_edge")),
            "video_min_pixels": video.get("min_pixels"),
            "video_max_pixels": video.get("max_pixels"),
            "video_fps": video.get("fps"),
            "do_sample_frames": video.get("do_sample_frames"),
        }
        if "vision_segment_max_frames" in video:
            values["vision_segment_max_frames"] = video["vision_segment_max_frames"]
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known and v is not None})

    @classmethod
    def from_directory(cls, directory: str | Path) -> "M3ProcessorConfig":
        image, video = read_processor_dicts(Path(directory))
        return cls.from_processor_dicts(image, video)


def read_processor_dicts(directory: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(image processor dict, video processor dict) of a checkpoint directory; {} where absent."""
    combined = directory / "processor_config.json"
    if combined.is_file():
        raw = json.loads(combined.read_text())
        return raw.get("image_processor") or {}, raw.get("video_processor") or {}
    image_file = directory / "preprocessor_config.json"
    video_file = directory / "video_preprocessor_config.json"
    image = json.loads(image_file.read_text()) if image_file.is_file() else {}
    video = json.loads(video_file.read_text()) if video_file.is_file() else {}
    return image, video


def is_m3_processor(directory: str | Path) -> bool:
    """True when the directory's processor config names M3's image or video processor."""
    image, video = read_processor_dicts(Path(directory))
    return (
        image.get("image_processor_type") == IMAGE_PROCESSOR_TYPE
        or video.get("video_processor_type") == VIDEO_PROCESSOR_TYPE
    )
