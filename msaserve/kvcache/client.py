"""What a replica holds to talk to the service: routes by hash, batches one call per shard.

Every method that touches several pages groups them by shard, sends one actor call per shard
(all in flight at once) and scatters the replies back into request order. Reads come back as
read-only uint8 arrays mapped from the object store.

    shards = start_shards(ServiceConfig(num_shards=4, disk_path="/kv", disk_bytes=1 << 40))
    client = KVCacheClient(shards, model_identity)          # or KVCacheClient.connect(config, model)
    client.put_pages([(page_hash, kv_payload_per_layer, index_payload)])
    index = client.get_index(page_hashes)                   # adoption: the whole index first
    kv = client.get_kv([(page_hash, layer), ...])           # then the selected pages, per layer
"""

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.actor import ActorHandle

from msaserve.kvcache.codec import Payload
from msaserve.kvcache.config import ServiceConfig
from msaserve.kvcache.keys import ModelIdentity, shard_of_page, shard_of_session
from msaserve.kvcache.session import SessionRecord
from msaserve.kvcache.shard import KVCacheShardActor, PageUpload


class ServiceUnavailable(RuntimeError):
    """A shard did not answer (its actor died or is restarting): treat its pages as missing."""


def start_shards(config: ServiceConfig, detached: bool = False) -> list[ActorHandle]:
    """Create the shard actors, or get them if they already run (names come from the config).
    detached=True lets them outlive the creating process (a Serve app's KV cache tier)."""
    options: dict[str, Any] = {"namespace": config.namespace, "get_if_exists": True}
    if detached:
        options["lifetime"] = "detached"
    # A shard that dies is restarted by Ray; with a disk tier it comes back with its pages.
    shards = [
        KVCacheShardActor.options(name=config.actor_name(i), max_restarts=3, **options).remote(config, i)
        for i in range(config.num_shards)
    ]
    ray.get([s.ping.remote() for s in shards])  # fail here, not on first use
    return shards


class PendingFetch:
    """Reads in flight (a background prefetch); `result()` waits and returns them in order."""

    def __init__(self, refs: list[tuple[ray.ObjectRef, list[int]]], size: int) -> None:
        self._refs, self._size = refs, size

    def done(self) -> bool:
        refs = [ref for ref, _ in self._refs]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
        return len(ready) == len(refs)

    def result(self, timeout_s: float | None = None) -> list[Payload | None]:
        out: list[Any] = [None] * self._size
        try:
            replies = ray.get([ref for ref, _ in self._refs], timeout=timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            raise ServiceUnavailable(f"a KV cache shard did not answer: {e}") from e
        for (_, positions), reply in zip(self._refs, replies, strict=True):
            for pos, value in zip(positions, reply, strict=True):
                out[pos] = value
        return out


class KVCacheClient:
    def __init__(self, shards: Sequence[ActorHandle], model: ModelIdentity) -> None:
        if not shards:
            raise ValueError("KVCacheClient needs at least one shard")
        self.shards = list(shards)
        self.model = model
        self.model_key = model.key

    @classmethod
    def connect(cls, config: ServiceConfig, model: ModelIdentity) -> "KVCacheClient":
        """Attach to running shards by name (how a model replica finds the service)."""
        shards = [
            ray.get_actor(config.actor_name(i), namespace=config.namespace) for i in range(config.num_shards)
        ]
        return cls(shards, model)

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    # ---- pages -------------------------------------------------------------------------------
    def put_pages(self, pages: Sequence[PageUpload], pin: bool = False) -> int:
        """Store pages (K+V per layer and/or index-K); returns the bytes stored."""
        refs = [
            self.shards[shard].put_pages.remote(self.model_key, [pages[i] for i in positions], pin)
            for shard, positions in self._by_shard([p[0] for p in pages]).items()
        ]
        return sum(ray.get(refs))

    def get_kv(self, requests: Sequence[tuple[int, int]]) -> list[Payload | None]:
        """K+V payload per (page hash, layer); None where the service has no valid copy."""
        return self.get_kv_async(requests).result()

    def get_kv_async(self, requests: Sequence[tuple[int, int]]) -> PendingFetch:
        return self._fetch(lambda shard, items: shard.get_kv.remote(self.model_key, items),
                           [h for h, _ in requests], list(requests))

    def get_index(self, page_hashes: Sequence[int]) -> list[Payload | None]:
        """Index-K payload (all layers) per page; None where missing or corrupt."""
        return self.get_index_async(page_hashes).result()

    def get_index_async(self, page_hashes: Sequence[int]) -> PendingFetch:
        return self._fetch(lambda shard, items: shard.get_index.remote(self.model_key, items),
                           list(page_hashes), list(page_hashes))

    def has_pages(self, page_hashes: Sequence[int]) -> list[bool]:
        """Whether the service holds each page completely (index-K and every layer's K+V)."""
        return self._fetch(
            lambda shard, items: shard.has_pages.remote(self.model_key, items, self.model.num_layers),
            list(page_hashes), list(page_hashes),
        ).result()

    def delete_pages(self, page_hashes: Sequence[int]) -> None:
        """Remove pages from the service (e.g. a superseded session tail)."""
        ray.get([
            self.shards[shard].delete_pages.remote(
                self.model_key, [page_hashes[i] for i in positions], self.model.num_layers)
            for shard, positions in self._by_shard(page_hashes).items()
        ])

    def pin_pages(self, page_hashes: Sequence[int], pin: bool = True) -> None:
        """Take (or with pin=False release) one pin per page: pinned pages are never evicted."""
        ray.get([
            self.shards[shard].pin_pages.remote(
                self.model_key, [page_hashes[i] for i in positions], self.model.num_layers, pin)
            for shard, positions in self._by_shard(page_hashes).items()
        ])

    # ---- sessions ----------------------------------------------------------------------------
    def put_session(self, record: SessionRecord) -> None:
        """Create or replace a session record (its pages must be put separately)."""
        self.model.check_compatible(record.model, f"session {record.session_id!r}")
        ray.get(self._session_shard(record.session_id).session_put.remote(record))
        if record.pinned:
            self.pin_pages(record.page_hashes)

    def append_session(
        self, session_id: str, token_ids: Sequence[int], page_hashes: Sequence[int],
        sampling_state: dict | None = None, tail: tuple[int | None, int] | None = None,
    ) -> int:
        """Record new tokens and newly filled pages (put their payloads, and pin them for a pinned
        session, first); tail = (hash, tokens) of a newly stored partial last page. Returns the
        session's token count."""
        return ray.get(self._session_shard(session_id).session_append.remote(
            session_id, list(token_ids), list(page_hashes), sampling_state, tail))

    def get_session(self, session_id: str) -> SessionRecord:
        """The record; raises SessionNotFound, or IncompatibleModel if another model wrote it."""
        record = ray.get(self._session_shard(session_id).session_get.remote(session_id))
        self.model.check_compatible(record.model, f"session {session_id!r}")
        return record

    def delete_session(self, session_id: str) -> None:
        """Forget a session. Its pages stay (other sessions may share them) but lose its pins."""
        record = ray.get(self._session_shard(session_id).session_delete.remote(session_id))
        if record is not None and record.model == self.model:
            if record.pinned:
                self.pin_pages(record.page_hashes, pin=False)
            if record.tail_hash is not None:  # the tail is this session's alone
                self.delete_pages([record.tail_hash])

    def list_sessions(self) -> list[str]:
        return sorted(s for ids in ray.get([s.session_list.remote() for s in self.shards]) for s in ids)

    def set_session_pinned(self, session_id: str, pinned: bool) -> None:
        """Pin a live session's pages (never evicted) or release them to LRU eviction."""
        shard = self._session_shard(session_id)
        record = ray.get(shard.session_get.remote(session_id))
        if record.pinned != pinned:
            ray.get(shard.session_set_pinned.remote(session_id, pinned))
            if record.model == self.model:
                self.pin_pages(record.page_hashes, pin=pinned)

    def restore_pins(self) -> int:
        """After a service restart, re-take the page pins of this model's pinned sessions (pins
        live in shard memory; the pinned flag is on disk). Returns the sessions re-pinned."""
        count = 0
        for session_id in self.list_sessions():
            record = ray.get(self._session_shard(session_id).session_get.remote(session_id))
            if record.pinned and record.model == self.model:
                self.pin_pages(record.page_hashes)
                count += 1
        return count

    def stats(self) -> list[dict]:
        return ray.get([s.stats.remote() for s in self.shards])

    # ---- routing -----------------------------------------------------------------------------
    def _session_shard(self, session_id: str) -> ActorHandle:
        return self.shards[shard_of_session(session_id, self.num_shards)]

    def _by_shard(self, page_hashes: Sequence[int]) -> dict[int, list[int]]:
        """Positions of the requests grouped by the shard that holds each page."""
        groups: dict[int, list[int]] = defaultdict(list)
        for i, h in enumerate(page_hashes):
            groups[shard_of_page(h, self.num_shards)].append(i)
        return groups

    def _fetch(
        self, call: Callable[[ActorHandle, list], ray.ObjectRef], hashes: list[int], items: list
    ) -> PendingFetch:
        refs = [
            (call(self.shards[shard], [items[i] for i in positions]), positions)
            for shard, positions in self._by_shard(hashes).items()
        ]
        return PendingFetch(refs, len(items))
