"""A model replica for the routing simulator: cost model, LRU prefix cache, chunked-prefill steps.

Costs come from a calibration (JSON; `Calibration.default()` documents where each figure comes
from). One replica runs continuous batching like the engine: each step prefills up to
`chunk_tokens` of the oldest admitted request(s) and decodes one token for every decoding
sequence. A request is admitted (FIFO) as the engine's scheduler admits it: while the step's
token budget has room after the running prefills, and when its pages fit: cached prefix pages are
reused, the rest are taken from free pages, evicting unreferenced cached pages least-recently-used
first. (Until issue 29's third pass every waiting request whose pages fit was admitted at once, so a
burst reserved every replica's pages and evicted its cached prefixes before any reuse.)
Its prompt pages enter the prefix cache when its prefill completes (the engine's `stored` event).
"""

import json
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field


@dataclass
class Calibration:
    source: str
    num_layers: int
    linear_flops_per_token_layer: float
    gemm_flops_per_s: float
    mfu: float
    sparse_attn_s_per_token_layer: float
    indexer_flops_per_token_ctx_layer: float
    hbm_bytes_per_s: float
    weight_bytes_per_layer: float
    decode_bytes_per_seq_layer: float
    index_bytes_per_token_layer: float
    kv_bytes_per_token_layer: float
    kv_memory_bytes: float
    step_overhead_s: float
    chunk_tokens: int
    page_tokens: int

    @staticmethod
    def default() -> "Calibration":
        """m3-proxy shape (docs/design.md §4: hidden 6144, Hq=64, Hkv=4, D=128, one index-K head DI=128,
        dense SwiGLU 8192, P=128, K=16) with 60 layers, priced with the H200 figures measured in
        docs/environment.md (686 TFLOP/s bf16 GEMM, 4.27 TB/s HBM copy, flex_attention
        block-sparse prefill at 128K: 8.5 ms per layer). The engine itself has not been measured
        on the GPU yet: re-run with --calibration <json> once it is."""
        hidden, heads, kv_heads, head_dim, inter, idx_dim = 6144, 64, 4, 128, 8192, 128
        linear_params = (hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
                         + hidden * (kv_heads * idx_dim + idx_dim) + 3 * hidden * inter)
        top_k, page = 16, 128
        return Calibration(
            source="H200 figures from docs/environment.md at the m3-proxy shape, 60 layers "
                   "(assumed 50% MFU for linear layers); not yet measured on the msaserve engine",
            num_layers=60,
            linear_flops_per_token_layer=2.0 * linear_params,
            gemm_flops_per_s=686e12,
            mfu=0.5,
            sparse_attn_s_per_token_layer=8.5e-3 / 131072,
            indexer_flops_per_token_ctx_layer=2.0 * kv_heads * idx_dim,
            hbm_bytes_per_s=4.27e12,
            weight_bytes_per_layer=2.0 * linear_params,
            decode_bytes_per_seq_layer=2.0 * top_k * page * kv_heads * head_dim * 2,
            index_bytes_per_token_layer=2.0 * idx_dim,
            kv_bytes_per_token_layer=2.0 * (2 * kv_heads * head_dim + idx_dim),
            kv_memory_bytes=0.9 * 141e9 - 60 * 2.0 * linear_params,
            step_overhead_s=1e-3,
            chunk_tokens=8192,
            page_tokens=512,
        )

    @staticmethod
    def load(path: str) -> "Calibration":
        with open(path) as f:
            overrides = json.load(f)
        unknown = set(overrides) - set(Calibration.__dataclass_fields__)
        if unknown:
            raise ValueError(f"{path}: unknown calibration keys {sorted(unknown)}")
        return Calibration(**(Calibration.default().__dict__ | overrides))

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def capacity_pages(self) -> int:
        page_bytes = self.kv_bytes_per_token_layer * self.num_layers * self.page_tokens
        return int(self.kv_memory_bytes / page_bytes)

    def prefill_s(self, num_tokens: int, start: int) -> float:
        """Prefill tokens [start, start + num_tokens): linear layers + sparse attention (both
        per token) + the indexer (a causal GEMM: grows with each token's position)."""
        positions = num_tokens * (start + (num_tokens - 1) / 2)
        flops = (num_tokens * self.linear_flops_per_token_layer
                 + positions * self.indexer_flops_per_token_ctx_layer)
        per_layer = (flops / (self.gemm_flops_per_s * self.mfu)
                     + num_tokens * self.sparse_attn_s_per_token_layer)
        return self.num_layers * per_layer

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        """One decode token for `batch` sequences holding `context_tokens` in all: HBM-bound —
        the weights once, K·P selected tokens per sequence, the whole index-K per sequence."""
        if batch == 0:
            return 0.0
        bytes_ = (self.weight_bytes_per_layer + batch * self.decode_bytes_per_seq_layer
                  + context_tokens * self.index_bytes_per_token_layer)
        return self.num_layers * bytes_ / self.hbm_bytes_per_s


@dataclass
class SimRequest:
    request_id: int
    arrival: float
    input_tokens: int
    output_tokens: int
    blocks: list[int]
    prefilled: int = 0
    """Prompt tokens already computed (cached prefix counts as computed)."""
    decoded: int = 0
    hit_blocks: int = 0
    first_token: float | None = None
    finish: float | None = None
    replica: str = ""
    out_pages: int = 0

    @property
    def pages(self) -> int:
        return len(self.blocks) + self.out_pages


@dataclass
class SimReplica:
    replica_id: str
    cal: Calibration
    capacity: int
    cache: "OrderedDict[int, int]" = field(default_factory=OrderedDict)
    """Cached block hash -> reference count, in LRU order (oldest first)."""
    private_pages: int = 0
    """Pages of output tokens of live sequences (not shareable, not cached)."""
    waiting: deque = field(default_factory=deque)
    prefilling: list = field(default_factory=list)
    decoding: list = field(default_factory=list)
    referenced: int = 0
    """Cached pages with a reference count above zero (pinned by live sequences)."""
    now: float = 0.0
    busy_s: float = 0.0
    events: list = field(default_factory=list)
    """("stored" | "removed", page hash) in order, drained by each routing-stats payload."""

    def num_ongoing(self) -> int:
        """Requests in this replica (what Serve's queue-length probe returns)."""
        return len(self.waiting) + len(self.prefilling) + len(self.decoding)

    def free_pages(self) -> int:
        return self.capacity - self.referenced - self.private_pages

    def _ref(self, h: int) -> None:
        count = self.cache.get(h, 0)
        if count == 0:
            self.referenced += 1
        if h not in self.cache:
            self.events.append(("stored", h))
        self.cache[h] = count + 1
        self.cache.move_to_end(h)

    def _unref(self, h: int) -> None:
        self.cache[h] -= 1
        if self.cache[h] == 0:
            self.referenced -= 1

    def _try_admit(self, req: SimRequest) -> bool:
        hit = 0
        for h in req.blocks:
            if h not in self.cache:
                break
            hit += 1
        need = len(req.blocks) - hit + req.out_pages
        if need > self.capacity:
            raise ValueError(f"request {req.request_id} needs {need} pages; a replica holds {self.capacity}")
        newly_referenced = sum(1 for h in req.blocks[:hit] if self.cache[h] == 0)
        if self.referenced + newly_referenced + self.private_pages + need > self.capacity:
            return False
        for h in req.blocks[:hit]:
            self._ref(h)
        overflow = len(self.cache) + self.private_pages + need - self.capacity
        if overflow > 0:  # evict unreferenced cached pages, least recently used first
            for h in [h for h, c in self.cache.items() if c == 0][:overflow]:
                del self.cache[h]
                self.events.append(("removed", h))
        req.hit_blocks = hit
        req.prefilled = min(req.input_tokens - 1, hit * self.cal.page_tokens)  # last token recomputed
        self.private_pages += need
        self.prefilling.append(req)
        return True

    def _admit(self) -> None:
        """Admit waiting requests as the engine's scheduler does (`Scheduler._admit_waiting`): only
        while this step's token budget has room after the running prefills' chunks, and only if the
        whole rest of the prompt fits. A request waiting behind a backlog holds no pages, so it
        evicts no cached prefix before it is prefilled."""
        budget = self.cal.chunk_tokens - sum(r.input_tokens - r.prefilled for r in self.prefilling)
        while self.waiting and budget > 0 and self._try_admit(self.waiting[0]):
            req = self.waiting.popleft()
            budget -= req.input_tokens - req.prefilled

    def _prefill_done(self, req: SimRequest) -> None:
        """Prompt pages join the prefix cache (stored event); the sequence starts decoding."""
        for h in req.blocks[req.hit_blocks:]:
            self._ref(h)
        self.private_pages -= len(req.blocks) - req.hit_blocks
        req.first_token = self.now
        req.decoded = 1
        if req.decoded >= req.output_tokens:
            self._finish(req)
        else:
            self.decoding.append(req)

    def _finish(self, req: SimRequest) -> None:
        req.finish = self.now
        for h in req.blocks:
            self._unref(h)
        self.private_pages -= req.out_pages

    def step(self, until: float) -> bool:
        """One engine step if it starts before `until`; decode-only stretches are taken in one
        jump up to the next finish or `until`. Returns False when idle or past `until`."""
        self._admit()
        if self.now >= until or not (self.prefilling or self.decoding):
            return False
        budget, chunk_s = self.cal.chunk_tokens, 0.0
        done = []
        for req in self.prefilling:
            if budget <= 0:
                break
            n = min(budget, req.input_tokens - req.prefilled)
            chunk_s += self.cal.prefill_s(n, req.prefilled)
            req.prefilled += n
            budget -= n
            if req.prefilled >= req.input_tokens:
                done.append(req)
        context = sum(r.input_tokens + r.decoded for r in self.decoding)
        decode_s = self.cal.decode_step_s(len(self.decoding), context)
        steps = 1
        if not self.prefilling and self.decoding:  # waiting, if any, is blocked until a finish
            remaining = min(r.output_tokens - r.decoded for r in self.decoding)
            per_step = decode_s + self.cal.step_overhead_s
            to_until = (until - self.now) / per_step
            steps = max(1, remaining if to_until >= remaining else int(to_until) + 1)
        elapsed = steps * (chunk_s + decode_s + self.cal.step_overhead_s)
        self.now += elapsed
        self.busy_s += elapsed
        for req in list(self.decoding):
            req.decoded += steps
            if req.decoded >= req.output_tokens:
                self.decoding.remove(req)
                self._finish(req)
        for req in done:
            self.prefilling.remove(req)
            self._prefill_done(req)
        return True

    def advance(self, until: float) -> None:
        while self.step(until):
            pass
        self.now = max(self.now, until)

    def waiting_prefill_pages(self) -> int:
        tokens = sum(r.input_tokens - r.prefilled for r in self.prefilling)
        tokens += sum(r.input_tokens for r in self.waiting)
        return -(-tokens // self.cal.page_tokens)
