"""The engine's sparse-resident lane: long decoding requests leave the page pool and decode with
their index and only a working set of their K/V on the device (`resident_session.ResidentSession`).

A running request that has finished its prefill and whose context reaches `min_tokens` moves here
when the lane has room (`EngineConfig.sparse_residency_sessions`): every page's K/V is written to a
host tier (pinned on CUDA; kept for the next request that moves), its index pages are copied to its
own index cache, and its pages in the pool are given back (the full ones stay in the prefix cache).
From then on each engine step decodes it alone, beside the pool's batch:
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

from msaserve.engine.kv.host_tier import HostKV
from msaserve.engine.kv.resident_graph import SparseDecodeGraph
from msaserve.engine.kv.resident_session import ResidentSession, config_dense_layers
from msaserve.engine.sequence import Sequence, SequenceStatus
from msaserve.kernels import AttentionOps
from msaserve.models.cache import LayerKVCache
from msaserve.models.transformer import MSATransformer

logger = logging.getLogger(__name__)


def least_budget_pages(config) -> int:
    """The fewest K/V pages a layer's working set may have: the write ring and one step's selection."""
    return max(2, config.n_local + 1) + config.num_kv_heads * config.top_k


def lane_budget_pages(config, max_pages: int, fraction: float) -> int:
    """K/V pages per layer on the device for a session of up to `max_pages` pages at `fraction`."""
    return min(max_pages, max(least_budget_pages(config), math.ceil(fraction * max_pages)))


def model_dense_layers(model: MSATransformer) -> tuple[int, ...]:
    """The layers that attend densely (MiniMax-M3's full_attention layers, `config.dense_layers`)."""
    return tuple(getattr(model, "dense_layers", ()) or config_dense_layers(model.config))


def resident_session_bytes(config, max_pages: int, budget_pages: int, kv_dtype: torch.dtype,
                           index_dtype: torch.dtype, dense_layers: int = 0) -> int:
    """Device bytes of one sparse-resident session: each MSA layer's index cache of `max_pages`
    pages (and fp8 scales) and its K/V pool of `budget_pages`; each of the `dense_layers` layers
    that attend densely, all `max_pages` pages of K/V."""
    c = config
    page_kv = 2 * c.page_size * c.num_kv_heads * c.head_dim * kv_dtype.itemsize
    index = max_pages * c.page_size * c.num_index_heads * c.index_head_dim * index_dtype.itemsize
    fp8 = index_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    scales = max_pages * c.page_size * c.num_index_heads * 4 if fp8 else 0
    sparse_layers = c.num_layers - dense_layers
    return sparse_layers * (budget_pages * page_kv + index + scales) + dense_layers * max_pages * page_kv


def refusal(model: MSATransformer, ops: AttentionOps, world_size: int) -> str | None:
    """Why this model cannot decode sparse-resident (None: it can)."""
    if not ops.sparse:
        return (f"attention_backend {model.attention_backend!r} attends densely: sparse residency needs an "
                "MSA backend (msa, triton or naive)")
    if len(model_dense_layers(model)) == model.config.num_layers:
        return "every layer of the model attends densely: sparse residency needs MSA layers"
    if world_size > 1:
        return f"a replica of {world_size} ranks: sparse residency runs on single-rank replicas"
    return None


@dataclasses.dataclass
class LaneStats:
    moved_in: int = 0
    """Requests moved out of the page pool into the lane."""
    finished: int = 0
    steps: int = 0
    """Decode steps run in the lane (one token of one request each)."""
    graph_steps: int = 0
    """Of those, steps of a greedy request through `SparseDecodeGraph`."""
    pages_freed: int = 0
    """Pool pages the moves gave back."""
    move_seconds: float = 0.0
    session_device_bytes: int = 0
    """Device bytes of the last moved request's session (`ResidentSession.gpu_bytes`)."""
    pages_fetched: int = 0
    """K/V (page, layer[, KV head]) copies host → device of the requests that finished."""
    evictions: int = 0
    """Working-set evictions of the requests that finished."""


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
        self.budget_pages = lane_budget_pages(config, max_pages, budget_fraction)
        self.dense_layers = model_dense_layers(model)
        """Layers that read every page: a moved request keeps all of their K/V on the device."""
        if self.budget_pages < least_budget_pages(config):
            raise ValueError(
                f"max_model_len gives {max_pages} pages: sparse residency needs at least "
                f"{least_budget_pages(config)} (the write ring and one step's selection of every KV head)")
        self.members: dict[str, _Member] = {}
        self._free_hosts: list[HostKV] = []
        """Host tiers of requests that finished, kept for the next move (pinning GiBs takes seconds)."""
        self.stats = LaneStats()

    def __len__(self) -> int:
        return len(self.members)

    def __contains__(self, seq: Sequence) -> bool:
        return seq.request_id in self.members

    def eligible(self, seq: Sequence) -> bool:
        """A running request decoding (its prefill done) whose context reached min_tokens."""
        return (seq.status is SequenceStatus.RUNNING and seq.num_uncomputed_tokens == 1
                and seq.num_computed_tokens >= self.min_tokens and len(self.members) < self.max_sessions)

    def move_in(self, seq: Sequence, free_pages: Callable[[Sequence], None]) -> None:
        """seq's pages → a sparse-resident session; `free_pages(seq)` then gives its pool pages back."""
        t0 = time.perf_counter()
        host = self._free_hosts.pop() if self._free_hosts else None
        session = ResidentSession.offload(self.model.config, self.caches, seq.num_computed_tokens,
                                          self.budget_pages, self.max_pages, host=host,
                                          block_table=seq.block_table, dense_layers=self.dense_layers)
        pages = len(seq.block_table)
        free_pages(seq)
        seq.status = SequenceStatus.RESIDENT
        self.members[seq.request_id] = _Member(seq, session, session.wrap_ops(self.ops), None)
        self.stats.moved_in += 1
        self.stats.pages_freed += pages
        self.stats.session_device_bytes = session.gpu_bytes
        self.stats.move_seconds += time.perf_counter() - t0
        logger.info("[%s] decodes sparse-resident from token %d: %d pool pages freed, %d K/V pages per "
                    "layer on the device", seq.request_id, seq.num_computed_tokens, pages, self.budget_pages)

    def finish(self, seq: Sequence) -> None:
        """seq is done (finished or aborted): its device memory goes, its host tier is kept."""
        member = self.members.pop(seq.request_id, None)
        if member is None:
            return
        self._free_hosts.append(member.session.host)
        stats = member.session.stats
        self.stats.pages_fetched += stats.pages_fetched
        self.stats.evictions += stats.evictions
        self.stats.finished += 1
        seq.status = SequenceStatus.FINISHED

    @torch.inference_mode()
    def step(self, greedy: Callable[[Sequence], bool]
             ) -> tuple[list[tuple[Sequence, int]], list[Sequence], torch.Tensor | None]:
        """One decode step of every member → (greedy (request, token)s, the other requests, their
        logits [n, vocab] fp32 to sample, or None). greedy(seq): whether seq's token is the argmax
        with nothing else asked of its logits."""
        tokens: list[tuple[Sequence, int]] = []
        sampled: list[Sequence] = []
        logits: list[torch.Tensor] = []
        for member in list(self.members.values()):
            seq, session = member.seq, member.session
            position = seq.num_computed_tokens
            if greedy(seq):
                if member.graph is None:
                    member.graph = SparseDecodeGraph(session, self.model, self.ops)
                tokens.append((seq, member.graph.step(seq.token_ids[-1], position)))
                self.stats.graph_steps += 1
            else:
                meta = session.decode_metadata(position)
                ids = torch.tensor([seq.token_ids[-1]], device=session.device)
                hidden = self.model(ids, meta, session.caches, ops=member.ops)
                session.check_pages()
                sampled.append(seq)
                logits.append(self.model.compute_logits(hidden))
            seq.num_computed_tokens += 1
            self.stats.steps += 1
        return tokens, sampled, (torch.cat(logits).float() if logits else None)

    def export(self, seq: Sequence) -> tuple[list[LayerKVCache], list[int]]:
        """seq's pages as caches and a block table to persist them from (`SessionWriter.sync`)."""
        return self.members[seq.request_id].session.export_caches()

    def session_of(self, seq: Sequence) -> ResidentSession:
        return self.members[seq.request_id].session
