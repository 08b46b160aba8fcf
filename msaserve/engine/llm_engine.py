"""The synchronous engine core: requests in, one scheduled step at a time, outputs out.

`AsyncEngine` runs it in a background thread; tests and offline benchmarks call `step()`.
"""

import dataclasses
import logging
import random

import torch

from msaserve.engine.block_manager import BlockManager
from msaserve.engine.config import EngineConfig
from msaserve.engine.decode_round import RoundTokens
from msaserve.engine.kv.adoption import PageLost
from msaserve.engine.kv.resident_lane import SparseResidentLane, refusal
from msaserve.engine.kv.service_swap import ServiceSwapStore
from msaserve.engine.kv.sessions import EngineSessions
from msaserve.engine.kv.swap import CachePageIO, EvictedPageSink, HostSwapStore, Swapper, SwapStore
from msaserve.engine.media import MediaPrompt, prepare_media
from msaserve.engine.memory import model_dtype
from msaserve.engine.model_runner import ModelRunner
from msaserve.engine.output import RequestOutputTracker, now
from msaserve.engine.sampler import GrammarMask, Sampler
from msaserve.engine.scheduler import ScheduledBatch, Scheduler
from msaserve.engine.sequence import Sequence, SequenceStatus
from msaserve.engine.structured.step import GrammarRuntime
from msaserve.engine.types import (
    ContextTooLong,
    EngineStats,
    GenerateOutput,
    GenerateRequest,
    InvalidParameter,
    KVEvent,
    QueueFull,
    TokenLogprob,
)
from msaserve.kvcache.client import KVCacheClient
from msaserve.models.transformer import MSATransformer

logger = logging.getLogger(__name__)

def load_engine_model(config: EngineConfig) -> tuple[MSATransformer, object]:
    """(model, tokenizer) from the config's model spec."""
    from msaserve.models.loader import load_model  # the loader pulls in GGUF/safetensors readers

    device = torch.device(config.device)
    loaded = load_model(
        config.model, device, model_dtype(config), config.attention_backend, progress=False,
        seed=config.seed, **config.model_overrides,
    )
    return loaded.model, loaded.tokenizer


@dataclasses.dataclass
class PendingRound:
    """A decode round being handed out: its batch, tokens, next step, and rows still decoding."""

    batch: ScheduledBatch
    tokens: RoundTokens
    alive: list[int]
    next_step: int = 0


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        model: MSATransformer | None = None,
        tokenizer: object | None = None,
        page_store: SwapStore | None = None,
        evicted_page_sink: EvictedPageSink | None = None,
        kv_client: KVCacheClient | None = None,
        runner: ModelRunner | None = None,
    ) -> None:
        """page_store: where preempted sequences' pages go (host memory by default);
        evicted_page_sink: where evicted prefix-cache pages go (dropped by default);
        kv_client: the KV cache service, where requests with a session_id are persisted and from
        which sessions whose pages are not local are adopted (`msaserve.engine.kv.sessions`);
        runner: what runs the steps (default a ModelRunner of `model`; a multi-rank replica's
        `engine.parallel.runner.GroupRunner`, whose `model` holds the config only)."""
        if model is None:
            model, tokenizer = load_engine_model(config)
        elif model.attention_backend != config.attention_backend:
            logger.info("the injected model runs its own attention backend %r (config says %r)",
                        model.attention_backend, config.attention_backend)
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.runner = ModelRunner(model, config) if runner is None else runner
        self.page_size = self.runner.page_size
        self.block_manager = BlockManager(self.runner.num_pages, self.page_size, config.enable_prefix_caching)
        pin = self.runner.device.type == "cuda"
        store = page_store
        if store is None:  # an empty store is falsy: test identity, not truth
            store = HostSwapStore(config.swap_space_bytes, pin_memory=pin)
        page_io = CachePageIO(self.runner.caches)
        self.swapper = Swapper(store, page_io, self.block_manager)
        if evicted_page_sink is not None:
            self.block_manager.on_evict = lambda pages, hashes: evicted_page_sink.store_evicted(
                hashes, page_io.read(pages)
            )
        self.scheduler = Scheduler(
            self.block_manager, self.swapper, config.max_num_seqs, config.max_num_batched_tokens
        )
        self.sampler = Sampler()
        self.trackers: dict[str, RequestOutputTracker] = {}
        self.max_model_len = min(config.max_model_len, self.runner.num_pages * self.page_size)
        self.eos_token_ids = self._eos_token_ids()
        self._seeds = random.Random(config.seed)
        self.record_selections = False
        """Tests set this to keep each step's MSA selections in runner.last_selections."""
        self._round: PendingRound | None = None
        """The decode round whose tokens the device still produces: `step()` hands out one step of
        it at a time, and schedules again once it is done."""
        self.sessions: EngineSessions | None = None
        self._grammar_runtime: GrammarRuntime | None = None
        self.resident: SparseResidentLane | None = None
        """Long decoding requests moved off the page pool (`EngineConfig.sparse_residency_sessions`)."""
        if config.sparse_residency_sessions:
            self.resident = self._resident_lane()
            self.scheduler.offload = lambda seq: self._to_lane(seq, pressure=True)
        if kv_client is not None:
            self.attach_kv_client(kv_client)

    def _resident_lane(self) -> SparseResidentLane:
        config = self.config
        why = refusal(self.model, self.runner.ops, config.world_size)
        if why is not None:
            raise ValueError(f"EngineConfig.sparse_residency_sessions={config.sparse_residency_sessions} is "
                             f"invalid here: {why}; allowed 0 (off)")
        return SparseResidentLane(
            self.model, self.runner.ops, self.runner.caches, config.sparse_residency_sessions,
            config.sparse_residency_min_tokens, config.sparse_residency_budget,
            -(-self.max_model_len // self.page_size))

    def _eos_token_ids(self) -> set[int]:
        ids = getattr(self.tokenizer, "eos_token_ids", None)
        if ids:
            return set(ids)
        eos = self.model.config.eos_token_id
        return set() if eos is None else {eos}

    @property
    def grammars(self) -> GrammarRuntime:
        """Built on the first constrained request (it reads the whole vocabulary)."""
        if self._grammar_runtime is None:
            self._grammar_runtime = GrammarRuntime(
                self.tokenizer, self.model.config.vocab_size, self.eos_token_ids
            )
        return self._grammar_runtime

    # ---- requests ---------------------------------------------------------------------------
    def validate(self, request: GenerateRequest) -> None:
        """Raise InvalidParameter or ContextTooLong for a request the engine cannot serve."""
        sampling = request.sampling.validate()
        prompt = request.prompt_token_ids
        if not prompt:
            raise InvalidParameter("prompt_token_ids", prompt, "at least one token id")
        vocab = self.model.config.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidParameter("prompt_token_ids", bad, f"token ids from 0 to {vocab - 1}")
        bad = next((t for t in sampling.logit_bias if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidParameter("logit_bias", bad, f"token ids from 0 to {vocab - 1}")
        if sampling.grammar is not None:
            self.grammars.check(sampling.grammar)  # compiled once per spec; later checks hit the cache
        self._expand_media(request)  # placeholder/media and length checks (add_request redoes it: cheap)

    def _expand_media(self, request: GenerateRequest) -> tuple[list[int], MediaPrompt | None]:
        """(prompt ids with each medium's placeholder expanded, its MediaPrompt); checks the length."""
        prompt, media = prepare_media(
            list(request.prompt_token_ids), request.media, self.model.config,
            getattr(self.model, "visual", None), self.page_size,
        )
        if len(prompt) + request.sampling.max_tokens > self.max_model_len:
            raise ContextTooLong(len(prompt), request.sampling.max_tokens, self.max_model_len)
        return prompt, media

    def add_request(self, request: GenerateRequest) -> None:
        self.validate(request)
        if request.request_id in self.trackers:
            raise InvalidParameter("request_id", request.request_id, "an id not already in flight")
        if len(self.scheduler.waiting) >= self.config.max_waiting:
            raise QueueFull(len(self.scheduler.waiting), self.config.max_waiting)
        sampling = request.sampling
        generator = None
        if not sampling.greedy:
            seed = sampling.seed if sampling.seed is not None else self._seeds.getrandbits(63)
            generator = torch.Generator(device=self.runner.device).manual_seed(seed)
        prompt, media = self._expand_media(request)
        seq = Sequence(
            request_id=request.request_id,
            token_ids=prompt,
            num_prompt_tokens=len(prompt),
            media=media,
            sampling=sampling,
            arrival_time=request.arrival_time if request.arrival_time is not None else now(),
            generator=generator,
            root_hash=request.cache_salt,
        )
        if sampling.grammar is not None:
            self.grammars.start(seq, sampling.grammar)
        self.trackers[seq.request_id] = RequestOutputTracker(
            seq, self.tokenizer, self.eos_token_ids, self.max_model_len
        )
        if self.sessions is not None and self.sessions.admit(seq, request.session_id):
            return  # started from pages in the KV cache service (its session's, or a shared prefix)
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> GenerateOutput | None:
        """Stop a request and free its pages now; returns its last output (None if unknown)."""
        tracker = self.trackers.pop(request_id, None)
        if tracker is None:
            return None
        output = tracker.finish_without_token("abort")
        if self.sessions is not None:
            self.sessions.forget(request_id)
        self._retire(tracker.seq)
        return output

    def _retire(self, seq: Sequence) -> None:
        """seq is done: its pages (pool or sparse-resident session) go back at once."""
        if seq.status is SequenceStatus.RESIDENT:
            self.resident.finish(seq)
        else:
            self.scheduler.finish(seq)

    def attach_kv_client(self, client: KVCacheClient) -> None:
        """Persist session requests to the KV cache service and adopt sessions from it (call
        before the first request)."""
        self.sessions = EngineSessions(
            client, self.runner.caches, self.block_manager, self.scheduler, sparse=self.runner.ops.sparse,
            dense_layers=tuple(getattr(self.model, "dense_layers", ())),
        )
        self.sessions.lane = self.resident

    def use_kv_service_for_sessions(self) -> bool:
        """If preempted pages already go to the KV cache service (`ServiceSwapStore`), persist
        and adopt sessions through the same client. True if attached."""
        store = self.swapper.store
        if isinstance(store, ServiceSwapStore):
            self.attach_kv_client(store.client)
            return True
        return False

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.resident)

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> list[GenerateOutput]:
        """Schedule, run the model, sample; returns one output per sequence that got a token.
        While a decode round runs (`EngineConfig.decode_steps`), a step hands out its next step's
        tokens instead, as the device produces them. Requests in the sparse-resident lane decode
        one token each beside the pool's batch, and the pool's long decoding requests move there
        while it has room (between rounds)."""
        outputs = self._next_round_step() if self._round is not None else []
        if self._round is None and not outputs:
            batch = self.scheduler.schedule()
            outputs = self._step_pool(batch) if batch.seqs else []
        if self.resident is not None:
            outputs += self._step_resident()
            if self._round is None:
                self._move_to_resident()
        return outputs

    def _step_pool(self, batch: ScheduledBatch) -> list[GenerateOutput]:
        wrap = self.sessions.before_step(batch) if self.sessions is not None else None
        steps = self._round_steps(batch, wrap is not None)
        if steps > 1:
            return self._decode_round(batch, steps)
        if wrap is None and self._greedy_on_runner(batch):
            return self._greedy_step(batch)
        pending = self._grammar_runtime.begin(batch.seqs) if self._grammar_runtime else None
        try:
            # Adopted sequences fetch the pages they select: the step runs wrapped ops.
            inputs, logits = self.runner.execute(batch, self.record_selections, ops_wrapper=wrap)
        except PageLost as lost:  # gone from the service: those sequences recompute instead
            if self.sessions is None:
                raise
            self.sessions.on_page_lost(batch, lost)
            return []
        self.scheduler.postprocess(batch)
        sampled: list[Sequence] = [batch.seqs[row] for row in inputs.sample_rows]
        if not sampled:
            return []
        return self._sample(sampled, logits, GrammarRuntime.mask(pending, inputs.sample_rows), now())

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor, mask: GrammarMask | None, timestamp: float
                ) -> list[GenerateOutput]:
        """Sample each sequence's token from its row of logits [len(seqs), vocab] (the grammar mask in
        those rows) and emit it."""
        result = self.sampler(
            logits, [s.sampling for s in seqs], [s.generator for s in seqs],
            histories=[(s.token_ids, s.num_prompt_tokens) for s in seqs], mask=mask,
        )
        return [self._emit(seq, token, logprob, timestamp)
                for seq, token, logprob in zip(seqs, result.token_ids, result.logprobs, strict=True)]

    def _step_resident(self) -> list[GenerateOutput]:
        """One token of every request in the sparse-resident lane: greedy ones straight from the
        session's step, the others sampled from its logits like the pool's rows."""
        lane = self.resident
        if not lane:
            return []
        seqs = [member.seq for member in lane.members.values()]
        pending = self._grammar_runtime.begin(seqs) if self._grammar_runtime else None
        step = lane.step(self._plain_greedy)
        for seq in step.lost:  # the service lost pages of an adopted session: recompute it
            self.scheduler.recompute(seq)
            if self.sessions is not None:
                self.sessions.stats.recomputed_after_loss += 1
        timestamp = now()
        outputs = [self._emit(seq, token, None, timestamp) for seq, token in step.tokens]
        if step.sampled:
            rows = [seqs.index(seq) for seq in step.sampled]
            outputs += self._sample(step.sampled, step.logits, GrammarRuntime.mask(pending, rows), timestamp)
        return outputs

    def _move_to_resident(self) -> None:
        """The pool's decoding requests whose context reached the lane's threshold move there while
        it has room, oldest first."""
        for seq in list(self.scheduler.running):
            self._to_lane(seq)

    def _to_lane(self, seq: Sequence, pressure: bool = False) -> bool:
        """Move seq off the pool into the sparse-resident lane if it may go (`eligible`; not while
        it adopts a session into the pool) → True if moved. pressure: the pool would preempt it
        otherwise (`Scheduler.offload`), so its length does not matter."""
        lane = self.resident
        if not lane.eligible(seq, pressure):
            return False
        if self.sessions is not None and seq.request_id in self.sessions.fetchers:
            return False
        self.scheduler.running.remove(seq)
        lane.move_in(seq, self.block_manager.free)
        lane.stats.moved_under_pressure += pressure
        return True

    @staticmethod
    def _plain_greedy(seq: Sequence) -> bool:
        """Whether seq's next token is the argmax of its logits with nothing else asked of them."""
        params = seq.sampling
        return (params.greedy and not params.logprobs and not params.processes_logits
                and seq.matcher is None)

    def _greedy_on_runner(self, batch: ScheduledBatch) -> bool:
        """Whether the runner samples this step itself (a multi-rank replica's rank 0: only token
        ids leave it): every request greedy, without logprobs, penalties, bias or grammar."""
        if not getattr(self.runner, "samples_greedy_on_ranks", False) or self.record_selections:
            return False
        return all(s.sampling.greedy and not s.sampling.logprobs and not s.sampling.processes_logits
                   for s in batch.seqs)

    def _greedy_step(self, batch: ScheduledBatch) -> list[GenerateOutput]:
        inputs, token_ids = self.runner.execute_greedy(batch)
        self.scheduler.postprocess(batch)
        timestamp = now()
        return [self._emit(batch.seqs[row], token, None, timestamp)
                for row, token in zip(inputs.sample_rows, token_ids, strict=True)]

    def _emit(self, seq: Sequence, token: int, logprob: TokenLogprob | None, timestamp: float
              ) -> GenerateOutput:
        """Append a sampled token to seq and build its output; a finished seq is retired (its
        pages freed at once)."""
        seq.token_ids.append(token)
        GrammarRuntime.advance(seq, token)
        output = self.trackers[seq.request_id].on_token(token, logprob, timestamp)
        if self.sessions is not None:
            self.sessions.after_token(seq, output.finished)  # before finish() frees its pages
        if output.finished:
            del self.trackers[seq.request_id]
            self._retire(seq)
        return output

    def _round_steps(self, batch: ScheduledBatch, fetching: bool) -> int:
        """Decode steps to run for this batch before scheduling again (`EngineConfig.decode_steps`):
        more than 1 only for a decode-only batch of greedy requests without logprobs, none of
        which would end on length within the round, when the pool holds their pages for all of
        it (then allocated here); 1 while adopted sessions fetch pages or selections are recorded,
        and 1 for a batch with a constrained or penalized request (its next logits depend on the
        token just sampled, on the host)."""
        steps = self.config.decode_steps
        if steps == 1 or fetching or self.record_selections:
            return 1
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
            params = seq.sampling
            if (num_new != 1 or seq.num_uncomputed_tokens != 1 or not params.greedy or params.logprobs
                    or params.processes_logits):
                return 1
            left = min(params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens)
            steps = min(steps, left)  # the tokens it can still produce
        if steps <= 1:
            return 1
        manager = self.block_manager
        if sum(manager.pages_needed(seq, steps) for seq in batch.seqs) > manager.num_free_pages:
            return 1
        for seq in batch.seqs:
            manager.allocate_slots(seq, steps)
        return steps

    def _decode_round(self, batch: ScheduledBatch, steps: int) -> list[GenerateOutput]:
        """Queue `steps` decode steps on the device and hand out the first one's tokens; the next
        `step()` calls hand out the others as the device produces them (`_next_round_step`)."""
        self._round = PendingRound(batch, self.runner.execute_decode_round(batch, steps),
                                   list(range(len(batch))))
        return self._next_round_step()

    def _next_round_step(self) -> list[GenerateOutput]:
        """The pending round's next step: its tokens processed as a single step's are (computed,
        committed, appended, stop conditions), once the device has produced them. Tokens a
        sequence produced after it finished or was aborted are dropped: the device may still
        write its later steps' K/V past the sequence's end, into pages freed with it, but every
        later use of those pages is queued behind the round on the same stream."""
        pending = self._round
        step_tokens = pending.tokens.step(pending.next_step)
        pending.next_step += 1
        timestamp = now()
        outputs: list[GenerateOutput] = []
        still = []
        for row in pending.alive:
            seq = pending.batch.seqs[row]
            tracker = self.trackers.get(seq.request_id)
            if tracker is None or tracker.seq is not seq:  # aborted while the round ran
                continue
            seq.num_computed_tokens += 1  # as Scheduler.postprocess after a single step
            self.block_manager.commit(seq)
            output = self._emit(seq, step_tokens[row], None, timestamp)
            if not output.finished:
                still.append(row)
            outputs.append(output)
        pending.alive = still
        if not still or pending.next_step == pending.tokens.steps:
            self._round = None
        return outputs

    # ---- state for the router and metrics ---------------------------------------------------
    def stats(self) -> EngineStats:
        manager = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running) + len(self.resident or ()),
            num_sparse_resident=len(self.resident or ()),
            sparse_resident_total=0 if self.resident is None else (
                self.resident.stats.moved_in + self.resident.stats.adopted),
            num_waiting=len(self.scheduler.waiting) + len(self.scheduler.swapped),
            num_free_pages=manager.num_free_pages,
            num_total_pages=manager.num_pages,
            num_cached_pages=manager.num_cached_pages,
            prefix_hit_rate=manager.prefix_hit_rate,
            waiting_prefill_pages=-(-self.scheduler.prefill_tokens_left() // self.page_size),
        )

    def drain_kv_events(self) -> list[KVEvent]:
        return self.block_manager.drain_events()
