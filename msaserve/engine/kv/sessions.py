"""Sessions through the KV cache service: persisted as they generate, adopted where they move.

With a `KVCacheClient` attached, a request that carries a `session_id`:
- is **persisted** incrementally (`SessionWriter.sync`: token ids, index-K and K/V of the new full
  pages, the partial tail page, sampling state) after its prefill, every `sync_every` decode steps
  and when it finishes, so another replica can continue it at any time;
- is **adopted** when its pages are not local (its prompt extends the session's record further
  than this replica's prefix cache reaches): the whole index is loaded first (`LazyPageFetcher`),
  the sequence starts running from the stored tokens, and each layer's wrapped indexer fetches the
  K/V pages it selects before attention reads them, while the rest is prefetched in the background.

Adopted pages whose K/V may not be resident yet are never shared through the prefix cache: the
sequence enters it only once every page has arrived. A page lost in the service (missing or
corrupt) makes the sequence recompute from its token ids; a service that does not answer stops
persistence for that request, never the request itself.
"""

import collections
import dataclasses
import logging
import time
from collections.abc import Callable

import torch

from msaserve.engine.block_manager import BlockManager
from msaserve.engine.kv.adoption import AdoptionStats, LazyPageFetcher, PageLost
from msaserve.engine.kv.host_tier import PageLostInService
from msaserve.engine.kv.persist import SessionWriter
from msaserve.engine.kv.resident_lane import SparseResidentLane
from msaserve.engine.kv.service_prefix import ServicePrefixCache
from msaserve.engine.scheduler import ScheduledBatch, Scheduler
from msaserve.engine.sequence import Sequence, SequenceStatus
from msaserve.kernels import AttentionOps
from msaserve.kvcache.client import CapacityError, KVCacheClient, ServiceUnavailable
from msaserve.kvcache.session_records import SessionNotFound, SessionRecord
from msaserve.models.cache import LayerKVCache

OpsWrapper = Callable[[AttentionOps], AttentionOps]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class SessionStats:
    adopted: int = 0
    adopted_tokens: int = 0
    index_seconds: float = 0.0
    on_demand_seconds: float = 0.0
    kv_pages_on_demand: int = 0
    syncs: int = 0
    recomputed_after_loss: int = 0


class EngineSessions:
    def __init__(
        self, client: KVCacheClient, caches: list[LayerKVCache], block_manager: BlockManager,
        scheduler: Scheduler, sparse: bool, sync_every: int = 16, prefetch_pages: int = 64,
        dense_layers: tuple[int, ...] = (),
    ) -> None:
        """sparse: whether the model's ops run the MSA indexer (dense ops never select pages, so
        an adopted session's K/V is then fetched whole at adoption). dense_layers: layers that
        attend densely even then (MiniMax-M3's full_attention layers): their K/V is fetched whole
        at adoption too, while the MSA layers fetch what they select."""
        self.client = client
        self.caches = caches
        self.block_manager = block_manager
        self.scheduler = scheduler
        self.sparse = sparse
        self.dense_layers = dense_layers
        self.sync_every = sync_every
        self.prefetch_pages = prefetch_pages
        self.page_size = block_manager.page_size
        self.writers: dict[str, SessionWriter] = {}  # request id → writer
        self.session_of: dict[str, str] = {}  # request id → session id
        self.fetchers: dict[str, tuple[Sequence, LazyPageFetcher]] = {}  # request id → adoption
        self._steps_since_sync: dict[str, int] = {}
        self._layer_of = {c.index_cache.data_ptr(): layer for layer, c in enumerate(caches)}
        self.stats = SessionStats()
        self.lane: SparseResidentLane | None = None
        """The engine's sparse-resident lane: its requests' pages are persisted from there."""
        self.prefix = ServicePrefixCache(client, caches, block_manager, scheduler)
        self.adoptions: dict[str, AdoptionStats] = {}
        self.latencies: collections.deque[tuple[str, float]] = collections.deque(maxlen=10_000)
        """("index_load" | "page_fetch", seconds) since the owner last drained them (the replica's
        metrics loop, on another thread: deque appends and pops are atomic)."""
        """Per adopted request (the latest 1,000): index bytes and time, pages fetched on demand."""

    # ---- a request arrives ------------------------------------------------------------------
    def admit(self, seq: Sequence, session_id: str | None) -> bool:
        """Before seq waits for admission: adopt its session, or load the prefix pages the service
        holds beyond the local prefix cache. True when seq was started (it is running)."""
        if session_id and self.on_add(seq, session_id):
            return True
        return self.prefix.load_into(seq)

    def on_add(self, seq: Sequence, session_id: str) -> bool:
        """Set up persistence of seq; adopt the session from the service if its pages are not
        local. Returns True when seq was adopted (it is then running, not waiting)."""
        if getattr(seq, "media", None) is not None:
            return False  # media pages hash with their content: sessions here are text-only
        record = self._record(session_id)
        if record is not None and record.token_ids != seq.token_ids[: len(record.token_ids)]:
            # The prompt rewrites the conversation: the record no longer describes it.
            self._call(lambda: self.client.delete_session(session_id))
            record = None
        adopted = record is not None and self._adopt(seq, record)
        writer = self._call(lambda: SessionWriter(self.client, session_id, root=seq.root_hash))
        if writer is not None:
            self.writers[seq.request_id] = writer
            self.session_of[seq.request_id] = session_id
            self._steps_since_sync[seq.request_id] = 0
        return adopted

    def _record(self, session_id: str) -> SessionRecord | None:
        try:
            return self.client.get_session(session_id)
        except SessionNotFound:
            return None
        except (ServiceUnavailable, ValueError) as e:  # ValueError: IncompatibleModel
            logger.warning("session %r not adopted: %s", session_id, e)
            return None

    def _adopt(self, seq: Sequence, record: SessionRecord) -> bool:
        """Running from the record's stored pages, if they reach further than the local prefix
        cache and the pool and batch have room."""
        usable = self._usable_record(record, seq.num_tokens - 1)
        stored = usable.num_stored_tokens
        if stored == 0:
            return False
        manager, page_size = self.block_manager, self.page_size
        local = 0
        if manager.enable_prefix_caching and seq.enable_prefix_caching:
            local = len(manager.lookup(usable.page_hashes, seq.token_ids, seq.root_hash)) * page_size
        num_pages = len(usable.page_hashes) + (usable.tail_hash is not None)
        scheduler = self.scheduler
        full_batch = len(scheduler.running) >= scheduler.max_num_seqs
        if local >= stored:
            return False
        pool_fits = num_pages <= manager.num_free_pages and not full_batch
        if self.lane is not None and self.lane.can_adopt(seq, usable, pool_fits):
            return self._adopt_into_lane(seq, usable)
        if not pool_fits:
            return False
        pages = manager.allocate(num_pages)
        fetcher = LazyPageFetcher(self.client, usable, self.caches, pages)
        covered = fetcher.load_index()
        keep = -(-covered // page_size)
        manager.release(pages[keep:])
        if covered == 0:
            return False
        seq.block_table = pages[:keep]
        seq.num_computed_tokens = seq.num_cached_tokens = covered
        seq.enable_prefix_caching = False  # until every adopted page is resident (see poll)
        seq.status = SequenceStatus.RUNNING
        scheduler.running.append(seq)
        self.fetchers[seq.request_id] = (seq, fetcher)
        self.adoptions[seq.request_id] = fetcher.stats
        while len(self.adoptions) > 1_000:
            del self.adoptions[next(iter(self.adoptions))]
        # Dense attention reads every page: fetch them all now.
        for layer in range(len(self.caches)) if not self.sparse else self.dense_layers:
            fetcher.ensure(layer, range(fetcher.num_pages))
        self.stats.adopted += 1
        self.stats.adopted_tokens += covered
        self.stats.index_seconds += fetcher.stats.index_seconds
        self.latencies.append(("index_load", fetcher.stats.index_seconds))
        return True

    def _adopt_into_lane(self, seq: Sequence, record: SessionRecord) -> bool:
        """Adopt straight into the sparse-resident lane: the index now, K/V as selected (leased in
        place where the shards are in-process); seq decodes there from its first step."""
        covered = self._call(lambda: self.lane.adopt(seq, self.client, record))
        if not covered:
            return False
        seconds = self.lane.members[seq.request_id].session.adopt_phases.get("index_s", 0.0)
        self.stats.adopted += 1
        self.stats.adopted_tokens += covered
        self.stats.index_seconds += seconds
        self.latencies.append(("index_load", seconds))
        return True

    def _usable_record(self, record: SessionRecord, max_tokens: int) -> SessionRecord:
        """The record cut to the pages whose tokens all lie within the first max_tokens."""
        page_size = self.page_size
        full = min(len(record.page_hashes), max_tokens // page_size)
        keep_tail = full == len(record.page_hashes) and record.num_stored_tokens <= max_tokens
        return dataclasses.replace(
            record, page_hashes=record.page_hashes[:full],
            tail_hash=record.tail_hash if keep_tail else None,
            tail_tokens=record.tail_tokens if keep_tail else 0,
        )

    # ---- around each step -------------------------------------------------------------------
    def before_step(self, batch: ScheduledBatch) -> OpsWrapper | None:
        """Import prefetched pages, queue more; the ops that fetch for this batch (None: no
        adopted sequence in it still misses pages)."""
        for request_id, (seq, fetcher) in list(self.fetchers.items()):
            if seq.status is not SequenceStatus.RUNNING:
                if seq.status is SequenceStatus.FINISHED or seq.num_computed_tokens == 0:
                    del self.fetchers[request_id]  # finished, or preempted to recompute
                continue
            fetcher.block_table = list(seq.block_table)  # swap-in may have moved its pages
            fetcher.poll()
            if fetcher.complete:
                self._finish_adoption(seq, fetcher)
            else:
                fetcher.prefetch(self.prefetch_pages)
        rows = [(row, self.fetchers[s.request_id][1]) for row, s in enumerate(batch.seqs)
                if s.request_id in self.fetchers]
        return self._fetching_ops(rows) if rows else None

    def _finish_adoption(self, seq: Sequence, fetcher: LazyPageFetcher) -> None:
        """Every adopted page is resident: the sequence may now share its pages (prefix cache)."""
        del self.fetchers[seq.request_id]
        self.stats.on_demand_seconds += fetcher.stats.on_demand_seconds
        self.stats.kv_pages_on_demand += fetcher.stats.kv_pages_on_demand
        seq.enable_prefix_caching = True
        seq.page_hashes = []
        self.block_manager.commit(seq)

    def _fetching_ops(self, rows: list[tuple[int, LazyPageFetcher]]) -> OpsWrapper:
        """A function of the model's ops → the same ops whose indexers fetch, per batch row of an
        adopted sequence, the pages that row selected in that layer (before attention reads them)."""

        def fetch(selected: torch.Tensor, index_cache: torch.Tensor, row_slices: list[slice]) -> None:
            layer = self._layer_of.get(index_cache.data_ptr())
            if layer is None:
                return
            for (_, fetcher), rows_of_seq in zip(rows, row_slices, strict=True):
                picked = selected[rows_of_seq]
                fetches, start = fetcher.stats.on_demand_fetches, time.perf_counter()
                fetcher.ensure(layer, torch.unique(picked[picked >= 0]).tolist())
                if fetcher.stats.on_demand_fetches > fetches:  # a step waited on the service
                    self.latencies.append(("page_fetch", time.perf_counter() - start))

        def wrap(ops: AttentionOps) -> AttentionOps:
            def decode(q_index, index_cache, block_tables, *args, **kwargs):
                selected = ops.indexer_decode(q_index, index_cache, block_tables, *args, **kwargs)
                fetch(selected, index_cache, [slice(row, row + 1) for row, _ in rows])  # [B, Q, Hkv, K]
                return selected

            def prefill(q_index, index_cache, block_tables, seq_lens, cu_seqlens_q, *args, **kwargs):
                selected = ops.indexer_prefill(q_index, index_cache, block_tables, seq_lens, cu_seqlens_q,
                                               *args, **kwargs)  # [T, Hkv, K]
                cu = cu_seqlens_q.tolist()
                fetch(selected, index_cache, [slice(cu[row], cu[row + 1]) for row, _ in rows])
                return selected

            return dataclasses.replace(ops, indexer_decode=decode, indexer_prefill=prefill)

        return wrap

    def on_page_lost(self, batch: ScheduledBatch, error: PageLost) -> None:
        """A page an adopted sequence needed is gone: recompute those sequences from their tokens."""
        logger.warning("recomputing adopted sequences: %s", error)
        for seq in batch.seqs:
            if seq.request_id not in self.fetchers or seq.status is not SequenceStatus.RUNNING:
                continue
            del self.fetchers[seq.request_id]
            self.scheduler.running.remove(seq)
            self.scheduler.recompute(seq)
            self.stats.recomputed_after_loss += 1

    def after_token(self, seq: Sequence, finished: bool) -> None:
        """seq got a token: persist after its prefill, every sync_every decode steps, at the end."""
        writer = self.writers.get(seq.request_id)
        if writer is None:
            return
        steps = self._steps_since_sync[seq.request_id]
        if finished or seq.num_output_tokens == 1 or steps + 1 >= self.sync_every:
            self._sync(seq, writer)
            self._steps_since_sync[seq.request_id] = 0
        else:
            self._steps_since_sync[seq.request_id] = steps + 1
        if finished:
            self.forget(seq.request_id)

    def _sync(self, seq: Sequence, writer: SessionWriter) -> None:
        state = {**dataclasses.asdict(seq.sampling), "num_output_tokens": seq.num_output_tokens}
        caches, table = self.caches, seq.block_table
        if seq.status is SequenceStatus.RESIDENT:  # decoding sparse-resident: pages off the pool
            caches, table = self.lane.export(seq)
        done = self._call(lambda: writer.sync(seq.token_ids, caches, table,
                                              seq.num_computed_tokens, state, tail=True) or True)
        if done is None:
            self.forget(seq.request_id)  # the service is gone: stop persisting this request
        else:
            self.stats.syncs += 1

    def forget(self, request_id: str) -> None:
        for table in (self.writers, self.session_of, self._steps_since_sync):
            table.pop(request_id, None)

    def release(self, session_id: str) -> list[int]:
        """The session moves to another replica: persist a turn still running here up to its last
        token, and forget the session's unreferenced pages in the local prefix cache (so the router
        does not see them here); returns the page hashes dropped."""
        lane = [] if self.lane is None else [member.seq for member in self.lane.members.values()]
        for seq in [*self.scheduler.running, *lane]:
            if self.session_of.get(seq.request_id) == session_id:
                self.make_current(seq)
        record = self._record(session_id)
        return [] if record is None else self.block_manager.drop_cached(list(record.page_hashes))

    def unpin_idle(self, idle_s: float) -> int:
        """Release the pins of this model's sessions idle for idle_s seconds (any replica may do
        it; each record is unpinned once). Returns how many were released."""
        return self._call(lambda: self.client.unpin_idle_sessions(idle_s)) or 0

    def delete(self, session_id: str) -> bool:
        """The client deleted the session: drop its record (and its pins and tail page) from the
        service and its pages from the local prefix cache. True if the service held a record."""
        self.release(session_id)
        return bool(self._call(lambda: self.client.delete_session(session_id)))

    def make_current(self, seq: Sequence) -> None:
        """Persist a running session now (before an explicit move)."""
        writer = self.writers.get(seq.request_id)
        if writer is not None and seq.status in (SequenceStatus.RUNNING, SequenceStatus.RESIDENT):
            self._sync(seq, writer)

    def _call(self, fn):
        try:
            return fn()
        except (ServiceUnavailable, PageLost, PageLostInService, CapacityError) as e:
            logger.warning("KV cache service: %s", e)
            return None
