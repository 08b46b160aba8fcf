"""Persisting a generating sequence into the service, page by page as pages fill.

The replica calls `SessionWriter.sync` after a step (or every few steps); it uploads only the
full pages the service does not hold yet (pages are content-addressed, so a prefix another
session or replica already stored is not sent again) and appends the new tokens and page hashes
to the session record. With `tail=True` it also stores the partial last page, so an adopting
replica recomputes nothing; without it, the adopter recomputes at most the tokens of that page.
"""

from collections.abc import Sequence

import xxhash

from msaserve.engine.kv.pages import PageCodec
from msaserve.kvcache.client import KVCacheClient
from msaserve.kvcache.page_hash import ROOT_HASH, page_hashes
from msaserve.kvcache.session_records import SessionNotFound, SessionRecord
from msaserve.models.cache import LayerKVCache


def tail_hash(session_id: str, num_tokens: int) -> int:
    """Key of a session's partial last page holding num_tokens computed tokens: unique per write,
    so a reader never sees half of an old tail and half of a new one."""
    return xxhash.xxh3_64_intdigest(f"tail/{session_id}/{num_tokens}".encode())


class SessionWriter:
    def __init__(self, client: KVCacheClient, session_id: str, pinned: bool = True) -> None:
        self.client = client
        self.codec = PageCodec(client.model)
        self.session_id = session_id
        self.pinned = pinned
        self.num_tokens = 0  # tokens recorded in the service
        self.hashes: list[int] = []  # page hashes recorded in the service
        self.tail_hash: int | None = None
        self.bytes_uploaded = 0
        try:
            record = client.get_session(session_id)
            self.num_tokens, self.hashes = len(record.token_ids), list(record.page_hashes)
            self.tail_hash = record.tail_hash
            if pinned and not record.pinned:  # back after its pins were released as idle: one pin
                client.set_session_pinned(session_id, True)  # per listed page again (evicted ones
                # are recomputed by an adoption that misses them)
        except SessionNotFound:
            client.put_session(SessionRecord(session_id, client.model, pinned=pinned))

    def sync(
        self,
        token_ids: Sequence[int],
        caches: Sequence[LayerKVCache],
        block_table: Sequence[int],
        num_computed_tokens: int,
        sampling_state: dict | None = None,
        tail: bool = False,
    ) -> None:
        """Record `token_ids` (all of the sequence's tokens so far) and upload the full pages
        among its first `num_computed_tokens` (those whose K/V are in the caches), and with
        tail=True the partial page after them. block_table: logical → physical page."""
        page_size = self.client.model.page_size
        num_full = num_computed_tokens // page_size
        parent = self.hashes[-1] if self.hashes else ROOT_HASH
        start = len(self.hashes)
        new_tokens = token_ids[start * page_size : num_full * page_size]
        new_hashes = page_hashes(new_tokens, page_size, parent=parent)
        if new_hashes:
            held = self.client.has_pages(new_hashes)
            if self.pinned:  # pin first: a held page must not be evicted before it is recorded
                self.client.pin_pages([h for h, is_held in zip(new_hashes, held, strict=True) if is_held])
            missing = [i for i in range(len(new_hashes)) if not held[i]]
            if missing:
                exported = self.codec.export_pages(caches, [block_table[start + i] for i in missing])
                uploads = [(new_hashes[i], kv, ix) for i, (kv, ix) in zip(missing, exported, strict=True)]
                self.bytes_uploaded += self.client.put_pages(uploads, pin=self.pinned)
        new_tail = self._upload_tail(caches, block_table, num_full, num_computed_tokens) if tail else None
        # One pin per page per pinned session, taken above; the record only lists the pages.
        self.client.append_session(
            self.session_id, token_ids[self.num_tokens :], new_hashes, sampling_state, new_tail
        )
        if new_tail is not None and self.tail_hash is not None and self.tail_hash != new_tail[0]:
            self.client.delete_pages([self.tail_hash])  # superseded, after the record moved on
        if new_tail is not None:
            self.tail_hash = new_tail[0]
        self.num_tokens = len(token_ids)
        self.hashes.extend(new_hashes)

    def _upload_tail(
        self, caches: Sequence[LayerKVCache], block_table: Sequence[int], num_full: int, num_computed: int
    ) -> tuple[int | None, int]:
        tail_tokens = num_computed - num_full * self.client.model.page_size
        if tail_tokens == 0:
            return (None, 0)
        key = tail_hash(self.session_id, num_computed)
        ((kv, ix),) = self.codec.export_pages(caches, [block_table[num_full]])
        self.bytes_uploaded += self.client.put_pages([(key, kv, ix)])
        return (key, tail_tokens)
