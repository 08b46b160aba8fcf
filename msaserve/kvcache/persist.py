"""Persisting a generating sequence into the service, page by page as pages fill.

The replica calls `SessionWriter.sync` after a step (or every few steps); it uploads only the
full pages the service does not hold yet (pages are content-addressed, so a prefix another
session or replica already stored is not sent again) and appends the new tokens and page hashes
to the session record.
"""

from collections.abc import Sequence

from msaserve.kvcache.client import KVCacheClient
from msaserve.kvcache.page_hash import ROOT_HASH, page_hashes
from msaserve.kvcache.pages import PageCodec
from msaserve.kvcache.session import SessionNotFound, SessionRecord
from msaserve.models.cache import LayerKVCache


class SessionWriter:
    def __init__(self, client: KVCacheClient, session_id: str, pinned: bool = True) -> None:
        self.client = client
        self.codec = PageCodec(client.model)
        self.session_id = session_id
        self.pinned = pinned
        self.num_tokens = 0  # tokens recorded in the service
        self.hashes: list[int] = []  # page hashes recorded in the service
        self.bytes_uploaded = 0
        try:
            record = client.get_session(session_id)
            self.num_tokens, self.hashes = len(record.token_ids), list(record.page_hashes)
        except SessionNotFound:
            client.put_session(SessionRecord(session_id, client.model, pinned=pinned))

    def sync(
        self,
        token_ids: Sequence[int],
        caches: Sequence[LayerKVCache],
        block_table: Sequence[int],
        num_computed_tokens: int,
        sampling_state: dict | None = None,
    ) -> None:
        """Record `token_ids` (all of the sequence's tokens so far) and upload the full pages
        among its first `num_computed_tokens` (those whose K/V are in the caches).
        block_table: logical page → physical page of this sequence."""
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
        # One pin per page per pinned session, taken above; the record only lists the pages.
        self.client.append_session(self.session_id, token_ids[self.num_tokens :], new_hashes, sampling_state)
        self.num_tokens = len(token_ids)
        self.hashes.extend(new_hashes)
