"""The M3 preprocessor: msaserve's content-part pipeline (validation, fetch, limits, timings) with
MiniMax-M3's image and video processing in place of Qwen2-VL's.

Each MediaItem carries what M3's vision tower and prompt need beyond Qwen2-VL's: `grids` (a
video's attention chunks of ≤ vision_segment_max_frames temporal patches) and `placeholder_text`
(the exact text transformers' processor puts where the medium's marker was: the gateway
tokenizes the prompt with it, so ids equal the reference's).
"""

import time

from msaserve.preprocess.config import PreprocessConfig
from msaserve.preprocess.errors import MediaError
from msaserve.preprocess.fetch import Fetcher
from msaserve.preprocess.minimax_m3.config import M3ProcessorConfig
from msaserve.preprocess.minimax_m3.image import decode_rgb, resize_image
from msaserve.preprocess.minimax_m3.pixels import Normaliser
from msaserve.preprocess.minimax_m3.text import image_placeholder_text, video_chunks, video_placeholder_text
from msaserve.preprocess.minimax_m3.video import decode_video
from msaserve.preprocess.patchify import num_placeholder_tokens
from msaserve.preprocess.pipeline import MediaItem, Preprocessor, content_hash
from msaserve.preprocess.sniff import expect_kind


class M3Preprocessor(Preprocessor):
    def __init__(
        self, m3: M3ProcessorConfig | None = None, config: PreprocessConfig | None = None,
        fetcher: Fetcher | None = None,
    ) -> None:  # fmt: skip
        super().__init__(config, fetcher)
        self.m3 = m3 or M3ProcessorConfig()
        self.normaliser = Normaliser(self.m3)

    def process_media(
        self, data: bytes, kind: str, index: int = 0, timings: dict[str, float] | None = None
    ) -> MediaItem:
        """Encoded bytes of one image or video → MediaItem; raises MediaError."""
        param = f"content[{index}].{kind}_url"
        t0 = time.perf_counter()
        try:
            fmt = expect_kind(data, kind, param)
            if kind == "image":
                image = resize_image(decode_rgb(data, self.config, param), self.m3)
                frames, source_size, frame_indices, fps = image.pixels, image.source_size, [0], None
            else:
                video = decode_video(data, fmt, self.m3, self.config, param)
                frames, source_size, frame_indices, fps = (
                    video.frames,
                    video.source_size,
                    video.frame_indices,
                    video.fps,
                )
        except MediaError as error:
            error.param = error.param or param
            raise
        t1 = time.perf_counter()
        patches, grid_thw, raw = self.normaliser.patchify(frames)
        m3 = self.m3
        if kind == "image":
            grids = [grid_thw]
            text = image_placeholder_text(grid_thw, m3.merge_size)
        else:
            grids = video_chunks(grid_thw, m3.vision_segment_max_frames)
            text = video_placeholder_text(grid_thw, m3.merge_size, m3.temporal_patch_size, frame_indices, fps)
        item = MediaItem(
            kind=kind,  # type: ignore[arg-type]
            patches=patches,
            grid_thw=grid_thw,
            num_placeholder_tokens=num_placeholder_tokens(grid_thw, m3.merge_size),
            content_hash=content_hash(kind, grid_thw, raw),  # the resized pixels, rearranged
            part_index=index,
            source_size=source_size,
            num_frames=len(frame_indices),
            grids=grids,
            placeholder_text=text,
        )
        if timings is not None:
            timings["decode"] = timings.get("decode", 0.0) + t1 - t0
            timings["patchify"] = timings.get("patchify", 0.0) + time.perf_counter() - t1
        return item
