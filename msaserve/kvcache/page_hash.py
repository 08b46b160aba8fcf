"""Chained page hashes (docs/design.md §3): the identity of a full page of tokens and everything before it.

One function used by the engine's prefix cache, the router and the KV cache service, so that a
hash means the same page everywhere. `hash(page) = xxh3_64(parent hash, token ids, media hashes)`.

A prompt with images or videos carries one placeholder token per medium; the engine expands each
to the medium's `num_placeholder_tokens` copies and hashes every page with the content hashes of
the media whose placeholders fall in it. `prompt_page_hashes` does exactly that from a request's
prompt and media, with the same functions the engine's admission uses (`expand_placeholders`,
`media_hashes_per_page`), so the router's prediction and the replica's cache agree on media prompts.
"""

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import xxhash

ROOT_HASH = 0
"""The parent of a sequence's first page (pages shared by every request)."""


def tenant_root(tenant: str) -> int:
    """The parent of the first page of a tenant's sequences: with it at the root of the chain, the
    same tokens hash differently per tenant, so no tenant can hit (or time a hit on) another's
    prefix-cache pages. Never ROOT_HASH."""
    return xxhash.xxh3_64_intdigest(b"msaserve-tenant/" + tenant.encode("utf-8", "backslashreplace")) or 1


def hash_page(parent: int, token_ids: Sequence[int], media_hashes: Sequence[int] = ()) -> int:
    """Hash one full page given its parent's hash. media_hashes: content hashes of the media whose
    placeholder tokens fall in this page (so the same ids with another image hash differently)."""
    h = xxhash.xxh3_64()
    h.update(np.uint64(parent).tobytes())
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    if media_hashes:
        h.update(b"media")
        h.update(np.asarray(media_hashes, dtype=np.uint64).tobytes())
    return h.intdigest()


def page_hashes(
    token_ids: Sequence[int],
    page_size: int,
    media_hashes_per_page: Sequence[Sequence[int]] | None = None,
    parent: int = ROOT_HASH,
) -> list[int]:
    """Hashes of every *full* page of token_ids (a trailing partial page has none).

    The same digests as chaining `hash_page`, computed from one int64 copy of the ids: converting
    each page's ids apart cost most of the time (5 ms for a 64K-token prompt, paid at admission)."""
    num_pages = len(token_ids) // page_size
    if num_pages == 0:
        return []
    data = np.asarray(token_ids[: num_pages * page_size], dtype=np.int64).tobytes()
    step = page_size * 8
    digest = xxhash.xxh3_64_intdigest
    hashes: list[int] = []
    for i in range(num_pages):
        media = media_hashes_per_page[i] if media_hashes_per_page else ()
        if media:
            parent = hash_page(parent, token_ids[i * page_size : (i + 1) * page_size], media)
        else:  # xxh3 of (parent, ids) in one call: the digest of hash_page's two updates
            parent = digest(parent.to_bytes(8, "little") + data[i * step : (i + 1) * step])
        hashes.append(parent)
    return hashes


class MediaLike(Protocol):
    """What the hashing reads from a preprocessed medium (msaserve.preprocess.pipeline.MediaItem)."""

    kind: str  # "image" | "video"
    num_placeholder_tokens: int
    content_hash: int


def prompt_page_hashes(
    token_ids: Sequence[int],
    page_size: int,
    media: Sequence[MediaLike] = (),
    media_token_ids: tuple[int, int] | None = None,
    parent: int = ROOT_HASH,
) -> list[int]:
    """Chained hashes of the full pages of a request's prompt as the engine will hold it:
    `token_ids` with one placeholder per medium (a GenerateRequest's prompt_token_ids), `media`
    its preprocessed media, `media_token_ids` the model's (image, video) placeholder ids, `parent`
    the chain's root (the request's `cache_salt`). Raises ValueError when the placeholders and the
    media disagree, or media come without the ids."""
    if not media:
        return page_hashes(token_ids, page_size, parent=parent)
    if media_token_ids is None:
        raise ValueError(
            f"media_token_ids=None is invalid with {len(media)} media: allowed (image id, video id)"
        )
    image_id, video_id = media_token_ids
    expanded = expand_placeholders(token_ids, media, image_id, video_id)
    per_page = media_hashes_per_page(expanded, media, image_id, video_id, page_size)
    return page_hashes(expanded, page_size, per_page, parent)


def expand_placeholders(
    token_ids: Sequence[int], media_items: Sequence[MediaLike], image_token_id: int, video_token_id: int
) -> list[int]:
    """Each image/video token in `token_ids` (one per medium, in order) → that medium's
    num_placeholder_tokens copies. A prompt that already holds every placeholder (MiniMax-M3's
    processor text: runs wrapped in start/end markers, timestamps between a video's frames) is
    returned as it is once its placeholders' kinds are checked. Raises ValueError when the tokens
    and the media disagree."""
    placeholders = [t for t in token_ids if t in (image_token_id, video_token_id)]
    total = sum(m.num_placeholder_tokens for m in media_items)
    if len(placeholders) == total != len(media_items):
        _check_expanded_kinds(placeholders, media_items, image_token_id, video_token_id)
        return list(token_ids)
    placeholder = {"image": image_token_id, "video": video_token_id}
    out: list[int] = []
    media = iter(media_items)
    for position, token in enumerate(token_ids):
        if token not in (image_token_id, video_token_id):
            out.append(token)
            continue
        item = next(media, None)
        if item is None:
            raise ValueError(
                f"token {position} is a media placeholder but only {len(media_items)} media were sent"
            )
        if placeholder[item.kind] != token:
            raise ValueError(
                f"token {position} is a placeholder for a different kind than medium ({item.kind})"
            )
        out.extend([token] * item.num_placeholder_tokens)
    left = sum(1 for _ in media)
    if left:
        raise ValueError(f"{left} media have no placeholder token in the prompt")
    return out


def _check_expanded_kinds(
    placeholders: list[int], media_items: Sequence[MediaLike], image_token_id: int, video_token_id: int
) -> None:
    placeholder = {"image": image_token_id, "video": video_token_id}
    cursor = 0
    for index, item in enumerate(media_items):
        run = placeholders[cursor : cursor + item.num_placeholder_tokens]
        if any(token != placeholder[item.kind] for token in run):
            raise ValueError(f"medium {index} ({item.kind}) has placeholders of another kind in the prompt")
        cursor += item.num_placeholder_tokens


def placeholder_spans(
    expanded_ids: Sequence[int], media_items: Sequence[MediaLike], image_token_id: int, video_token_id: int
) -> list[tuple[int, int]]:
    """(start, length) of each medium's placeholders in an expanded prompt, in media order: from
    its first placeholder to its last (other tokens may lie between, as in an M3 video)."""
    ids = np.asarray(expanded_ids, dtype=np.int64)
    positions = np.flatnonzero((ids == image_token_id) | (ids == video_token_id)).tolist()
    total = sum(m.num_placeholder_tokens for m in media_items)
    if len(positions) != total:
        raise ValueError(f"the prompt has {len(positions)} placeholder tokens; the media need {total}")
    spans, cursor = [], 0
    for item in media_items:
        first, last = positions[cursor], positions[cursor + item.num_placeholder_tokens - 1]
        spans.append((first, last + 1 - first))
        cursor += item.num_placeholder_tokens
    return spans


def media_hashes_per_page(
    expanded_ids: Sequence[int],
    media_items: Sequence[MediaLike],
    image_token_id: int,
    video_token_id: int,
    page_size: int,
) -> list[list[int]]:
    """For each page (ceil(len / page_size)), the content hashes of the media whose placeholder
    tokens fall in it, in media order: the argument of kvcache.page_hash.page_hashes."""
    pages: list[list[int]] = [[] for _ in range(-(-len(expanded_ids) // page_size))]
    spans = placeholder_spans(expanded_ids, media_items, image_token_id, video_token_id)
    for (start, length), item in zip(spans, media_items, strict=True):
        for page in range(start // page_size, (start + length - 1) // page_size + 1):
            pages[page].append(int(item.content_hash))
    return pages
