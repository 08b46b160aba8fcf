"""OpenAI content parts → media items ready for the vision tower.

`Preprocessor(config).process(parts)` validates every part, fetches and decodes each medium, and
returns one `MediaItem` per image/video in order, with its patches, grid, placeholder count and a
content hash (xxh3-64 over the resized pixels and the grid: the same picture sent twice, by any
URL, gets the same hash, so its KV pages hit the prefix cache).
"""

import time
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import xxhash

from msaserve.preprocess.config import PreprocessConfig
from msaserve.preprocess.errors import MediaError
from msaserve.preprocess.fetch import Fetcher
from msaserve.preprocess.image import decode_image
from msaserve.preprocess.patchify import normalise_table, num_placeholder_tokens, patchify
from msaserve.preprocess.sniff import expect_kind
from msaserve.preprocess.video import decode_video

MEDIA_PART_TYPES = {"image_url": "image", "video_url": "video"}


@dataclass
class MediaItem:
    kind: Literal["image", "video"]
    patches: np.ndarray  # [grid_t * grid_h * grid_w, C * temporal * patch * patch] float32
    grid_thw: tuple[int, int, int]
    num_placeholder_tokens: int  # grid_t * grid_h * grid_w / merge²
    content_hash: int  # xxh3-64 of (kind, grid, resized uint8 pixels); an unsigned 64-bit int
    part_index: int  # index of the content part it came from
    source_size: tuple[int, int]  # (width, height) before resize
    num_frames: int = 1  # frames sampled (videos), before padding to the temporal patch
    # Models whose processor writes more than one placeholder per medium (MiniMax-M3):
    grids: list[tuple[int, int, int]] | None = None  # attention chunks of grid_thw (a video's)
    placeholder_text: str | None = None  # the exact text the medium's marker becomes in the prompt


@dataclass
class PreprocessResult:
    media: list[MediaItem]
    text_parts: list[tuple[int, str]]  # (part index, text) in order
    timings_s: dict[str, float] = field(default_factory=dict)  # "fetch", "decode", "patchify"

    @property
    def num_placeholder_tokens(self) -> int:
        return sum(m.num_placeholder_tokens for m in self.media)


def content_hash(kind: str, grid_thw: tuple[int, int, int], pixels: np.ndarray) -> int:
    h = xxhash.xxh3_64()
    h.update(kind.encode())
    h.update(np.asarray(grid_thw, dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(pixels).data)
    return h.intdigest()


class Preprocessor:
    """CPU media pipeline. `fetcher` is injectable (tests pass a resolver/transport through it)."""

    def __init__(self, config: PreprocessConfig | None = None, fetcher: Fetcher | None = None) -> None:
        self.config = config or PreprocessConfig()
        self.fetcher = fetcher or Fetcher(self.config)
        self.table = normalise_table(self.config)  # [C, 256] float32

    def process(self, content_parts: list[dict]) -> PreprocessResult:
        """Raises MediaError (a 4xx) for any bad part or limit breach; nothing is half-processed."""
        if not isinstance(content_parts, list):
            raise MediaError(
                400, "invalid_content_part", "content must be a list of content parts", "content"
            )
        media_parts = self._validate(content_parts)
        result = PreprocessResult(media=[], text_parts=[])
        for index, part in enumerate(content_parts):
            if part["type"] == "text":
                result.text_parts.append((index, part["text"]))
        for index, kind, url in media_parts:
            item = self._process_one(index, kind, url, result.timings_s)
            result.media.append(item)
        return result

    def _validate(self, parts: list[dict]) -> list[tuple[int, str, str]]:
        media: list[tuple[int, str, str]] = []
        for index, part in enumerate(parts):
            param = f"content[{index}]"
            part_type = part.get("type") if isinstance(part, dict) else None
            if part_type == "text":
                if not isinstance(part.get("text"), str):
                    raise MediaError(400, "invalid_content_part", "a text part needs a string 'text'", param)
                continue
            if part_type not in MEDIA_PART_TYPES:
                raise MediaError(
                    400,
                    "invalid_content_part",
                    f"content part type {part_type!r} is not supported; use text, image_url or video_url",
                    param,
                )
            url = _part_url(part, part_type, param)
            media.append((index, MEDIA_PART_TYPES[part_type], url))
        if len(media) > self.config.max_items_per_request:
            raise MediaError(
                413,
                "too_many_media_items",
                f"the request has {len(media)} images/videos; "
                f"max_items_per_request={self.config.max_items_per_request}",
                "content",
            )
        return media

    def _process_one(self, index: int, kind: str, url: str, timings: dict[str, float]) -> MediaItem:
        param = f"content[{index}].{kind}_url"
        started = time.perf_counter()
        max_bytes = self.config.max_image_bytes if kind == "image" else self.config.max_video_bytes
        data = self.fetcher.fetch(url, max_bytes, param)
        timings["fetch"] = timings.get("fetch", 0.0) + time.perf_counter() - started
        return self.process_media(data, kind, index, timings)

    def process_media(
        self, data: bytes, kind: str, index: int = 0, timings: dict[str, float] | None = None
    ) -> MediaItem:
        """Encoded bytes of one image or video (already fetched) → MediaItem; raises MediaError."""
        cfg = self.config
        param = f"content[{index}].{kind}_url"
        t0 = time.perf_counter()
        try:
            fmt = expect_kind(data, kind, param)
            if kind == "image":
                image = decode_image(data, cfg, param)
                frames = image.pixels[None]  # [1, H, W, 3]; patchify repeats it over the temporal patch
                source_size, num_frames = image.source_size, 1
            else:
                video = decode_video(data, fmt, cfg, param)
                frames = video.frames  # [T, H, W, 3]
                source_size, num_frames = video.source_size, len(video.sample_times)
        except MediaError as error:
            error.param = error.param or param
            raise
        t1 = time.perf_counter()
        patches, grid_thw = patchify(frames, cfg, self.table)
        item = MediaItem(
            kind=kind,  # type: ignore[arg-type]
            patches=patches,
            grid_thw=grid_thw,
            num_placeholder_tokens=num_placeholder_tokens(grid_thw, cfg.merge_size),
            content_hash=content_hash(kind, grid_thw, frames),
            part_index=index,
            source_size=source_size,
            num_frames=num_frames,
        )
        if timings is not None:
            timings["decode"] = timings.get("decode", 0.0) + t1 - t0
            timings["patchify"] = timings.get("patchify", 0.0) + time.perf_counter() - t1
        return item


def _part_url(part: dict, part_type: str, param: str) -> str:
    inner = part.get(part_type)
    url = inner.get("url") if isinstance(inner, dict) else inner if isinstance(inner, str) else None
    if not isinstance(url, str) or not url:
        got = "an empty string" if url == "" else "no URL"
        raise MediaError(
            400,
            "invalid_content_part",
            f"{part_type} needs {{'url': <string>}} (got {got}): allowed a data: URL "
            "(data:image/png;base64,...) or an http(s):// or file:// URL where the server allows them",
            param,
        )
    return url
