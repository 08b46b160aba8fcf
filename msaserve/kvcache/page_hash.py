"""Chained page hashes (docs/design.md §3): the identity of a full page of tokens and everything before it.

One function used by the engine's prefix cache, the router and the KV cache service, so that a
hash means the same page everywhere. `hash(page) = xxh3_64(parent hash, token ids, media hashes)`.
"""

from collections.abc import Sequence

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
