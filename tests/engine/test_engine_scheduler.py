"""Scheduler decisions on hand-built states: budget, order of service, choice of victim."""

import torch

from msaserve.engine.block_manager import BlockManager
from msaserve.engine.kv.swap import CachePageIO, HostSwapStore, Swapper
from msaserve.engine.scheduler import Scheduler
from msaserve.engine.sequence import Sequence, SequenceStatus
from msaserve.engine.types import SamplingParams
from msaserve.models.cache import allocate_caches
from msaserve.models.presets import get_preset

P = 16  # the tiny preset's page size


def make_scheduler(num_pages: int, budget: int = 64, max_num_seqs: int = 8) -> Scheduler:
    caches = allocate_caches(get_preset("tiny"), num_pages, "cpu", torch.float32)
    manager = BlockManager(num_pages, P)
    swapper = Swapper(HostSwapStore(1 << 30), CachePageIO(caches), manager)
    return Scheduler(manager, swapper, max_num_seqs, budget)


def running(scheduler: Scheduler, name: str, num_tokens: int, num_computed: int) -> Sequence:
    """A sequence already running with `num_computed` of its `num_tokens` tokens in pages."""
    seq = Sequence(name, list(range(3, 3 + num_tokens)), num_tokens, SamplingParams(), 0.0)
    assert scheduler.block_manager.allocate_slots(seq, num_computed)
    seq.num_computed_tokens = num_computed
    seq.status = SequenceStatus.RUNNING
    scheduler.running.append(seq)
    return seq


def waiting(scheduler: Scheduler, name: str, num_tokens: int) -> Sequence:
    seq = Sequence(name, list(range(100, 100 + num_tokens)), num_tokens, SamplingParams(), 0.0)
    scheduler.add(seq)
    return seq


def test_decodes_go_first_and_prefill_chunks_fill_the_budget():
    scheduler = make_scheduler(num_pages=32, budget=20)
    prefilling = running(scheduler, "old-prefill", 100, 32)
    decoding = [running(scheduler, f"d{i}", 21, 20) for i in range(3)]
    new = waiting(scheduler, "new", 30)
    batch = scheduler.schedule()
    assert batch.seqs == [*decoding, prefilling]
    assert batch.num_new_tokens == [1, 1, 1, 17] and batch.num_tokens == 20
    assert new.status is SequenceStatus.WAITING  # no budget left for it
    assert [batch.samples(i) for i in range(4)] == [True, True, True, False]


def test_a_prefill_short_of_pages_preempts_an_unscheduled_sequence_not_a_scheduled_one():
    scheduler = make_scheduler(num_pages=3)
    older = running(scheduler, "older-prefill", 40, 32)  # 2 pages, its next chunk needs a third
    newer = running(scheduler, "newer-decode", 11, 10)  # 1 page, its next token fits in it
    batch = scheduler.schedule()
    assert batch.seqs == [newer] and batch.num_preempted == 1
    assert older.status is SequenceStatus.SWAPPED and scheduler.swapped[0] is older
    assert scheduler.block_manager.num_free_pages == 2


def test_swapped_sequences_resume_before_waiting_ones_are_admitted():
    scheduler = make_scheduler(num_pages=4)
    first = running(scheduler, "first", 33, 32)  # 2 pages (its token 33 needs a third)
    second = running(scheduler, "second", 33, 32)
    batch = scheduler.schedule()  # only one can get its third page: the newer is swapped out
    assert batch.seqs == [first] and second.status is SequenceStatus.SWAPPED
    late = waiting(scheduler, "late", 5)
    scheduler.postprocess(batch)
    first.token_ids.append(7)
    # One page is free: enough for "late", not for "second"; "late" must not overtake it.
    batch = scheduler.schedule()
    assert batch.seqs == [first] and late.status is SequenceStatus.WAITING
    scheduler.finish(first)
    batch = scheduler.schedule()
    assert batch.seqs == [second, late] and second.status is SequenceStatus.RUNNING
    assert second.num_computed_tokens == 32 and len(second.block_table) == 3
