"""The engine's sparse-resident lane: long decoding requests leave the page pool and decode with
their index and only a working set of their K/V on the device (`resident_session.ResidentSession`).

Requests come here while the lane has room (`EngineConfig.sparse_residency_sessions`):
- a running request that has finished its prefill and whose context reaches `min_tokens` (after a
  step), or any decoding one the pool would preempt (`Scheduler.offload`): every page's K/V is
  written to a host tier (pinned on CUDA; kept for the next session of its size), its index pages
  are copied to its own index cache, and its pool pages are given back (the full ones stay in the
  prefix cache);
- a session request whose record the KV cache service holds (`adopt`, from `EngineSessions`): the
  index now, the K/V leased in place or read as selected; the tokens after the stored ones are
  decode steps that sample nothing.
A session is sized for its request (`session_pages`); its host tier may be a larger kept one.
A greedy request's session that ends is kept, with its CUDA graph, while the lane has room (its
device memory is inside the lane's reservation): the next session of the same size takes it over
(`ResidentSession.adopt(into=)`, `offload(into=)`), and its first step replays that graph.
Each engine step decodes every request here once, alone, beside the pool's batch:
- a greedy request without logprobs, penalties, bias or grammar through `SparseDecodeGraph` (on
  CUDA the step replays as one CUDA graph from its third on; the host sees the token only);
- any other request eagerly (`ResidentSession.decode_metadata`), its logits through the engine's
  sampler like the pool's rows (grammar masks included).
Greedy tokens are the pool's: the selection runs over the same index, and the pages it selects are
copied into the working set before the attention reads them (docs/design.md §3).

Layers that attend densely (MiniMax-M3's full_attention layers) read every page: a moved request
keeps all of their K/V on the device, and only its MSA layers decode from a working set.
A request that persists a session in the KV cache service keeps doing so from the lane: its writer
reads the pages from the host tier and the session's index (`export`). Not here: multi-rank
replicas, and requests still adopting a session into the pool (their pages arrive there).
"""

import dataclasses
import logging
import math
import time
from collections.abc import Callable

import torch

from msaserve.engine.kv.host_tier import HostKV, PageLostInService
from msaserve.engine.kv.resident_graph import SparseDecodeGraph
from msaserve.engine.kv.resident_session import (
    ResidentSession,
    allocate_resident_caches,
    caches_bytes,
    config_dense_layers,
    least_budget_pages,
)
from msaserve.engine.sequence import Sequence, SequenceStatus
from msaserve.kernels import AttentionOps
from msaserve.kvcache.client import KVCacheClient
from msaserve.kvcache.session_records import SessionRecord
from msaserve.models.cache import LayerKVCache
from msaserve.models.transformer import MSATransformer

logger = logging.getLogger(__name__)


def lane_budget_pages(config, max_pages: int, fraction: float) -> int:
    """K/V pages per layer on the device for a session of up to `max_pages` pages at `fraction`."""
    return min(max_pages, max(least_budget_pages(config), math.ceil(fraction * max_pages)))


def resident_session_bytes(config, max_pages: int, budget_pages: int, kv_dtype: torch.dtype,
                           index_dtype: torch.dtype) -> int:
    """Device bytes of one sparse-resident session of `max_pages` pages at `budget_pages`: its
    caches allocated on the meta device (as `engine.memory.page_bytes` sizes a pool page)."""
    caches, _ = allocate_resident_caches(config, max_pages, budget_pages, torch.device("meta"), kv_dtype,
                                         index_dtype, dense_layers=config_dense_layers(config))
    return caches_bytes(caches)


def refusal(model: MSATransformer, ops: AttentionOps, world_size: int) -> str | None:
    """Why this model cannot decode sparse-resident (None: it can)."""
    if world_size > 1:
        return f"a replica of {world_size} ranks: sparse residency runs on single-rank replicas"
    if not ops.sparse:
        return (f"attention_backend {model.attention_backend!r} attends densely: sparse residency needs an "
                "MSA backend (msa, triton or naive)")
    if len(config_dense_layers(model.config)) == model.config.num_layers:
        return "every layer of the model attends densely: sparse residency needs MSA layers"
    return None


@dataclasses.dataclass
class LaneStats:
    moved_in: int = 0
    """Requests moved out of the page pool into the lane."""
    moved_under_pressure: int = 0
    """Of those, requests the pool would have preempted (swapped out or recomputed) otherwise."""
    finished: int = 0
    steps: int = 0
    """Decode steps run in the lane (one token of one request each)."""
    graph_steps: int = 0
    """Of those, steps of a greedy request through `SparseDecodeGraph`."""
    replays: int = 0
    """Of those, steps replayed as a CUDA graph (requests that finished; CUDA only)."""
    pages_freed: int = 0
    """Pool pages the moves gave back."""
    move_seconds: float = 0.0
    host_tiers_allocated: int = 0
    """Host tiers allocated (the others were kept ones reused)."""
    sessions_reused: int = 0
    """Sessions that took over an ended one's device memory and CUDA graph (the others allocated)."""
    session_device_bytes: int = 0
    """Device bytes of the last moved request's session (`ResidentSession.gpu_bytes`)."""
    adopted: int = 0
    """Sessions adopted from the KV cache service straight into the lane (index first, K/V as
    selected), instead of into the pool."""
    adopt_seconds: float = 0.0
    catch_up_steps: int = 0
    """Steps that computed a known token (an adopted request's tokens after the stored ones)."""
    lost: int = 0
    """Requests whose pages the service lost mid-decode: handed back to be recomputed."""
    pages_fetched: int = 0
    """K/V (page, layer[, KV head]) copies host → device of the requests that finished."""
    evictions: int = 0
    """Working-set evictions of the requests that finished."""


@dataclasses.dataclass
class LaneStep:
    """What one lane step produced."""

    tokens: list[tuple[Sequence, int]] = dataclasses.field(default_factory=list)
    """(request, greedy token) of the plain greedy requests that sampled."""
    sampled: list[Sequence] = dataclasses.field(default_factory=list)
    """The other requests that sampled: their rows of `logits`."""
    logits: torch.Tensor | None = None
    """[len(sampled), vocab] fp32, to sample with the engine's sampler."""
    lost: list[Sequence] = dataclasses.field(default_factory=list)
    """Requests whose pages the service lost: out of the lane, to be recomputed."""


@dataclasses.dataclass
class _Member:
    seq: Sequence
    session: ResidentSession
    ops: AttentionOps
    """The engine's ops wrapped for the session (its eager steps)."""
    graph: SparseDecodeGraph | None
    """None until the request is decoded greedily (built on its first such step)."""


class SparseResidentLane:
    def __init__(self, model: MSATransformer, ops: AttentionOps, caches: list[LayerKVCache],
                 max_sessions: int, min_tokens: int, budget_fraction: float, max_pages: int) -> None:
        """caches: the engine's page pool (the pages of a request that moves are read from it);
        max_pages: the pages of the longest request (its index cache is that long)."""
        self.model, self.ops, self.caches = model, ops, caches
        self.max_sessions, self.min_tokens, self.max_pages = max_sessions, min_tokens, max_pages
        config = model.config
        self.budget_fraction = budget_fraction
        self.budget_pages = lane_budget_pages(config, max_pages, budget_fraction)
        """K/V pages per layer of a session of max_model_len (a shorter one keeps its own share)."""
        self.dense_layers = config_dense_layers(config)
        """Layers that read every page: a moved request keeps all of their K/V on the device."""
        if max_pages < least_budget_pages(config):
            raise ValueError(
                f"max_model_len gives {max_pages} pages: sparse residency needs at least "
                f"{least_budget_pages(config)} (the write ring and one step's selection of every KV head)")
        self.members: dict[str, _Member] = {}
        self._free_hosts: list[HostKV] = []
        """Host tiers of requests that finished, kept for the next move (pinning GiBs takes seconds)."""
        self._free_sessions: list[tuple[ResidentSession, SparseDecodeGraph]] = []
        """Ended greedy sessions, with their graphs, kept for the next session of their size (at
        most max_sessions with the members: the lane's device reservation); oldest first."""
        self.stats = LaneStats()

    def __len__(self) -> int:
        return len(self.members)

    def eligible(self, seq: Sequence, pressure: bool = False) -> bool:
        """A running request decoding (its prefill done) whose context reached min_tokens, or any
        decoding one under `pressure` (the pool would preempt it otherwise), while there is room."""
        return (seq.status is SequenceStatus.RUNNING and seq.num_uncomputed_tokens == 1
                and (pressure or seq.num_computed_tokens >= self.min_tokens)
                and len(self.members) < self.max_sessions)

    def session_pages(self, seq: Sequence) -> int:
        """Pages a session of seq holds room for: its prompt and every token it may generate,
        rounded up to a power of two, at most max_model_len's and at least one working set's."""
        need = -(-(seq.num_prompt_tokens + seq.sampling.max_tokens) // self.model.config.page_size)
        return max(least_budget_pages(self.model.config), min(self.max_pages, 1 << (need - 1).bit_length()))

    def _budget(self, pages: int) -> int:
        """K/V pages per layer on the device of a session of `pages` pages."""
        return lane_budget_pages(self.model.config, pages, self.budget_fraction)

    def _join(self, seq: Sequence, session: ResidentSession, graph: SparseDecodeGraph | None = None) -> None:
        """seq decodes here from its next step, through `session` (and `graph`, a kept one)."""
        seq.status = SequenceStatus.RESIDENT
        self.members[seq.request_id] = _Member(seq, session, session.wrap_ops(self.ops), graph)
        self.stats.session_device_bytes = session.gpu_bytes

    def _room_for(self, pages: int) -> tuple[ResidentSession | None, SparseDecodeGraph | None, HostKV | None]:
        """Where a new session of `pages` pages goes → (a kept session it takes over and its graph, or
        None; else a kept host tier, or None: it allocates one). Kept sessions of other sizes are
        given up as far as the lane's reservation needs (their host tiers kept)."""
        budget = self._budget(pages)
        device, dtype = self.caches[0].k_cache.device, self.caches[0].k_cache.dtype
        for i, (session, graph) in enumerate(self._free_sessions):
            if session.mismatch(self.model.config, pages, budget, None, device, dtype,
                                self.caches[0].index_cache.dtype, dense_layers=self.dense_layers) is None:
                del self._free_sessions[i]
                self.stats.sessions_reused += 1
                return session, graph, None
        while self._free_sessions and len(self.members) + len(self._free_sessions) >= self.max_sessions:
            self._keep_host(self._free_sessions.pop(0)[0].host)
        return None, None, self._host_for(pages)

    def _host_for(self, pages: int) -> HostKV | None:
        """The smallest kept host tier of at least `pages` pages (None: the session allocates one):
        a larger tier serves a smaller session, so sessions of varied lengths pin memory only when
        none kept is large enough. A kept session's tier is taken (the session given up) before a
        new one is pinned."""
        fits = [(host.present.shape[1], i) for i, host in enumerate(self._free_hosts)
                if host.present.shape[1] >= pages]
        if fits:
            return self._free_hosts.pop(min(fits)[1])
        kept = [(session.host.present.shape[1], i) for i, (session, _) in enumerate(self._free_sessions)
                if session.host.present.shape[1] >= pages]
        if kept:
            return self._free_sessions.pop(min(kept)[1])[0].host
        self.stats.host_tiers_allocated += 1
        return None

    def _keep_host(self, host: HostKV) -> None:
        """Keep a host tier for the next session (pinning GiBs takes seconds); at most max_sessions
        are kept, the oldest given back first."""
        self._free_hosts.append(host)
        del self._free_hosts[: max(0, len(self._free_hosts) - self.max_sessions)]

    def move_in(self, seq: Sequence, free_pages: Callable[[Sequence], None]) -> None:
        """seq's pages → a sparse-resident session; `free_pages(seq)` then gives its pool pages back."""
        t0 = time.perf_counter()
        pages = self.session_pages(seq)
        into, graph, host = self._room_for(pages)
        session = ResidentSession.offload(
            self.model.config, self.caches, seq.num_computed_tokens, self._budget(pages), pages,
            host=host, block_table=seq.block_table, dense_layers=self.dense_layers, into=into)
        pool_pages = len(seq.block_table)
        free_pages(seq)
        self._join(seq, session, graph)
        self.stats.moved_in += 1
        self.stats.pages_freed += pool_pages
        self.stats.move_seconds += time.perf_counter() - t0
        logger.info("[%s] decodes sparse-resident from token %d: %d pool pages freed, %d K/V pages per "
                    "layer on the device", seq.request_id, seq.num_computed_tokens, pool_pages,
                    session.budget_pages)

    def can_adopt(self, seq: Sequence, record: SessionRecord, pool_fits: bool) -> bool:
        """Whether to adopt seq's stored session into the lane: there is room, the record holds at
        least min_tokens, and seq's tokens after them are few (each is a decode step here) or the
        pool cannot take the session now. (Layers that attend densely get all of their stored K/V at
        the adoption.)"""
        remaining = seq.num_tokens - 1 - record.num_stored_tokens
        return (len(self.members) < self.max_sessions and record.num_stored_tokens >= self.min_tokens
                and (remaining <= self.catch_up_tokens or not pool_fits))

    catch_up_tokens = 64
    """An adopted request with more tokens than this after the stored ones goes to the pool (a
    prefill) when the pool can hold it; in the lane each such token is a decode step."""

    def adopt(self, seq: Sequence, client: KVCacheClient, record: SessionRecord) -> int:
        """seq's stored session → a sparse-resident session of the lane: its whole index now, its K/V
        leased where the service's in-process shards keep it or read as selected
        (`ResidentSession.adopt`) → the tokens it covers (0: none, nothing adopted)."""
        t0 = time.perf_counter()
        pages = self.session_pages(seq)
        (into, graph, host), cache = self._room_for(pages), self.caches[0]
        try:
            session, covered = ResidentSession.adopt(
                client, record, self.model.config, self._budget(pages), pages, cache.k_cache.device,
                cache.k_cache.dtype, cache.index_cache.dtype, host=host, into=into)
        except Exception:
            if into is not None:
                self._keep_host(into.host)
            elif host is not None:
                self._keep_host(host)
            raise
        if covered == 0:
            self._keep_session(session, graph)
            return 0
        seq.num_computed_tokens = seq.num_cached_tokens = covered
        self._join(seq, session, graph)
        self.stats.adopted += 1
        self.stats.adopt_seconds += time.perf_counter() - t0
        logger.info("[%s] adopted sparse-resident from the KV cache service: %d tokens stored, %d to "
                    "compute, %.3f s", seq.request_id, covered, seq.num_uncomputed_tokens,
                    time.perf_counter() - t0)
        return covered

    def finish(self, seq: Sequence) -> None:
        """seq is done (finished or aborted): its device memory goes, its host tier is kept."""
        if self._release(seq):
            self.stats.finished += 1
            seq.status = SequenceStatus.FINISHED

    def _keep_session(self, session: ResidentSession, graph: SparseDecodeGraph | None) -> None:
        """An ended session: kept with its graph for the next one of its size while the lane has
        room (its device memory is part of the lane's reservation), else only its host tier."""
        if graph is not None and len(self.members) + len(self._free_sessions) < self.max_sessions:
            self._free_sessions.append((session, graph))
        else:
            self._keep_host(session.host)

    def _release(self, seq: Sequence, keep: bool = True) -> bool:
        member = self.members.pop(seq.request_id, None)
        if member is None:
            return False
        host = member.session.host
        host.cancel_pending()  # an adopted session's background reads
        if host.lease is not None:  # an adopted session's K/V leased from the service: handed back now
            if member.session.device.type == "cuda":
                torch.cuda.synchronize(member.session.device)  # no kernel reads the leased pages any more
            host.release_lease()
        host.release_ended_leases()  # an adoption's index leases, if it ended before its second step
        stats = member.session.stats
        self.stats.replays += 0 if member.graph is None else member.graph.replays
        self.stats.pages_fetched += stats.pages_fetched
        self.stats.evictions += stats.evictions
        if keep:
            self._keep_session(member.session, member.graph)
        else:
            self._keep_host(host)
        return True

    @torch.inference_mode()
    def step(self, greedy: Callable[[Sequence], bool]) -> LaneStep:
        """One decode step of every member (its next uncomputed token; only a member at its last
        token samples). greedy(seq): whether seq's token is the argmax with nothing else asked of
        its logits. A member whose pages the service lost leaves the lane, reset to be recomputed."""
        out = LaneStep()
        logits: list[torch.Tensor] = []
        for member in list(self.members.values()):
            seq, session = member.seq, member.session
            position = seq.num_computed_tokens
            token = seq.token_ids[position]
            samples = position + 1 == seq.num_tokens
            try:
                if greedy(seq) or not samples:
                    if member.graph is None:
                        member.graph = SparseDecodeGraph(session, self.model, self.ops)
                    next_token = member.graph.step(token, position)
                    self.stats.graph_steps += 1
                    if samples:
                        out.tokens.append((seq, next_token))
                else:
                    meta = session.decode_metadata(position)
                    ids = torch.tensor([token], device=session.device)
                    hidden = self.model(ids, meta, session.caches, ops=member.ops)
                    session.check_pages()
                    out.sampled.append(seq)
                    logits.append(self.model.compute_logits(hidden))
            except PageLostInService as e:
                logger.warning("[%s] leaves the sparse-resident lane to be recomputed: %s", seq.request_id, e)
                self._release(seq, keep=False)
                self.stats.lost += 1
                out.lost.append(seq)
                continue
            if not samples:
                self.stats.catch_up_steps += 1
            seq.num_computed_tokens += 1
            self.stats.steps += 1
            session.prefetch(self.prefetch_pages)  # an adopted session whose host tier still fills
        out.logits = torch.cat(logits).float() if logits else None
        return out

    prefetch_pages = 64
    """Background service reads an adopted member queues after each of its steps (predicted pages
    first) until its host tier holds every page (`ResidentSession.prefetch`)."""

    def export(self, seq: Sequence) -> tuple[list[LayerKVCache], list[int]]:
        """seq's pages as caches and a block table to persist them from (`SessionWriter.sync`)."""
        return self.members[seq.request_id].session.export_caches()

    def session_of(self, seq: Sequence) -> ResidentSession:
        return self.members[seq.request_id].session
