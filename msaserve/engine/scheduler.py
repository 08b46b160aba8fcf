"""Which sequences run in the next step, and how many of their tokens.

One step has a token budget (`max_num_batched_tokens`) shared by decodes and prefill chunks, so
new requests join running decode batches (continuous batching) and a long prompt is prefilled in
chunks between decode steps (chunked prefill). Order of service, for fairness:
1. running sequences that decode (one token each), oldest first;
2. running sequences that are still prefilling, oldest first, in chunks of what budget is left;
3. swapped-out sequences, oldest first (before new work, so preempted requests are not starved);
4. waiting requests, in arrival order, while the pool can hold their whole prompt.
When a running sequence needs a page and none is free, the newest running sequence is preempted:
its pages are swapped out to the page store and come back later (recomputed only when the store
is full). No new work is admitted in a step that had to preempt. A decoding victim that the engine's
sparse-resident lane takes (`offload`) leaves the pool instead: it keeps decoding there, and the
step goes on as if pages had been freed.
"""

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from msaserve.engine.block_manager import BlockManager
from msaserve.engine.kv.swap import Swapper
from msaserve.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """The step's work: `num_new_tokens[i]` tokens of `seqs[i]`, from its num_computed_tokens on."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_preempted: int = 0

    def add(self, seq: Sequence, num_new_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)

    def samples(self, i: int) -> bool:
        """Whether seqs[i] reaches its last token this step and so gets a new token sampled."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_new_tokens[i] == seq.num_tokens


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        swapper: Swapper,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ) -> None:
        self.block_manager = block_manager
        self.swapper = swapper
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.offload: Callable[[Sequence], bool] | None = None
        """Moves a decoding sequence off the pool (the sparse-resident lane) → True if it took it."""

    # ---- queues -----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def prefill_tokens_left(self) -> int:
        """Tokens still to prefill: the running prefills' rest, and every waiting or swapped
        sequence's uncomputed tokens (a waiting prompt's cached prefix is found only at admission,
        so it counts whole). Decoding sequences (one uncomputed token) are not prefill."""
        return sum(s.num_uncomputed_tokens for queue in (self.running, self.waiting, self.swapped)
                   for s in queue if s.num_uncomputed_tokens > 1)

    def finish(self, seq: Sequence) -> None:
        """Retire a sequence from whichever queue holds it and give back its pages at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
            self.swapper.discard(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        decoding = [s for s in self.running if s.num_uncomputed_tokens == 1]
        prefilling = [s for s in self.running if s.num_uncomputed_tokens > 1]
        for seq in decoding + prefilling:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop to make room
            num_new = self._fit_running(seq, min(seq.num_uncomputed_tokens, budget), batch)
            if num_new:
                batch.add(seq, num_new)
                budget -= num_new
        if batch.num_preempted == 0:
            budget = self._resume_swapped(batch, budget)
        if batch.num_preempted == 0 and not self.swapped:
            self._admit_waiting(batch, budget)
        return batch

    def _fit_running(self, seq: Sequence, num_new: int, batch: ScheduledBatch) -> int:
        """Allocate pages for seq's next tokens, preempting the newest running sequences if the
        pool is short. A prefill chunk shrinks to the pages there are before anyone is preempted.
        Returns the tokens scheduled (0 if seq itself was preempted)."""
        manager = self.block_manager
        wanted = num_new
        while True:
            num_new = wanted if wanted == 1 else min(wanted, self._tokens_that_fit(seq))
            if num_new >= 1 and manager.allocate_slots(seq, num_new):
                return num_new
            # The newest sequence not already in this step's batch (seq itself at the latest).
            scheduled = {id(s) for s in batch.seqs}
            victim = next(s for s in reversed(self.running) if id(s) not in scheduled)
            if victim.num_uncomputed_tokens == 1 and self.offload is not None and self.offload(victim):
                if victim is seq:
                    return 0  # it decodes off the pool from this step on
                continue  # its pages are free: try again
            self._preempt(victim)
            batch.num_preempted += 1
            if victim is seq:
                return 0

    def _tokens_that_fit(self, seq: Sequence) -> int:
        page_size = self.block_manager.page_size
        capacity = (len(seq.block_table) + self.block_manager.num_free_pages) * page_size
        return max(0, capacity - seq.num_computed_tokens)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if self.swapper.swap_out(seq):
            self.swapped.append(seq)
            return
        self.recompute(seq)  # the page store is full: prompt and output are computed again later

    def recompute(self, seq: Sequence) -> None:
        """seq (in no queue) starts over from its tokens: its pages freed, it waits first in line."""
        self.block_manager.free(seq)
        seq.num_computed_tokens = seq.num_cached_tokens = 0
        seq.page_hashes = []
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def _resume_swapped(self, batch: ScheduledBatch, budget: int) -> int:
        page_size = self.block_manager.page_size
        while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.swapped[0]
            num_new = min(seq.num_uncomputed_tokens, budget)
            # Conservative: every page it will hold, as if none came from the prefix cache.
            if -(-(seq.num_computed_tokens + num_new) // page_size) > self.block_manager.num_free_pages:
                break
            if not self.swapper.swap_in(seq):
                break
            self.swapped.popleft()
            self.running.append(seq)
            if not self.block_manager.allocate_slots(seq, num_new):
                raise AssertionError(f"pages for {seq.request_id} vanished during swap-in")
            batch.add(seq, num_new)
            budget -= num_new
        return budget

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        manager = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            manager.admit(seq)
            # Admit only if the whole rest of the prompt fits, so that prefills do not fill the
            # pool with half-done prompts and preempt each other.
            if manager.pages_needed(seq, seq.num_uncomputed_tokens) > manager.num_free_pages:
                self._unadmit(seq)
                break
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not manager.allocate_slots(seq, num_new):
                raise AssertionError(f"pages for {seq.request_id} vanished during admission")
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, num_new)
            budget -= num_new

    def _unadmit(self, seq: Sequence) -> None:
        # Not admitted after all: undo the lookup and its count in the hit rate.
        self.block_manager.num_queried_tokens -= seq.num_tokens
        self.block_manager.num_hit_tokens -= seq.num_cached_tokens
        self.block_manager.free(seq)
        seq.num_computed_tokens = seq.num_cached_tokens = 0
        seq.page_hashes = []

    def postprocess(self, batch: ScheduledBatch) -> None:
        """After the model ran: the scheduled tokens are computed; cache their full pages."""
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed_tokens += num_new
            self.block_manager.commit(seq)
