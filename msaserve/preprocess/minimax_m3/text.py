"""The text each image/video marker becomes, exactly as transformers' MiniMaxM3VLProcessor writes it.

An image: START + IMAGE × (its patches / merge²) + END. A video: per temporal patch, an optional
`]<]{seconds:.1f} seconds[>[` (the source frame index of the patch's first frame over the video's
frame rate) then START + VIDEO × (h·w / merge²) + END. The tokenizer turns the special markers into
the checkpoint's image/video token ids, one per placeholder row of the vision tower.
"""

from collections.abc import Sequence

IMAGE_TOKEN = "]<]image[>["
VIDEO_TOKEN = "]<]video[>["
VISION_START_TOKEN = "]<]start of image[>["
VISION_END_TOKEN = "]<]end of image[>["


def image_placeholder_text(grid_thw: tuple[int, int, int], merge_size: int) -> str:
    t, h, w = grid_thw
    return VISION_START_TOKEN + IMAGE_TOKEN * (t * h * w // merge_size**2) + VISION_END_TOKEN


def video_placeholder_text(
    grid_thw: tuple[int, int, int],
    merge_size: int,
    temporal_patch_size: int,
    frame_indices: Sequence[int] | None,
    fps: float | None,
) -> str:
    """grid_thw: the whole video's (grid_t, h, w); frame_indices: the source index of each sampled
    frame (before padding); no timestamps when the frame rate or the indices are unknown."""
    grid_t, h, w = grid_thw
    frame = VISION_START_TOKEN + VIDEO_TOKEN * (h * w // merge_size**2) + VISION_END_TOKEN
    pieces = []
    for index in range(grid_t):
        if fps is not None and frame_indices is not None:
            source = frame_indices[min(index * temporal_patch_size, len(frame_indices) - 1)]
            pieces.append(f"]<]{source / fps:.1f} seconds[>[")
        pieces.append(frame)
    return "".join(pieces)


def video_chunks(
    grid_thw: tuple[int, int, int], segment_max_frames: int | None
) -> list[tuple[int, int, int]]:
    """The video's grid split into attention chunks of ≤ segment_max_frames temporal patches."""
    grid_t, h, w = grid_thw
    step = grid_t if segment_max_frames is None else segment_max_frames
    return [(min(step, grid_t - start), h, w) for start in range(0, grid_t, step)]
