"""Images and videos inside the engine: placeholder expansion at admission, media hashes for the
prefix cache, and the vision embeddings merged into prefill chunks.

A request's prompt holds one image/video token per medium (in order); admission expands each to
the medium's `num_placeholder_tokens` copies, so positions, pages and usage count the real tokens.
The page hashes of pages holding a medium's placeholders include its content hash: the same image
with the same text is a prefix-cache hit, another image with the same text is not. At prefill the
vision tower runs once per request (embeddings kept until the placeholders are computed) and each
chunk takes the rows of the placeholders it holds, so any chunking gives the same result.
"""

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from msaserve.engine.types import InvalidParameter
from msaserve.kvcache.page_hash import expand_placeholders, media_hashes_per_page
from msaserve.models.config import MSAConfig
from msaserve.models.vision import VisionTower, merge_media_embeddings


@dataclass
class MediaPrompt:
    """The media of one sequence's (expanded) prompt."""

    items: list[Any]
    """Preprocessed MediaItems in prompt order (patches [t·h·w, C·T·P·P] float32, grid_thw, ...)."""
    hashes_per_page: list[list[int]]
    """Content hashes of the media whose placeholders fall in each prompt page."""
    placeholder_positions: np.ndarray
    """[num placeholders] int64, sorted: prompt positions the tower's rows replace."""
    image_token_id: int
    video_token_id: int
    embeddings: torch.Tensor | None = field(default=None, repr=False)
    """[num placeholders, H]: the tower's output while the placeholders are being prefilled."""

    @property
    def placeholder_end(self) -> int:
        """One past the last placeholder position: chunks from here on need no merge."""
        return int(self.placeholder_positions[-1]) + 1

    def page_media_hashes(self, page: int) -> list[int]:
        return self.hashes_per_page[page] if page < len(self.hashes_per_page) else []

    def placeholders_before(self, position: int) -> int:
        return int(np.searchsorted(self.placeholder_positions, position))


def prepare_media(
    token_ids: list[int], media: SequenceOf[Any], config: MSAConfig, tower: VisionTower | None, page_size: int
) -> tuple[list[int], MediaPrompt | None]:
    """(expanded prompt ids, its MediaPrompt or None). Raises InvalidParameter (a 400) when the
    model has no vision tower, the placeholders and the media disagree, or an item is malformed."""
    image_id, video_id = config.image_token_id, config.video_token_id
    if not media:
        if tower is not None and any(t in (image_id, video_id) for t in token_ids):
            raise InvalidParameter(
                "prompt_token_ids", f"placeholder ids {image_id}/{video_id}",
                "media placeholders only with media",
            )
        return token_ids, None
    if tower is None or image_id is None or video_id is None:
        raise InvalidParameter(
            "media", f"{len(media)} items",
            "none: this model has no vision tower (serve a checkpoint whose config.json has a "
            "vision_config, e.g. model_type minimax_m3_vl, to send images or video)",
        )
    for index, item in enumerate(media):
        _check_item(index, item, tower)
    try:
        expanded = expand_placeholders(token_ids, media, image_id, video_id)
    except ValueError as e:
        allowed = f"one placeholder token per medium ({e})"
        raise InvalidParameter("media", f"{len(media)} items", allowed) from None
    ids = np.asarray(expanded, dtype=np.int64)
    positions = np.flatnonzero((ids == image_id) | (ids == video_id))
    hashes = media_hashes_per_page(expanded, media, image_id, video_id, page_size)
    return expanded, MediaPrompt(list(media), hashes, positions, image_id, video_id)


def _check_item(index: int, item: Any, tower: VisionTower) -> None:
    """The shapes the tower will check at prefill, checked at admission (a 400, not a failed step)."""
    vision = tower.config
    t, h, w = item.grid_thw
    merge = vision.merge_size
    expected = (t * h * w, vision.patch_dim)
    if h % merge or w % merge or tuple(item.patches.shape) != expected:
        raise InvalidParameter(
            f"media[{index}]", f"patches {tuple(item.patches.shape)}, grid {item.grid_thw}",
            f"patches {expected} on a grid whose h and w are multiples of {merge}",
        )
    if item.num_placeholder_tokens != t * h * w // merge**2:
        raise InvalidParameter(
            f"media[{index}].num_placeholder_tokens", item.num_placeholder_tokens, f"{t * h * w // merge**2}"
        )


def step_input_embeds(
    model: Any, seqs: SequenceOf[Any], num_new_tokens: SequenceOf[int], input_ids: torch.Tensor
) -> torch.Tensor | None:
    """Input embeddings [T, H] of a step whose chunks hold media placeholders, else None (the model
    embeds the token ids itself). Call before the step's tokens are marked computed."""
    if not any(_merges(seq) for seq in seqs):
        return None
    x = model.embed_tokens(input_ids)  # [T, H]
    pieces, offset = [], 0
    for seq, num_new in zip(seqs, num_new_tokens, strict=True):
        piece = x[offset : offset + num_new]
        if _merges(seq):
            piece = _merge_chunk(model.visual, seq, piece, input_ids[offset : offset + num_new])
        pieces.append(piece)
        offset += num_new
    return torch.cat(pieces)


def release_finished_media(seqs: SequenceOf[Any], num_new_tokens: SequenceOf[int]) -> None:
    """Drop the embeddings of sequences whose placeholders are all computed after this step."""
    for seq, num_new in zip(seqs, num_new_tokens, strict=True):
        media: MediaPrompt | None = seq.media
        if media is not None and seq.num_computed_tokens + num_new >= media.placeholder_end:
            media.embeddings = None


def _merges(seq: Any) -> bool:
    return seq.media is not None and seq.num_computed_tokens < seq.media.placeholder_end


def _merge_chunk(tower: VisionTower, seq: Any, piece: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """piece [n, H] of tokens [start, start + n): placeholder rows replaced by the tower's rows.
    Only prompt positions are merged (a sampled id equal to a placeholder id stays a token)."""
    media: MediaPrompt = seq.media
    if media.embeddings is None:  # first chunk (or recomputation after a preemption)
        media.embeddings = tower.embed_media(media.items)  # [num placeholders, H]
    start = seq.num_computed_tokens
    span = min(len(piece), media.placeholder_end - start)
    merged = merge_media_embeddings(
        piece[:span], ids[:span], media.embeddings, media.image_token_id, media.video_token_id,
        placeholders_before=media.placeholders_before(start),
    )
    return torch.cat([merged, piece[span:]])
