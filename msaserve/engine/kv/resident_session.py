"""A session that decodes with every index page on the GPU and only a working set of its K/V.

Per MSA layer the session owns an index cache of `max_pages` pages (logical page = physical page)
and a K/V pool of `budget_pages` slots, whose policy (`residency.WorkingSet`'s) runs on the device
(`device_working_set.DeviceWorkingSet`). A decode step:
1. `decode_metadata(position)` — on a page boundary the page just filled is written back to the
   host tier (write-behind) and the new page takes its ring slot; the new token's K/V go to that
   slot (`AttentionMetadata.kv_slot_mapping`), its index key to its logical page;
2. the wrapped `indexer_decode` (`wrap_ops`) selects blocks over the resident index; the device
   admits the selection (`kernels/residency`) and one launch copies the misses from the pinned
   host tier (`kernels/page_gather`, through a UVA view on CUDA) — in stream order, before
   attention reads them, with no host sync. Only while the host tier lacks pages (an adopted
   session whose pages are still in the KV cache service) does the host read each layer's misses
   (one sync) and make them present first;
3. the wrapped `sparse_decode` attends through the layer's logical page → slot table.
The K/V read are bit for bit the fully resident session's, so greedy tokens are identical.
An adopted session whose service shards run in this process with a K/V arena leases every stored
page instead (`adopt(lease_kv=True)`, the default): the miss fill reads them where the shards keep
them, each checked on the device at its first copy (`check_pages` after the step), and no page is
read into the host tier at all.
Between steps, `prefetch` queues background service reads on the host tier's worker thread in
predicted order (each layer's previous selection and the local window first, then the newest
pages), never in page order, until the host tier holds every page.

Layers that attend densely (no index branch) would read every page: not supported here.
"""

import contextlib
import dataclasses
import gc
import time
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from msaserve.engine.kv.adoption import LazyPageFetcher
from msaserve.engine.kv.device_working_set import DeviceWorkingSet
from msaserve.engine.kv.host_tier import HostKV, PageLostInService, ServiceSource
from msaserve.engine.kv.staging import indexed_device
from msaserve.kernels import AttentionOps
from msaserve.kernels.checksum import verify_pages
from msaserve.kernels.page_gather import gather_head_pages, gather_pages, host_view
from msaserve.kvcache.client import KVCacheClient
from msaserve.kvcache.session_records import SessionRecord
from msaserve.models.cache import LayerKVCache
from msaserve.models.config import MSAConfig
from msaserve.models.metadata import AttentionMetadata


@dataclasses.dataclass
class ResidencyStats:
    steps: int = 0
    fetches: int = 0
    """(layer, step) pairs that copied pages in."""
    pages_fetched: int = 0
    """(page, layer) K/V pages copied host → GPU; per head, (page, layer, KV head) columns."""
    bytes_fetched: int = 0
    pages_written_back: int = 0
    evictions: int = 0
    host_steps: int = 0
    """(layer, step) pairs whose misses went through the host (a sync): see `synced_steps`."""
    fetch_log: list[tuple[int, int, tuple[int, ...]]] = dataclasses.field(default_factory=list)
    """(step, layer, pages) of every fetch that went through the host (steps of an adopted
    session while pages are still in the service), in order (the first 10,000)."""


def allocate_resident_caches(
    config: MSAConfig, max_pages: int, budget_pages: int, device: torch.device, dtype: torch.dtype,
    index_dtype: torch.dtype | None = None, per_head: bool = True, dense_layers: Sequence[int] = (),
) -> tuple[list[LayerKVCache], list[torch.Tensor]]:
    """→ (caches, pools). Per layer: K and V of budget_pages, views of one pool
    [budget_pages, 2, P, Hkv, D] (a page moves in one copy), or head-major [budget_pages, 2, Hkv, P, D]
    with `per_head` (each KV head's column of a slot holds a page of its own); index cache
    [max_pages, P, HkI, DI]. The K and V caches are [budget_pages, P, Hkv, D] views either way.
    A layer in `dense_layers` reads every page: its pool [max_pages, 2, P, Hkv, D] holds each logical
    page at its own slot (its index cache, never written by the layer, is kept whole all the same: an
    adoption's index load and an export read every layer's)."""
    index_dtype = index_dtype or dtype
    fp8 = index_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    c = config
    pool_shape = ((budget_pages, 2, c.num_kv_heads, c.page_size, c.head_dim) if per_head
                  else (budget_pages, 2, c.page_size, c.num_kv_heads, c.head_dim))
    dense_shape = (max_pages, 2, c.page_size, c.num_kv_heads, c.head_dim)
    dense = set(dense_layers)
    pools = [torch.zeros(dense_shape if layer in dense else pool_shape, device=device, dtype=dtype)
             for layer in range(c.num_layers)]

    def view(layer: int, kv: int) -> torch.Tensor:  # strided: the kernels take any strides
        pool = pools[layer]
        return pool[:, kv].permute(0, 2, 1, 3) if per_head and layer not in dense else pool[:, kv]

    index_shape = (max_pages, c.page_size, c.num_index_heads, c.index_head_dim)
    caches = [
        LayerKVCache(
            k_cache=view(layer, 0),
            v_cache=view(layer, 1),
            index_cache=torch.zeros(index_shape, device=device, dtype=index_dtype),
            index_scale=torch.ones(index_shape[:3], device=device, dtype=torch.float32) if fp8 else None,
        )
        for layer in range(c.num_layers)
    ]
    return caches, pools


def least_budget_pages(config: MSAConfig) -> int:
    """The fewest K/V pages a layer's working set may have: the write ring (`n_local` + 1 pages, at
    least 2) and one step's selection of every KV head."""
    return max(2, config.n_local + 1) + config.num_kv_heads * config.top_k


def caches_bytes(caches: Sequence[LayerKVCache]) -> int:
    """Bytes of the caches' K, V, index and scale tensors (K and V views of one pool count once each)."""
    tensors = [t for c in caches for t in (c.k_cache, c.v_cache, c.index_cache, c.index_scale)]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def config_dense_layers(config: MSAConfig) -> tuple[int, ...]:
    """Layers of `config` that attend densely, reading every page: `dense_layers`, and MiniMax-M3's
    `full_attention` layers (`layer_types`)."""
    kinds = getattr(config, "layer_types", ())
    full = (i for i, kind in enumerate(kinds) if kind == "full_attention")
    return tuple(sorted({*config.dense_layers, *full}))


@dataclasses.dataclass(frozen=True)
class HostHoldsPages:
    """`ResidentSession.offload(host=HostHoldsPages(tier))`: the tier already holds the session's
    pages, so none is written again."""

    host: HostKV


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No automatic garbage collection inside (it runs again afterwards, as it was); also a
    decorator (`@gc_paused()`)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class ResidentSession:
    def __init__(self, config: MSAConfig, max_pages: int, budget_pages: int, host: HostKV,
                 device: torch.device, dtype: torch.dtype, index_dtype: torch.dtype | None = None,
                 per_head: bool = True, dense_layers: Sequence[int] | None = None) -> None:
        """budget_pages: K/V pages per layer on the GPU (≥ ring + Hkv·top_k, so one step's
        selection always fits); max_pages: pages the session may reach (its index is all there).
        per_head (the default): each KV head keeps its own working set in its column of the slots
        (a miss moves that head's K and V of the page, 1/Hkv of it; `budget_pages` then holds Hkv
        times as many (page, head) columns); False: a slot holds a whole page (every head's K/V).
        On the H200 (m3-mini, 1M tokens, 10 % budget, CUDA graphs) per head costs 1.24x the
        resident step against 1.54x per page (benchmarks/results/kvcache.json).
        dense_layers: layers that attend densely (no index branch, e.g. MiniMax-M3's full_attention
        layers; None: the config's, `config_dense_layers`): they read every page, so they keep all of
        their K/V on the device at its logical page (their K/V are written at `slot_mapping`,
        `AttentionMetadata.kv_slot_mapping`), and only the other layers decode from a working set."""
        self.config, self.max_pages, self.device, self.host = config, max_pages, indexed_device(device), host
        self.ring = max(2, config.n_local + 1)
        least = least_budget_pages(config)
        if budget_pages < least or budget_pages > max_pages:
            raise ValueError(f"budget_pages={budget_pages} is invalid: allowed {least} (ring {self.ring} + "
                             f"Hkv·top_k) ≤ budget_pages ≤ max_pages={max_pages}")
        if host.present.shape[1] < max_pages:
            raise ValueError(f"host tier of {host.present.shape[1]} pages is invalid for "
                             f"max_pages={max_pages}: allowed a tier of at least max_pages pages")
        self.page_size, self.budget_pages = config.page_size, budget_pages
        self.per_head, self.heads = per_head, config.num_kv_heads
        self.dense_layers = tuple(sorted(set(config_dense_layers(config) if dense_layers is None
                                             else dense_layers)))
        self.sparse_layers = tuple(i for i in range(config.num_layers) if i not in self.dense_layers)
        self.caches, self.pools = allocate_resident_caches(config, max_pages, budget_pages, self.device,
                                                           dtype, index_dtype, per_head, self.dense_layers)
        # The working set's rows: one per layer, or one per (layer, KV head) — row layer·Hkv + head.
        rows = len(self.caches) * (self.heads if per_head else 1)
        self.working = DeviceWorkingSet(rows, budget_pages, self.ring, max_pages, self.device)
        # Per head, the sparse attention reads each head's column of a slot as a page of its own:
        # the head-major pool [S, 2, H, P, D] viewed as S·2·H one-head pages [P, 1, D], where K of
        # (slot, head) is page slot·2H + head and V the page H further on.
        h = self.heads
        self._columns = [(pool.view(-1, config.page_size, 1, config.head_dim)[:-h],
                          pool.view(-1, config.page_size, 1, config.head_dim)[h:])
                         if layer in self.sparse_layers else None
                         for layer, pool in enumerate(self.pools)] if per_head else []
        self._head_ids = torch.arange(h, dtype=torch.int32, device=self.device)[:, None]
        self.index_table = torch.arange(max_pages, dtype=torch.int32, device=self.device)[None]
        self._layer_of_index = {self.caches[i].index_cache.data_ptr(): i for i in self.sparse_layers}
        self._layer_of_kv = {self.caches[i].k_cache.data_ptr(): i for i in self.sparse_layers}
        self.step_number = torch.zeros(1, dtype=torch.int64, device=self.device)
        """The current step's number on the device: the admission reads it there (a captured
        step replays with the number of its replay, `resident_graph.py`)."""
        self.generation = 0
        """Sessions this object has held before the current one (`adopt(into=)`, `offload(into=)`
        reuse its device memory, so a `SparseDecodeGraph` captured for it replays for the next)."""
        # Where the miss fill reads the host tier: the pinned memory itself on CPU, a UVA view of it
        # on CUDA (no host sync); None: the host learns the misses (a sync per layer) and copies.
        self._host_src = host.data if self.device.type == "cpu" else host_view(host.data, self.device)
        # Steps that need no host sync even while the host tier fills (per head, with a device view
        # of it, and room in the working set for a step run again L + 2 times): the miss fill checks
        # each page's presence on the device, skips the absent ones and names their slots; the
        # caller (`SparseDecodeGraph`) then reads those pages in and runs the step again (`repair`).
        room = budget_pages >= self.ring + (len(self.caches) + 2) * config.top_k
        self._present_dev = (torch.zeros(len(self.caches), max_pages, dtype=torch.bool, device=self.device)
                             if per_head and self._host_src is not None and room and not self.dense_layers
                             else None)
        self._skipped: list[torch.Tensor | None] = [None] * len(self.caches)
        self._step_src: list[torch.Tensor | None] = [None] * len(self.caches)
        # Pages the host tier leased from the service (`_use_lease`): the miss fill reads them where
        # they lie, and each is checked against its stored checksum on the device at first use.
        self._src_flat: torch.Tensor | None = None
        self._elem_offsets: torch.Tensor | None = None
        self._byte_offsets: torch.Tensor | None = None
        self._expected: torch.Tensor | None = None
        self._verified: torch.Tensor | None = None
        self._failures: torch.Tensor | None = None
        """[L, 2] int64 on the device: per layer, leased pages that failed their check, and one of them."""
        self.check_stream: torch.cuda.Stream | None = None
        """Where leased pages are checked: None, the compute stream (in order, before the attention);
        a side stream (`SparseDecodeGraph` on CUDA sets one): each layer's check forks there after its
        miss fill and runs beside the rest of the step, and `join_checks` (the step's end) joins them —
        a 256 KiB page hashed over PCIe is one program's ~0.16 ms of dependent reads."""
        self._checks_forked = False
        self._check_inputs: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(self.caches)
        self._start_state()

    def _start_state(self) -> None:
        """The host-side state of a session that holds no page yet (a new object, or one reused:
        `_reuse`). The tensors a captured step reads keep their memory."""
        self.write_page = -1
        self.last_selected: list[list[int]] = [[] for _ in self.caches]
        self._stats = ResidencyStats()
        self._host_complete = False
        self.adopt_phases: dict[str, float] = {}
        """Seconds of `adopt`'s phases (host_reset_s, allocate_s, index_s: the whole index and a stored
        tail's K/V, lease_s), measured on the host: device work still queued is not in them."""
        self.lease_phases: dict[str, float] = {}
        """`adopt_phases["lease_s"]` in parts: request_s (asked of the shards, the index releases
        handed over), wait_s (for their answers), attach_s (`HostKV.attach_lease`), tables_s (the
        device's lease tables), rest_s (the write page entered)."""
        self._presence_final = False
        self.speculating = False
        """Set by `SparseDecodeGraph` around its step body (see `can_speculate`)."""
        self.repairs = 0
        """Steps run again because pages they selected were not in the host tier yet."""
        self._unchecked = False

    # ---- reuse: the next session in this one's device memory --------------------------------
    def mismatch(self, config: MSAConfig, max_pages: int, budget_pages: int, host: HostKV | None,
                 device: torch.device, dtype: torch.dtype, index_dtype: torch.dtype | None = None,
                 per_head: bool = True, dense_layers: Sequence[int] | None = None) -> str | None:
        """Why a session of these settings cannot live in this one's memory (`adopt(into=)`,
        `offload(into=)`), or None: the same model, sizes, dtypes and device, and this session's
        host tier (a captured step reads it through its address) or none given."""
        dense = tuple(sorted(set(config_dense_layers(config) if dense_layers is None else dense_layers)))
        theirs = dict(config=config, max_pages=max_pages, budget_pages=budget_pages,
                      device=indexed_device(device), dtype=dtype, index_dtype=index_dtype or dtype,
                      per_head=per_head, dense_layers=dense)
        ours = dict(config=self.config, max_pages=self.max_pages, budget_pages=self.budget_pages,
                    device=self.device, dtype=self.pools[0].dtype,
                    index_dtype=self.caches[0].index_cache.dtype, per_head=self.per_head,
                    dense_layers=self.dense_layers)
        for name, value in theirs.items():
            if value != ours[name]:
                shown = "its own" if name == "config" else repr(ours[name])
                return f"{name}={'(another config)' if name == 'config' else repr(value)}: allowed {shown}"
        if host is not None and host is not self.host:
            return "host is another host tier: allowed None or this session's own (a captured step reads it)"
        return None

    def _reuse(self) -> "ResidentSession":
        """This object, emptied for the next session (its host tier reset by the caller, which
        waited for the device): no page resident, step 0; the device tensors keep their memory."""
        if self.device.type == "cuda":  # the last session's steps (and checks on a side stream) ended
            torch.cuda.synchronize(self.device)
        self.working.reset()
        self.step_number.zero_()
        if self._present_dev is not None:
            self._present_dev.zero_()
        self._start_state()
        self.generation += 1
        return self

    def graph_inputs(self) -> tuple[int, ...]:
        """Addresses of the tensors set outside a step that a captured step reads (besides those
        allocated with the object): a `SparseDecodeGraph` captures again when they change."""
        tensors = (self._host_src, self._src_flat, self._elem_offsets, self._byte_offsets, self._expected,
                   self._verified, self._failures, self._present_dev)
        return tuple(-1 if t is None else t.data_ptr() for t in tensors)

    # ---- building one -------------------------------------------------------------------------
    @classmethod
    def offload(cls, config: MSAConfig, caches: Sequence[LayerKVCache], num_tokens: int, budget_pages: int,
                max_pages: int, host: HostKV | HostHoldsPages | None = None, per_head: bool = True,
                block_table: Sequence[int] | None = None, dense_layers: Sequence[int] | None = None,
                into: "ResidentSession | None" = None) -> "ResidentSession":
        """A session held fully resident in `caches` → sparse resident: its index copied to its
        logical pages, every page's K/V written to the (pinned) host tier, the page being written to
        its ring slot. block_table: the physical page of each logical page (an engine's paged pool;
        None: logical page = physical page). host: a host tier to reuse (reset, then written), or
        `HostHoldsPages` wrapped around one that already holds these pages (benchmarks offload one
        session at several budgets). dense_layers: layers that read every page (their K/V stay whole on
        the device, see `__init__`). into: a session that ended, whose device memory and host tier
        this one takes over (as `adopt`'s)."""
        first = caches[0]
        device, dtype = first.k_cache.device, first.k_cache.dtype
        if into is not None:
            given = host.host if isinstance(host, HostHoldsPages) else host
            why = into.mismatch(config, max_pages, budget_pages, given, device, dtype,
                                first.index_cache.dtype, per_head, dense_layers)
            if why is not None:
                raise ValueError(f"into: the session cannot take this one: {why}")
            host = host if given is not None else into.host
        pages = -(-num_tokens // config.page_size)
        table = torch.as_tensor(list(range(pages)) if block_table is None else list(block_table[:pages]),
                                dtype=torch.long, device=device)
        if len(table) < pages:
            raise ValueError(f"block_table has {len(table)} pages: allowed at least the {pages} pages of "
                             f"num_tokens={num_tokens}")
        if isinstance(host, HostHoldsPages):
            host = host.host
        else:
            if host is None:
                host = HostKV(len(caches), max_pages, tuple(first.k_cache.shape[1:]), dtype,
                              pin=device.type == "cuda")
            else:
                host.reset(None)
            for layer, src in enumerate(caches):
                for start in range(0, pages, 1024):  # bounded temporaries on the device
                    rows = table[start : start + 1024]
                    host.write(layer, range(start, start + len(rows)),
                               torch.stack([src.k_cache[rows], src.v_cache[rows]], dim=1))
        if into is not None:
            session = into._reuse()
            session._use_lease()  # (a reused object's lease tables: every page in its own row)
        else:
            session = cls(config, max_pages, budget_pages, host, device, dtype, first.index_cache.dtype,
                          per_head, dense_layers)
        for layer in session.dense_layers:
            src, pool = caches[layer], session.pools[layer]
            pool[:pages, 0] = src.k_cache[table]
            pool[:pages, 1] = src.v_cache[table]
        for src, dst in zip(caches, session.caches, strict=True):
            dst.index_cache[:pages] = src.index_cache[table]
            if src.index_scale is not None:
                dst.index_scale[:pages] = src.index_scale[table]
        session._enter_page(num_tokens // config.page_size, load=True)
        return session

    @classmethod
    @gc_paused()
    def adopt(cls, client: KVCacheClient, record: SessionRecord, config: MSAConfig, budget_pages: int,
              max_pages: int, device: torch.device, dtype: torch.dtype,
              index_dtype: torch.dtype | None = None, host: HostKV | None = None, per_head: bool = True,
              lease_kv: bool = True, into: "ResidentSession | None" = None) -> tuple["ResidentSession", int]:
        """Adopt a stored session: the whole index now, K/V pages as they are selected (read from
        the service into the pinned host tier, then into the working set) → (session, tokens
        covered; the caller runs the record's remaining tokens). host: a host tier to reuse (a
        replica keeps its pinned memory allocated: pinning GiBs takes seconds). lease_kv (the
        default): where the shards run in this process and keep K/V in an arena (pinned, on CUDA),
        every stored page's K/V is leased and read where it lies — no read into the host tier, no
        background fill, no step through the host — each page checked against its stored checksum
        on the device at its first copy (`check_pages`); False: pages come by reads as before.
        into: a session that ended (nothing reads it any more) whose device memory and host tier
        the new one takes over (`mismatch` says which settings must agree): a `SparseDecodeGraph`
        built for it replays the new session's steps from its first, with no warm-up or capture.

        The garbage collector waits until the adoption is done: a full collection over the shards'
        and the engine's objects takes tens of ms, and the adoption allocates enough to start one
        (on the H200 the host-tier reset alone varied from 2 to 20 ms)."""
        t0 = time.perf_counter()
        hashes = list(record.page_hashes) + ([record.tail_hash] if record.tail_hash is not None else [])
        c = config
        source = ServiceSource(client, hashes, record.session_id)
        if into is not None:
            why = into.mismatch(config, max_pages, budget_pages, host, device, dtype, index_dtype, per_head)
            if why is not None:
                raise ValueError(f"into: the session cannot take this one: {why}")
            host = into.host
        if host is None:
            host = HostKV(c.num_layers, max_pages, (c.page_size, c.num_kv_heads, c.head_dim), dtype,
                          pin=torch.device(device).type == "cuda", source=source)
        else:
            host.reset(source)
        t1 = time.perf_counter()
        session = (into._reuse() if into is not None
                   else cls(config, max_pages, budget_pages, host, device, dtype, index_dtype, per_head))
        t2 = time.perf_counter()
        ring = session.ring
        # Index of every page at its logical page; the stored tail's K/V (it is written into
        # next) straight to its ring slot.
        fetcher = LazyPageFetcher(client, record, session.caches, list(range(max_pages)),
                                  kv_block_table=[p % ring for p in range(max_pages)],
                                  dense_layers=session.dense_layers)
        fetcher.release_later = []  # the index leases end after the first token (below)
        fetch = None
        ok = False
        try:
            covered = fetcher.load_index()
            # A layer that attends densely reads every page from its first step: all of its stored
            # K/V now, straight to the device (its host-tier rows are never read: see
            # `check_host_complete`).
            for layer in session.dense_layers:
                fetcher.ensure(layer, range(fetcher.num_pages))
                host.skip_layer(layer)
            # The service provides the pages before the first one the session writes (the stored
            # tail's K/V came with the index; its host-tier copy is the session's write-back).
            source.readable_pages = covered // c.page_size
            t3 = time.perf_counter()
            # Every stored page's K/V leased where it lies (shards in this process with a K/V arena);
            # the miss fill then reads the pages in place. Asked after the index load, not beside it:
            # the shards' threads building a 32K-page lease hold the GIL, and the load waited ~5 ms
            # for it after each of its GPU calls (on the H200 the load took 125-150 ms instead of 65).
            if lease_kv and session._host_src is not None:
                fetch = host.request_lease(record.page_hashes[: source.readable])
            ok = covered == record.num_stored_tokens  # (a missing or corrupt page: reported now)
        finally:
            # The index leases end at the session's second step (`release_ended_leases` starts their
            # releases, the third waits for them), off the first token's path: started here, the
            # shards' threads released them while this thread attached the K/V lease, and the lease
            # phase grew by what the index phase lost (H100, 872b531: 27-32 against 13-17 ms at
            # a721afc). An adoption that failed, or stopped at a missing or corrupt index page (which
            # the release reports to its shard), releases them now.
            host.start_releases(fetcher.release_later, later=ok)
        t4 = t5 = time.perf_counter()
        if fetch is not None:
            fetch.result()  # (the shards' answers; `attach_lease` takes the same merged lease)
            t5 = time.perf_counter()
            host.attach_lease(fetch, source.readable, cuda=session.device.type == "cuda")
        t6 = time.perf_counter()
        session._use_lease()
        t7 = time.perf_counter()
        session._enter_page(covered // c.page_size, load=False)  # a loaded tail is already in its slot
        t8 = time.perf_counter()
        session.adopt_phases = dict(host_reset_s=t1 - t0, allocate_s=t2 - t1, index_s=t3 - t2,
                                    lease_s=t8 - t3)
        session.lease_phases = dict(request_s=t4 - t3, wait_s=t5 - t4, attach_s=t6 - t5, tables_s=t7 - t6,
                                    rest_s=t8 - t7)
        return session, covered

    def _use_lease(self) -> None:
        """The device's tables of the pages the host tier leased from the service (read in place by
        the miss fill, at their element offsets from the tier's memory) and of their checks: a
        leased page counts as unchecked until the first step that copies it in has hashed it."""
        host = self.host
        if self._elem_offsets is None and (host.lease is None or not host.leased.any()):
            return
        # A reused object that has the tables keeps them (a captured step reads them), lease or not:
        # without one every page lies in its own row of the tier and counts as checked, so the
        # leased path reads what the plain one would.
        elem = host.data.element_size()
        tables = dict(_elem_offsets=torch.from_numpy(host.byte_offsets // elem),
                      _byte_offsets=torch.from_numpy(host.byte_offsets.copy()),
                      _expected=torch.from_numpy(host.lease_checksums.copy()),
                      _verified=torch.from_numpy((~host.leased).astype(np.uint8)),
                      _failures=torch.zeros(len(self.caches), 2, dtype=torch.int64))
        self._src_flat = self._host_src.reshape(-1, *self._host_src.shape[2:])  # base address and layout
        for name, table in tables.items():
            mine = getattr(self, name)
            if mine is not None and mine.shape == table.shape:
                mine.copy_(table, non_blocking=True)  # (pageable: ordered before any later step)
            else:
                setattr(self, name, table.to(self.device))

    def check_pages(self) -> None:
        """After a step (the host has its token, so this reads 16 bytes a layer, no wait): if a leased
        page the step copied in failed its checksum, the step's token must not be used — the page
        is reported to its shard as corrupt (dropped there), the lease ends and PageLostInService
        says which. `SparseDecodeGraph` checks after every step; a caller stepping with
        `decode_metadata` is checked at its next step's `advance`, or calls this itself."""
        if self._failures is None or not self._unchecked:
            return
        self._unchecked = False
        self.join_checks()
        failures = self._failures.cpu()
        bad = torch.nonzero(failures[:, 0]).flatten().tolist()
        if not bad:
            return
        lost = [(int(failures[layer, 1]), layer) for layer in bad]
        items = [self.host.leased_item(layer, page) for page, layer in lost]
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # no kernel reads the leased pages any more
        self.host.release_lease(corrupt=[i for i in items if i >= 0])
        self.host.release_ended_leases(wait=True)  # the session ends here: its index leases too
        self._failures = None
        session = self.host.source.session_id if self.host.source is not None else "?"
        raise PageLostInService(f"session {session!r}: leased K/V (page, layer) {lost} failed the checksum "
                                "stored with them in the KV cache service (dropped there); the step's "
                                "token is void")

    def export_caches(self) -> tuple[list[LayerKVCache], list[int]]:
        """Every page of the session as caches a `PageCodec` exports from → (per layer: K and V of
        the host tier, the index cache on the device; the identity block table). The page being
        written is written back to the host tier first (it is again when it fills), and on CUDA the
        device's copies into the host tier are waited for. A layer that attends densely exports
        the zeros its index cache holds, as a pool's never-written index page does."""
        if self.write_page >= 0:
            self._write_back(self.write_page)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        data = self.host.data
        caches = [LayerKVCache(k_cache=data[layer, :, 0], v_cache=data[layer, :, 1],
                               index_cache=cache.index_cache, index_scale=cache.index_scale)
                  for layer, cache in enumerate(self.caches)]
        return caches, list(range(self.max_pages))

    # ---- one decode step ----------------------------------------------------------------------
    @property
    def stats(self) -> ResidencyStats:
        """The counters (those kept on the device are read here: a host sync, off the step path)."""
        w = self.working
        self._stats.pages_fetched = int(w.fetched.sum())
        self._stats.fetches = int(w.fetch_events.sum())
        # Per head a fetch moves one head's column of a page.
        self._stats.bytes_fetched = self._stats.pages_fetched * self.host.page_bytes // (
            self.heads if self.per_head else 1)
        self._stats.evictions = int(w.evictions.sum())
        return self._stats

    def _as_pages(self, slots: torch.Tensor) -> torch.Tensor:
        """Pool slots [n, 2, ...] → [n, 2, P, Hkv, D], the layout of the host tier and the service."""
        return slots.permute(0, 1, 3, 2, 4).contiguous() if self.per_head else slots

    def _as_slot(self, page: torch.Tensor) -> torch.Tensor:
        """A page [2, P, Hkv, D] → the layout of a pool slot."""
        return page.permute(0, 2, 1, 3) if self.per_head else page

    def _enter_page(self, page: int, load: bool) -> None:
        """Page `page` starts receiving tokens: write the page filled before it back to the host
        tier, and give it its ring slot in every layer (load: copy its K/V in from the host tier)."""
        if self.write_page >= 0:
            self._write_back(self.write_page)
            self._stats.pages_written_back += len(self.caches)
            if self._present_dev is not None:  # in stream order after the copies into the host tier
                self._present_dev[:, self.write_page] = True
        slot = self.working.place_write_page(page)
        if load:
            for layer in self.sparse_layers:
                if self.host.present[layer, page]:
                    self.pools[layer][slot].copy_(self._as_slot(self.host.data[layer, page]),
                                                  non_blocking=True)
        self.write_page = page
        self.check_host_complete()

    def _write_back(self, page: int) -> None:
        """The K/V of `page` (the page being written) → the host tier, every layer: from its ring
        slot, or (a layer that attends densely) from its own page."""
        slot = page % self.ring
        for layer in self.sparse_layers:
            self.host.write(layer, [page], self._as_pages(self.pools[layer][slot : slot + 1]))
        for layer in self.dense_layers:  # the host tier holds every layer's pages all the same
            self.host.write(layer, [page], self.pools[layer][page : page + 1])

    def check_host_complete(self) -> None:
        """Whether the host tier holds every page before the write page (then steps need no host
        sync). Checked as soon as the write page is placed — an offloaded session is complete from
        its first step, before any `decode_metadata` — and at every step while it is not (background
        reads fill an adopted session's tier). Host memory only: no device sync."""
        if not self._host_complete:
            present = self.host.present.numpy()[:, : self.write_page]  # (numpy: see HostKV.__init__)
            if self.dense_layers:  # their K/V are whole on the device: the host tier need not hold them
                present = present[list(self.sparse_layers)]
            self._host_complete = bool(present.all())

    def advance(self, position: int) -> int:
        """Start the decode step of the token at `position` (the session's tokens so far): on a
        page boundary the filled page is written back and the new one takes its ring slot; the
        step number advances (host and device) → the K/V slot of the new token in the pool."""
        self.check_pages()  # the last step's, if its caller did not
        self.host.renew_lease()
        if self._stats.steps >= 1:  # from the second step on: off the first token
            self.host.release_ended_leases()
        self._unchecked = self._failures is not None  # (a replayed step fills and checks on the device)
        page = position // self.page_size
        if page != self.write_page:
            if page != self.write_page + 1:
                raise ValueError(f"position={position} is invalid: allowed the next token of page "
                                 f"{self.write_page} or the first of page {self.write_page + 1}")
            self._enter_page(page, load=False)
        self.check_host_complete()
        self._stats.steps += 1
        self.step_number.fill_(self._stats.steps)
        return (page % self.ring) * self.page_size + position % self.page_size

    def decode_metadata(self, position: int) -> AttentionMetadata:
        """The metadata of a one-token decode step at `position` (the session's tokens so far)."""
        kv_slot = self.advance(position)
        device = self.device
        positions = torch.tensor([position], device=device)
        return AttentionMetadata(
            positions=positions, slot_mapping=positions.clone(),
            kv_slot_mapping=torch.tensor([kv_slot], device=device),
            block_tables=self.index_table,
            seq_lens=torch.tensor([position + 1], device=device, dtype=torch.int32),
            cu_seqlens_q=torch.tensor([0, 1], device=device, dtype=torch.int32),
            max_query_len=1, decode_query_len=1,
            logits_indices=torch.zeros(1, dtype=torch.long, device=device),
        )

    @property
    def can_speculate(self) -> bool:
        """Whether a step can run on the device while the host tier still lacks pages: misses whose
        page is absent are skipped and named, and `repair` (a host sync after the step) reads them
        in before the step runs again. Per head, with a device view of the host tier, and a budget of
        at least ring + (layers + 2) · top_k (the pages of every run of one step stay resident)."""
        return self._present_dev is not None

    def refresh_presence(self) -> None:
        """The device's copy of which (layer, page) the host tier holds, before a speculative step
        (a 1-byte flag per page; once the tier is complete it is copied one last time)."""
        if self._present_dev is None or self._presence_final:
            return
        self._present_dev.copy_(self.host.present[:, : self.max_pages])
        self._presence_final = self._host_complete

    def repair(self) -> bool:
        """After a speculative step (one host sync): the pages that the first layer with skips
        selected and the host tier lacked are read in (service reads) and copied to the slots the
        step gave them → True: the step must run again; False: nothing was skipped. Only the first
        such layer's: every later layer ran on its stale output, so its selection is not the step's;
        the pages it skipped leave its working set instead (their slots never got their bytes), so a
        later run that selects them misses, and fills or skips them again."""
        if self._present_dev is None or self._skipped[0] is None or self._presence_final:
            return False  # (final: the device knew every page before the write page, and write-backs)
        # the skipped slots and the selected pages of every layer, [L, Hkv, K] each: one transfer
        skipped, src = torch.stack([torch.stack(self._skipped), torch.stack(self._step_src)]).cpu()
        bad = [layer for layer in range(len(self.caches)) if bool((skipped[layer] >= 0).any())]
        if not bad:
            return False
        self.repairs += 1
        layer = bad[0]
        self.host.ensure(layer, sorted(set(src[layer][skipped[layer] >= 0].tolist())))
        self._fill(layer, self._skipped[layer], self._step_src[layer])
        for later in bad[1:]:
            rows = skipped[later] >= 0  # [Hkv, K]
            heads = torch.arange(self.heads)[:, None].expand_as(rows)[rows]
            self.working.forget(later * self.heads + heads, src[later][rows], skipped[later][rows])
        self.check_host_complete()
        self.refresh_presence()
        return True

    @property
    def synced_steps(self) -> bool:
        """Whether a step's misses go through the host (a sync per layer): while the host tier
        lacks pages (an adopted session's pages still in the service), or without a UVA view."""
        return not self._host_complete or self._host_src is None

    def make_resident(self, layer: int, selected: torch.Tensor) -> None:
        """selected [.., Hkv, K] block ids of `layer` (-1 unused) → those pages are in the working
        set before anything reads them (stream order): per head, that head's column of them. Host
        tier complete: the device admits and fills the misses with no host sync. Else the host
        reads the misses (one sync) and makes them present first (service reads)."""
        if self.per_head:
            h = self.heads
            rows = selected.reshape(-1, h, selected.shape[-1]).transpose(0, 1).reshape(h, -1)  # [Hkv, K]
            dst, src = self.working.admit_rows(layer * h, rows, self.step_number)
        else:
            dst, src = self.working.admit(layer, selected, self.step_number)
        if self.speculating:  # on the device, presence checked: absent pages skipped and named
            if self._skipped[layer] is None or self._skipped[layer].shape != dst.shape:
                self._skipped[layer] = torch.full(dst.shape, -1, dtype=torch.int64, device=self.device)
            self._step_src[layer] = src  # read by `repair` after the step (a captured step's buffer)
            self._fill(layer, dst, src, self._present_dev[layer], self._skipped[layer])
            return
        if not self.synced_steps:
            self._fill(layer, dst, src)
            return
        self._stats.host_steps += 1
        flat = torch.cat([selected.reshape(-1).long(), dst.reshape(-1)]).tolist()
        chosen, slots = flat[: dst.numel()], flat[dst.numel():]
        self.last_selected[layer] = list(dict.fromkeys(p for p in chosen if p >= 0))
        missed = [(i, p, s) for i, (p, s) in enumerate(zip(chosen, slots, strict=True)) if s >= 0]
        if not missed:
            return
        pages = list(dict.fromkeys(p for _, p, _ in missed))
        self.host.ensure(layer, pages)
        if self._host_src is not None:
            self._fill(layer, dst, src)
        else:  # CUDA without a UVA view: one asynchronous copy per miss from the pinned tier
            for i, page, slot in missed:
                if self.per_head:
                    head = i // selected.shape[-1]
                    self.pools[layer][slot, :, head].copy_(self.host.data[layer, page, :, :, head],
                                                           non_blocking=True)
                else:
                    self.pools[layer][slot].copy_(self.host.data[layer, page], non_blocking=True)
        if len(self._stats.fetch_log) < 10_000:
            self._stats.fetch_log.append((self._stats.steps, layer, tuple(pages)))

    def _fill(self, layer: int, dst: torch.Tensor, src: torch.Tensor, present: torch.Tensor | None = None,
              skipped: torch.Tensor | None = None) -> None:
        """Copy the misses (dst slots, src pages; per head [Hkv, K]) in from the host tier (present,
        skipped: see `gather_head_pages`). Leased pages are read where they lie in the service's
        memory, and each copied for the first time is hashed there on the device (`verify_pages`;
        `check_pages` reads the outcome after the step)."""
        if self._elem_offsets is None:
            if self.per_head:
                gather_head_pages(self.pools[layer], dst, self._host_src[layer], src, present, skipped)
            else:
                gather_pages(self.pools[layer], dst, self._host_src[layer], src)
            return
        offsets = self._elem_offsets[layer]
        if self.per_head:
            gather_head_pages(self.pools[layer], dst, self._src_flat, src, present, skipped,
                              src_offsets=offsets)
        else:
            gather_pages(self.pools[layer], dst, self._src_flat, src, src_offsets=offsets)
        args = (self._src_flat, self._byte_offsets[layer], self._expected[layer], self._verified[layer],
                self._failures[layer], src, dst, self.host.page_bytes)
        if self.check_stream is None:
            verify_pages(*args)
            return
        self.check_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.check_stream):
            verify_pages(*args)
        # Held until the next step (the join has run by then): freed now, the allocator could give
        # their memory to the compute stream while the check still reads them.
        self._check_inputs[layer] = (src, dst)
        self._checks_forked = True

    def join_checks(self) -> None:
        """The compute stream waits for the leased pages' checks forked by this step (`check_stream`),
        so that reading `_failures` after it sees them (and a captured step joins what it forked)."""
        if self._checks_forked:
            torch.cuda.current_stream(self.device).wait_stream(self.check_stream)
            self._checks_forked = False

    def wrap_ops(self, ops: AttentionOps) -> AttentionOps:
        """The model's ops for this session's decode steps: the indexer makes its selection
        resident; sparse attention reads through the layer's slot table."""

        def indexer_decode(q_index, index_cache, block_tables, *args, **kwargs):
            selected = ops.indexer_decode(q_index, index_cache, block_tables, *args, **kwargs)  # [1,1,Hkv,K]
            self.make_resident(self._layer_of_index[index_cache.data_ptr()], selected)
            return selected

        def sparse_decode(q, k_cache, v_cache, block_tables, seq_lens, selected, *args, **kwargs):
            layer = self._layer_of_kv[k_cache.data_ptr()]
            if not self.per_head:
                table = self.working.table(layer)
                return ops.sparse_decode(q, k_cache, v_cache, table, seq_lens, selected, *args, **kwargs)
            # Per head: each KV head as a one-head sequence of its own over its columns (pages of
            # the head-major pool), its table mapping logical pages to them.
            batch, num_q, num_q_heads, dim = q.shape
            if batch * num_q != 1:
                raise ValueError(f"q is {tuple(q.shape)}: a sparse-resident session decodes one token")
            h = self.heads
            rows = self.working.slot_of[layer * h : (layer + 1) * h, : self.max_pages]  # [Hkv, max_pages]
            table = torch.where(rows >= 0, rows * (2 * h) + self._head_ids, 0).to(torch.int32)
            k_columns, v_columns = self._columns[layer]
            out = ops.sparse_decode(
                q.reshape(h, 1, num_q_heads // h, dim), k_columns, v_columns, table,
                seq_lens.reshape(1).expand(h).contiguous(), selected.reshape(h, 1, 1, -1), *args, **kwargs)
            return out.reshape(batch, num_q, num_q_heads, dim)

        def refuse(*args, **kwargs):
            raise ValueError("a sparse-resident session runs one token per step (decode); prefill it "
                             "fully resident and offload it, or run its new tokens as decode steps")

        return dataclasses.replace(ops, indexer_decode=indexer_decode, sparse_decode=sparse_decode,
                                   indexer_prefill=refuse, sparse_prefill=refuse, dense_prefill=refuse,
                                   # a dense layer's K/V are whole, at their logical pages (the step's table)
                                   dense_decode=ops.dense_decode if self.dense_layers else refuse,
                                   graph_capturable=False)

    # ---- background --------------------------------------------------------------------------
    def predicted(self) -> list[tuple[int, int]]:
        """(page, layer) the next step is expected to select, per layer: the forced pages (the
        init pages and the local window ending at the page being written, docs/design.md §2),
        then the layer's previous selection (decode selections change little between steps)."""
        c = self.config
        forced = [*range(c.n_init), *range(max(0, self.write_page - c.n_local + 1), self.write_page + 1)]
        return [(p, layer) for layer, pages in enumerate(self.last_selected)
                for p in dict.fromkeys(forced + pages)]

    def prefetch(self, max_items: int) -> int:
        """Background service reads into the host tier, predicted pages first (an adopted
        session), until it holds every page: steps need no host sync from then on."""
        if self._host_complete:
            return 0
        return self.host.prefetch(self.predicted(), max_items)

    @property
    def gpu_bytes(self) -> int:
        """GPU memory of the session: every index page, budget_pages of K/V per layer (every page
        in a layer that attends densely)."""
        return caches_bytes(self.caches)

